#include "checkpoint/hf_import.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <map>
#include <set>

#include "core/dtype.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "core/progress.h"
#include "data/tokenizer.h"
#include "models/gpt.h"
#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "checkpoint/hf_config.h"
#include "checkpoint/init_from.h"
#include "checkpoint/model_tensors.h"
#include "checkpoint/safetensors.h"
#include "session/session.h"
#include "session/task.h"
#include "checkpoint/train_state.h"

namespace dtrain {

namespace {

// Tensor names of the file keyed by their name without the "transformer." prefix.
struct Hf {
  const ModelTensors& r;
  std::map<std::string, std::string> names;
  const std::string* find(const std::string& short_name) const {
    auto it = names.find(short_name);
    return it == names.end() ? nullptr : &it->second;
  }
  std::vector<int64_t> shape(const std::string& short_name, const char* what) const {
    const std::string* n = find(short_name);
    if (!n) user_error("{}: tensor '{}' ({}) not found: not a GPT-2 model.safetensors", r.origin(), short_name, what);
    return r.shape(*n);
  }
};

}  // namespace

std::string import_gpt2(const std::string& path, const std::string& out, const std::string& recipe) {
  namespace stdfs = std::filesystem;
  if (out.empty()) user_error("import gpt2: --out DIR is required");
  // A directory is a Hugging Face model directory (or a dtrain GPT checkpoint): its
  // model.safetensors (a ZeRO-3 checkpoint: its model shards put together), the head count of
  // its config.json and its tokenizer files.
  std::error_code ec;
  const bool is_dir = stdfs::is_directory(path, ec);
  if (is_dir && !stdfs::is_regular_file(path + "/model.safetensors", ec) && !stdfs::exists(path + "/state.json", ec))
    user_error("{}: no model.safetensors (a Hugging Face model directory holds config.json and model.safetensors)",
               path);
  const ModelTensors r(path);
  const std::string& file = r.origin();
  // The model directory: the one given, or the one holding the file (its config.json and
  // tokenizer files lie beside model.safetensors, as save_pretrained writes them).
  stdfs::path model_path = is_dir ? stdfs::path(path) : stdfs::path(path).parent_path();
  if (model_path.empty()) model_path = stdfs::path(".");
  const std::string model_dir = model_path.string();
  const auto hf_config = read_hf_gpt2_config(model_dir);
  const int64_t config_heads = hf_config ? hf_config->n_head : 0;
  Hf hf{r, {}};
  for (const std::string& n : r.names()) {
    if (is_gpt2_mask_buffer(n)) continue;
    const std::string s = n.rfind("transformer.", 0) == 0 ? n.substr(12) : n;
    if (!hf.names.emplace(s, n).second)
      user_error("{}: tensor '{}' appears both with and without the 'transformer.' prefix", file, s);
  }
  const auto wte = hf.shape("wte.weight", "token embedding");
  const auto wpe = hf.shape("wpe.weight", "position embedding");
  if (wte.size() != 2 || wpe.size() != 2 || wte[1] != wpe[1])
    user_error("{}: wte.weight / wpe.weight must be [vocab, C] / [positions, C]", file);
  const int64_t V = wte[0], C = wte[1], P = wpe[0];
  int64_t L = 0;
  while (hf.find("h." + std::to_string(L) + ".ln_1.weight")) ++L;
  if (L == 0) user_error("{}: no h.0.ln_1.weight: not a GPT-2 model.safetensors", file);
  if (const std::string* lm = hf.find("lm_head.weight")) {  // must be the tied copy of wte
    if (read_f32(r, *lm) != read_f32(r, *hf.find("wte.weight")))
      user_error("{}: lm_head.weight differs from wte.weight (dtrain ties the LM head)", file);
    hf.names.erase("lm_head.weight");
  }

  // The recipe: the given one (its model keys checked against the file) or a minimal one.
  auto make_config = [&]() -> Config {
    if (recipe.empty()) {
      // The weights fix every size but the head count: it comes from config.json or a recipe,
      // never from a guess (n_embd / 64 builds a different model that loads without error).
      if (config_heads == 0)
        user_error("{}: the attention head count cannot be read from the weights and {}/config.json does not exist: "
                   "put the model's config.json (n_head) beside the file, or give a recipe with --config RECIPE "
                   "(model.n_head)",
                   file, model_dir);
      if (C % config_heads != 0)
        user_error("{}/config.json: n_head {} does not divide n_embd {}", model_dir, config_heads, C);
      const int64_t heads = config_heads;
      const std::string toml = fmt::format(
          "[run]\ndevice = \"cpu\"\n\n[model]\nkind = \"gpt\"\nn_layer = {}\nn_head = {}\nn_embd = {}\n"
          "block_size = {}\nvocab_size = {}\n\n[data]\nkind = \"tokens\"\npath = \"data/tokens\"\n\n"
          "[optim]\nname = \"adamw\"\n",
          L, heads, C, P, V);
      return Config::parse(toml, file + " (import gpt2)");
    }
    Config cfg = Config::load(recipe);
    if (cfg.model.kind != "gpt")
      user_error("{}: model.kind = \"{}\": expected \"gpt\" to import GPT-2", recipe, cfg.model.kind);
    GptSpec spec = gpt_spec_from(cfg);
    auto agree = [&](const char* key, int64_t want, int64_t got) {
      if (want != got)
        user_error("{}: model.{} = {} does not match {} ({})", recipe, key, got, file, want);
    };
    agree("n_layer", L, spec.n_layer);
    agree("n_embd", C, spec.n_embd);
    agree("vocab_size", V, spec.vocab_size);
    if (config_heads > 0) agree("n_head", config_heads, spec.n_head);
    if (spec.block_size > P)
      user_error("{}: model.block_size = {} exceeds the {} positions of {} (wpe.weight)", recipe,
                 spec.block_size, P, file);
    // Record the effective architecture explicitly (a preset may have supplied it).
    cfg.assign(cfg.model.n_layer, spec.n_layer);
    cfg.assign(cfg.model.n_head, spec.n_head);
    cfg.assign(cfg.model.n_embd, spec.n_embd);
    cfg.assign(cfg.model.block_size, spec.block_size);
    cfg.assign(cfg.model.vocab_size, spec.vocab_size);
    return cfg;
  };
  const Config cfg = make_config();
  SessionOptions so;
  so.with_train_data = false;
  so.with_eval_data = false;
  so.with_optimizer = true;  // zero optimizer state: `train --resume` starts from it
  auto s = make_session(cfg, so);
  if (!tokenizer_files(model_dir).empty()) s->vocab_dir = model_dir;  // checkpoints carry the tokenizer files
  const int64_t block = gpt_spec_from(cfg).block_size;

  // Every dtrain tensor from the file (names without "transformer."); wpe keeps `block` rows.
  std::set<std::string> used;
  std::map<std::string, std::vector<float>> hold;
  Progress progress("import " + file, int64_t(hf.names.size()), "tensors");  // a line on a terminal, or every 10 s
  auto lookup = [&](const std::string& name) -> std::optional<ImportTensor> {
    const std::string s_name = name.rfind("transformer.", 0) == 0 ? name.substr(12) : name;
    const std::string* n = hf.find(s_name);
    if (!n) return std::nullopt;
    used.insert(s_name);
    std::vector<float>& v = hold[name] = read_f32(r, *n);
    ImportTensor t;
    t.dtype = "F32";
    t.shape = r.shape(*n);
    if (s_name == "wpe.weight") {
      t.shape[0] = block;
      v.resize(size_t(block * C));
    }
    t.data = reinterpret_cast<const uint8_t*>(v.data());
    t.nbytes = v.size() * 4;
    progress.add(1);
    return t;
  };
  s->params.import_state(lookup, file);
  for (const auto& [short_name, n] : hf.names)
    if (!used.count(short_name))
      user_error("{}: tensor '{}' is not part of a GPT-2 model of {} layers", file, n, L);
  hold.clear();
  progress.finish();

  CheckpointManager mgr(out);
  const std::string dir =
      mgr.save(0, [&](const std::string& tmp) { write_checkpoint_files(*s, TrainState{}, tmp); }, 0);
  log::info("imported {} ({} layers, {} heads, n_embd {}, vocab {}, block {}) -> {}", file, L,
            gpt_spec_from(cfg).n_head, C, V, block, dir);
  return dir;
}

std::string import_llama(const std::string& dir, const std::string& out) {
  namespace stdfs = std::filesystem;
  if (out.empty()) user_error("import llama: --out DIR is required");
  std::error_code ec;
  if (!stdfs::is_directory(dir, ec)) user_error("{}: not a directory (a Hugging Face model directory)", dir);
  if (weights_only_file(dir).empty())
    user_error("{}: no model.safetensors or model.safetensors.index.json without SHA256SUMS (a Hugging Face model "
               "directory as save_pretrained writes it)",
               dir);
  MoeConfig moe;  // Mixtral / Qwen2-MoE: the experts
  const std::optional<LlamaConfig> hc = read_hf_llama_config(dir, &moe);
  if (!hc) user_error("{}/config.json: missing (it gives the model's architecture)", dir);
  const std::string toml = hf_llama_model_toml(*hc, moe) +
                           "\n[run]\ndevice = \"cpu\"\n\n[data]\nkind = \"tokens\"\npath = \"data/tokens\"\n\n"
                           "[optim]\nname = \"adamw\"\n";
  const Config cfg = Config::parse(toml, dir + "/config.json (import llama)");
  SessionOptions so;
  so.with_train_data = false;
  so.with_eval_data = false;
  so.with_optimizer = true;  // zero optimizer state: `train --resume` starts from it
  auto s = make_session(cfg, so);
  if (!tokenizer_files(dir).empty()) s->vocab_dir = dir;  // checkpoints carry the tokenizer files
  const InitReport r = init_model_from(*s, dir, /*strict=*/true);
  CheckpointManager mgr(out);
  const std::string ck =
      mgr.save(0, [&](const std::string& tmp) { write_checkpoint_files(*s, TrainState{}, tmp); }, 0);
  log::info("imported {} ({}, {} tensors: {} layers, {} heads, {} key/value heads, hidden {}, vocab {}) -> {}", r.file,
            hc->model_type, r.loaded, hc->num_hidden_layers, hc->num_attention_heads, hc->kv_heads(), hc->hidden_size,
            hc->vocab_size, ck);
  return ck;
}

}  // namespace dtrain

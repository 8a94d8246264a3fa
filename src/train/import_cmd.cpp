// dtrain import gpt2 FILE.safetensors|MODEL_DIR --out DIR [--config RECIPE]: a Hugging Face
// GPT-2 model.safetensors (GPT2Model / GPT2LMHeadModel names with or without "transformer.",
// Conv1D weights [in, out], tied or absent lm_head, attn.bias / attn.masked_bias buffers
// ignored) becomes the step-0 checkpoint of run directory DIR
// (DIR/checkpoints/step_00000000 with model.safetensors, optimizer state of zeros,
// state.json, config.toml, SHA256SUMS), ready for `dtrain sample --checkpoint DIR` or
// `dtrain train --resume DIR`. The shapes give n_layer, n_embd, vocab_size and block_size
// (the position table's rows); n_head is the recipe's, else the one of MODEL_DIR/config.json
// (whose activation, layer norm epsilon and tied head are checked), else n_embd / 64 (every
// GPT-2 size has 64-dim heads). MODEL_DIR's vocab.json + merges.txt (or encoder.json +
// vocab.bpe), when present, go into the checkpoint, so `dtrain sample` needs no --vocab. A recipe's model keys must agree with the file; its block_size may be
// smaller than the position table (the leading rows are kept), never larger.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <map>
#include <set>

#include "cli/commands.h"
#include "core/dtype.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "data/tokenizer.h"
#include "models/gpt.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/hf_config.h"
#include "train/safetensors.h"
#include "train/session.h"
#include "train/task.h"
#include "train/train_state.h"

namespace dtrain {

namespace {

// Tensor names of the file keyed by their name without the "transformer." prefix.
struct Hf {
  const SafetensorsReader& r;
  std::map<std::string, std::string> names;
  const std::string* find(const std::string& short_name) const {
    auto it = names.find(short_name);
    return it == names.end() ? nullptr : &it->second;
  }
  std::vector<int64_t> shape(const std::string& short_name, const char* what) const {
    const std::string* n = find(short_name);
    if (!n) user_error("{}: tensor '{}' ({}) not found: not a GPT-2 model.safetensors", r.path(), short_name, what);
    return r.shape(*n);
  }
};

}  // namespace

int cmd_import_gpt2(const ImportGpt2Args& a) {
  namespace stdfs = std::filesystem;
  if (a.out.empty()) user_error("import gpt2: --out DIR is required");
  // A directory is a Hugging Face model directory (or a dtrain GPT checkpoint): its
  // model.safetensors, the head count of its config.json and its tokenizer files.
  std::error_code ec;
  const bool is_dir = stdfs::is_directory(a.file, ec);
  const std::string file = is_dir ? a.file + "/model.safetensors" : a.file;
  if (is_dir && !stdfs::is_regular_file(file, ec))
    user_error("{}: no model.safetensors (a Hugging Face model directory holds config.json and model.safetensors)",
               a.file);
  const auto hf_config = is_dir ? read_hf_gpt2_config(a.file) : std::nullopt;
  const int64_t config_heads = hf_config ? hf_config->n_head : 0;
  SafetensorsReader r(file);
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
    if (a.config.empty()) {
      if (config_heads > 0 && C % config_heads != 0)
        user_error("{}/config.json: n_head {} does not divide n_embd {}", a.file, config_heads, C);
      if (config_heads == 0 && C % 64 != 0)
        user_error("{}: n_embd {} is not a multiple of 64: give the head count with --config RECIPE (model.n_head)",
                   file, C);
      const int64_t heads = config_heads > 0 ? config_heads : C / 64;
      const std::string toml = fmt::format(
          "[run]\ndevice = \"cpu\"\n\n[model]\nkind = \"gpt\"\nn_layer = {}\nn_head = {}\nn_embd = {}\n"
          "block_size = {}\nvocab_size = {}\n\n[data]\nkind = \"tokens\"\npath = \"data/tokens\"\n\n"
          "[optim]\nname = \"adamw\"\n",
          L, heads, C, P, V);
      return Config::parse(toml, file + " (import gpt2)");
    }
    Config cfg = Config::load(a.config);
    if (cfg.s("model.kind") != "gpt")
      user_error("{}: model.kind = \"{}\": expected \"gpt\" to import GPT-2", a.config, cfg.s("model.kind"));
    GptSpec spec = gpt_spec_from(cfg);
    auto agree = [&](const char* key, int64_t want, int64_t got) {
      if (want != got)
        user_error("{}: model.{} = {} does not match {} ({})", a.config, key, got, file, want);
    };
    agree("n_layer", L, spec.n_layer);
    agree("n_embd", C, spec.n_embd);
    agree("vocab_size", V, spec.vocab_size);
    if (config_heads > 0) agree("n_head", config_heads, spec.n_head);
    if (spec.block_size > P)
      user_error("{}: model.block_size = {} exceeds the {} positions of {} (wpe.weight)", a.config,
                 spec.block_size, P, file);
    // Record the effective architecture explicitly (a preset may have supplied it).
    cfg.set("model.n_layer", std::to_string(spec.n_layer));
    cfg.set("model.n_head", std::to_string(spec.n_head));
    cfg.set("model.n_embd", std::to_string(spec.n_embd));
    cfg.set("model.block_size", std::to_string(spec.block_size));
    cfg.set("model.vocab_size", std::to_string(spec.vocab_size));
    return cfg;
  };
  const Config cfg = make_config();
  SessionOptions so;
  so.with_train_data = false;
  so.with_eval_data = false;
  so.with_optimizer = true;  // zero optimizer state: `train --resume` starts from it
  auto s = make_session(cfg, so);
  if (is_dir && find_gpt2_vocab(a.file).found()) s->vocab_dir = a.file;  // checkpoints carry the tokenizer files
  const int64_t block = gpt_spec_from(cfg).block_size;

  // Every dtrain tensor from the file (names without "transformer."); wpe keeps `block` rows.
  std::set<std::string> used;
  std::map<std::string, std::vector<float>> hold;
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
    return t;
  };
  s->params.import_state(lookup, file);
  for (const auto& [short_name, n] : hf.names)
    if (!used.count(short_name))
      user_error("{}: tensor '{}' is not part of a GPT-2 model of {} layers", file, n, L);
  hold.clear();

  CheckpointManager mgr(a.out);
  const std::string dir =
      mgr.save(0, [&](const std::string& tmp) { write_checkpoint_files(*s, TrainState{}, tmp); }, 0);
  log::info("imported {} ({} layers, n_embd {}, vocab {}, block {}) -> {}", file, L, C, V, block, dir);
  return 0;
}

}  // namespace dtrain

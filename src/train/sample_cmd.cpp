// dtrain sample: autoregressive text from a GPT checkpoint. The recipe is the checkpoint's
// config.toml (a Hugging Face GPT-2 directory: its config.json); the tokenizer is the one the token shards were made with (data.path's
// manifest.json "tokenizer": byte, or gpt2 with --vocab DIR), byte when there is no manifest
// and the vocabulary has 256 ids.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "models/gpt.h"
#include "train/hf_config.h"
#include "train/init_from.h"
#include "train/session.h"
#include "train/train_state.h"

namespace dtrain {

std::string resolve_checkpoint_dir(const std::string& path);  // eval_cmd.cpp

namespace {

std::string tokenizer_kind(const Config& cfg, const GptSpec& spec) {
  const std::string manifest = cfg.s("data.path") + "/manifest.json";
  std::ifstream f(manifest);
  if (f) {
    try {
      auto j = nlohmann::json::parse(f);
      if (j.contains("tokenizer")) return j.at("tokenizer").get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      user_error("{}: {}", manifest, e.what());
    }
  }
  if (spec.vocab_size == 256) return "byte";
  if (spec.vocab_size == 50257) return "gpt2";
  user_error("sample: cannot tell the tokenizer of model.vocab_size = {} ({} not found)", spec.vocab_size, manifest);
}

}  // namespace

int cmd_sample(const SampleArgs& a) {
  namespace stdfs = std::filesystem;
  // A Hugging Face GPT-2 directory (config.json + model.safetensors, no SHA256SUMS): the
  // model is built from config.json and initialised from its weights.
  const std::string& in = a.checkpoint;
  const bool hf = stdfs::is_directory(in) && !weights_only_file(in).empty();
  std::string ck = hf ? in : resolve_checkpoint_dir(in);
  const std::string recipe = hf ? in + "/config.json" : ck + "/config.toml";
  if (!stdfs::exists(recipe)) user_error("checkpoint {}: {} not found", ck, recipe);
  auto hf_recipe = [&] {
    const HfGpt2Config c = *read_hf_gpt2_config(in);
    if (c.n_layer < 1 || c.n_embd < 1 || c.n_positions < 1 || c.vocab_size < 1)
      user_error("{}: n_layer, n_embd, n_positions and vocab_size must all be positive", recipe);
    return Config::parse(fmt::format("[model]\nkind = \"gpt\"\nn_layer = {}\nn_head = {}\nn_embd = {}\nblock_size = {}\n"
                                     "vocab_size = {}\n[data]\nkind = \"synthetic\"\n",
                                     c.n_layer, c.n_head, c.n_embd, c.n_positions, c.vocab_size),
                         recipe);
  };
  Config cfg = hf ? hf_recipe() : Config::load(recipe);
  if (cfg.s("model.kind") != "gpt")
    user_error("{}: model.kind = \"{}\": dtrain sample needs a GPT checkpoint", recipe, cfg.s("model.kind"));
  if (!a.device.empty()) cfg.set("run.device", "\"" + a.device + "\"");
  SessionOptions so;
  so.with_train_data = false;
  so.with_eval_data = false;
  so.with_optimizer = false;
  auto s = make_session(cfg, so);
  if (hf)
    init_model_from(*s, in, /*strict=*/true);
  else
    load_model_weights(*s, ck);
  GptSpec spec = gpt_spec_from(cfg);
  const std::string kind = tokenizer_kind(cfg, spec);
  std::string vocab = a.vocab;
  if (kind == "gpt2" && vocab.empty()) {  // the checkpoint's copy, else the one beside the shards
    for (const std::string& d : {ck, cfg.s("data.path")})
      if (find_gpt2_vocab(d).found()) {
        vocab = d;
        break;
      }
    if (vocab.empty())
      user_error("sample: {} uses the GPT-2 tokenizer and holds no vocab.json + merges.txt: give its files with "
                 "--vocab DIR (encoder.json, vocab.bpe)",
                 ck);
  }
  auto tok = make_tokenizer(kind, vocab);
  if (tok->vocab_size() > spec.vocab_size)
    user_error("sample: the {} tokenizer has {} ids but model.vocab_size = {}", kind, tok->vocab_size(),
               spec.vocab_size);
  std::vector<int32_t> prompt = tok->encode(a.prompt);
  if (prompt.empty() && tok->eot() >= 0) prompt.push_back(tok->eot());
  if (prompt.empty()) user_error("sample: --prompt is empty (give at least one character)");
  SampleOptions o;
  o.max_new_tokens = a.tokens;
  o.temperature = float(a.temperature);
  o.top_k = a.top_k;
  o.kv_cache = !a.no_kv_cache;
  Rng rng(a.seed, stream_id(0x53414d50));
  auto* gpt = dynamic_cast<GptModel*>(s->model.get());
  if (!gpt) fault("sample: the session's model is not a GPT");
  std::vector<int32_t> ids = gpt_generate(*gpt, *s->be, *s->arena, prompt, o, rng);
  fmt::print("{}\n", tok->decode(ids));
  return 0;
}

}  // namespace dtrain

// dtrain sample: autoregressive text from a GPT checkpoint. The recipe is the checkpoint's
// config.toml (a Hugging Face GPT-2 directory: its config.json); the tokenizer: see
// choose_tokenizer below.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "checkpoint/checkpoint.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "models/gpt.h"
#include "checkpoint/hf_config.h"
#include "checkpoint/init_from.h"
#include "checkpoint/safetensors.h"
#include "session/session.h"
#include "checkpoint/train_state.h"

namespace dtrain::cli {

namespace {

// dtrain sample: text from a GPT checkpoint (its recipe and tokenizer come from the run).
struct SampleArgs {
  std::string checkpoint;  // checkpoint directory (or a run dir: its latest), or a Hugging Face GPT-2 directory
  std::string prompt = "\n";
  int tokens = 100;
  double temperature = 1.0;
  int top_k = 0;
  uint64_t seed = 0;
  std::string vocab;  // a tokenizer.json (or a directory holding one), or a directory with GPT-2's files
  std::string device;
  bool no_kv_cache = false;  // --no-kv-cache: one full forward per token (reference path)
  std::string logits;        // --logits FILE: the prompt's logits as safetensors
};

// The logits of one forward over `prompt` (batch 1, inference) as FILE's tensor "logits", f32
// [tokens, vocab_size] (the padded columns dropped): what the interop tests compare with
// transformers' and PEFT's.
void write_prompt_logits(Session& s, GptModel& gpt, const std::vector<int32_t>& prompt, const std::string& file) {
  const int64_t T = int64_t(prompt.size()), V = gpt.spec().vocab_size;
  if (T > gpt.spec().block_size)
    user_error("sample --logits: the prompt has {} tokens, more than the model's {}", T, gpt.spec().block_size);
  s.arena->reset();
  Ctx ctx{*s.be, *s.arena, false, {}, {}};
  Tensor ids = s.arena->alloc(DType::I32, Shape{1, T});
  s.be->copy_from_host(ids.data, prompt.data(), size_t(T) * 4);
  Tensor lg = gpt.forward(ctx, ids);  // [T, padded vocabulary] in the activation dtype
  if (lg.dtype != DType::F32) {
    Tensor f = s.arena->alloc(DType::F32, lg.shape);
    s.be->cast(lg, f);
    lg = f;
  }
  std::vector<float> all(size_t(lg.numel())), out;
  s.be->copy_to_host(all.data(), lg.data, all.size() * 4);
  const int64_t Vp = lg.dim(1);
  for (int64_t t = 0; t < T; ++t) out.insert(out.end(), all.begin() + t * Vp, all.begin() + t * Vp + V);
  write_safetensors(file, {StTensor{"logits", "F32", {T, V}, out.data(), out.size() * 4}}, {{"format", "pt"}});
  s.arena->reset();
}

// The tokenizer, as make_tokenizer takes it: kind "byte" | "gpt2" (with vocab, the directory of
// GPT-2's files) | the path of a tokenizer.json. --vocab when given (a tokenizer.json, a directory
// holding one, else GPT-2's files); else the one data.path's manifest.json names (a dtrain run's
// shards), its files from the checkpoint, else from beside the shards; else the checkpoint's (or
// Hugging Face directory's) own tokenizer.json, else GPT-2's vocabulary there; else told by the
// vocabulary size (256 bytes, 50257 GPT-2).
struct TokenizerChoice {
  std::string kind, vocab;
};
TokenizerChoice choose_tokenizer(const Config& cfg, const GptSpec& spec, const std::string& vocab,
                                 const std::string& ck) {
  if (!vocab.empty()) {
    const std::string tj = find_hf_tokenizer(vocab);
    return tj.empty() ? TokenizerChoice{"gpt2", vocab} : TokenizerChoice{tj, ""};
  }
  const std::string data = cfg.data.path;  // a Hugging Face directory's recipe has no data
  const std::string manifest = data + "/manifest.json";
  std::string kind;
  if (std::ifstream f(manifest); !data.empty() && f) {
    try {
      auto j = nlohmann::json::parse(f);
      if (j.contains("tokenizer")) kind = j.at("tokenizer").get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      user_error("{}: {}", manifest, e.what());
    }
  }
  if (kind.empty()) {  // no shards to ask: the checkpoint's files, else the vocabulary size
    if (!find_hf_tokenizer(ck).empty())
      kind = "tokenizer.json";
    else if (find_gpt2_vocab(ck).found() || spec.vocab_size == 50257)
      kind = "gpt2";
    else if (spec.vocab_size == 256)
      kind = "byte";
    else
      user_error(
          "sample: cannot tell the tokenizer of model.vocab_size = {} ({}): give it with --vocab (a "
          "tokenizer.json, or GPT-2's files)",
          spec.vocab_size,
          data.empty() ? ck + " holds no tokenizer.json nor vocab.json + merges.txt" : manifest + " not found");
  }
  if (kind == "byte") return {"byte", ""};
  for (const std::string& d : {ck, data}) {  // the checkpoint's copy, else the one beside the shards
    if (d.empty()) continue;
    if (kind == "tokenizer.json" && !find_hf_tokenizer(d).empty()) return {find_hf_tokenizer(d), ""};
    if (kind == "gpt2" && find_gpt2_vocab(d).found()) return {"gpt2", d};
  }
  if (kind == "gpt2")
    user_error(
        "sample: {} uses the GPT-2 tokenizer and holds no vocab.json + merges.txt: give its files with --vocab DIR "
        "(encoder.json, vocab.bpe)",
        ck);
  if (kind == "tokenizer.json")
    user_error(
        "sample: {} was trained on shards of a tokenizer.json that neither it nor {} holds: give it with --vocab "
        "FILE",
        ck, data);
  user_error("{}: unknown tokenizer \"{}\" (expected byte, gpt2 or tokenizer.json)", manifest, kind);
}

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
    if (is_hf_llama_type(hf_model_type(in))) {
      MoeConfig moe;  // Mixtral / Qwen2-MoE: the experts
      const LlamaConfig c = *read_hf_llama_config(in, &moe);
      return Config::parse(hf_llama_model_toml(c, moe) + "[data]\nkind = \"synthetic\"\n", recipe);
    }
    const HfGpt2Config c = *read_hf_gpt2_config(in);
    if (c.n_layer < 1 || c.n_embd < 1 || c.n_positions < 1 || c.vocab_size < 1)
      user_error("{}: n_layer, n_embd, n_positions and vocab_size must all be positive", recipe);
    return Config::parse(fmt::format("[model]\nkind = \"gpt\"\nn_layer = {}\nn_head = {}\nn_embd = {}\nblock_size = {}\n"
                                     "vocab_size = {}\n[data]\nkind = \"synthetic\"\n",
                                     c.n_layer, c.n_head, c.n_embd, c.n_positions, c.vocab_size),
                         recipe);
  };
  Config cfg = hf ? hf_recipe() : Config::load(recipe);
  if (cfg.model.kind != "gpt")
    user_error("{}: model.kind = \"{}\": dtrain sample needs a GPT checkpoint", recipe, cfg.model.kind);
  if (!a.device.empty()) cfg.assign(cfg.run.device, a.device);
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
  const TokenizerChoice choice = choose_tokenizer(cfg, spec, a.vocab, ck);
  auto tok = make_tokenizer(choice.kind, choice.vocab);
  if (tok->vocab_size() > spec.vocab_size)
    user_error("sample: the {} tokenizer has {} ids but model.vocab_size = {}", tok->name(), tok->vocab_size(),
               spec.vocab_size);
  // as transformers' tokenizer(prompt) gives it: a tokenizer.json's template tokens first (Llama 3's
  // <|begin_of_text|>, what every document of its shards starts with)
  std::vector<int32_t> prompt = tok->special_template().before;
  for (int32_t id : tok->encode(a.prompt)) prompt.push_back(id);
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
  if (!a.logits.empty()) write_prompt_logits(*s, *gpt, prompt, a.logits);
  std::vector<int32_t> ids = gpt_generate(*gpt, *s->be, *s->arena, prompt, o, rng);
  fmt::print("{}\n", tok->decode(ids));
  return 0;
}

}  // namespace

void add_sample(CLI::App& app, Run& run) {
  auto a = std::make_shared<SampleArgs>();
  auto* c = app.add_subcommand("sample", "generate text from a GPT checkpoint");
  c->add_option("--checkpoint", a->checkpoint,
                "checkpoint directory, a run directory (its latest), or a Hugging Face GPT-2 model directory")
      ->type_name("DIR")
      ->required();
  c->add_option("--prompt", a->prompt, "text the generation continues")->capture_default_str();
  c->add_option("--tokens", a->tokens, "tokens to generate")->capture_default_str()->check(CLI::Range(0, 1000000));
  c->add_option("--temperature", a->temperature, "softmax temperature (0 = greedy)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  c->add_option("--top-k", a->top_k, "sample among the K most likely tokens (0 = all)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  c->add_option("--seed", a->seed, "random seed")->capture_default_str();
  c->add_flag("--no-kv-cache", a->no_kv_cache, "recompute the whole context for every token (reference path)");
  c->add_option("--logits", a->logits,
                "also write the logits of one forward over the prompt to FILE (safetensors: \"logits\", f32 "
                "[prompt tokens, vocab_size])")
      ->type_name("FILE");
  c->add_option("--vocab", a->vocab,
                "the tokenizer: a Hugging Face tokenizer.json (or a directory holding one), or a directory with GPT-2's "
                "files (encoder.json + vocab.bpe, or vocab.json + merges.txt); default: the checkpoint's own, else "
                "those beside the token shards")
      ->type_name("FILE|DIR");
  c->add_option("--device", a->device, "run on this device (overrides run.device)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  set_examples(c, {"dtrain sample --checkpoint runs/gpt_fortunes --prompt \"The \" --tokens 200 --top-k 40",
                   "dtrain sample --checkpoint runs/gpt_fortunes/checkpoints/best --temperature 0   (greedy)",
                   "dtrain sample --checkpoint HF_GPT2_DIR --prompt \"Hello\"    (a save_pretrained directory)"});
  run_when_parsed(c, run, a, cmd_sample);
}

}  // namespace dtrain::cli

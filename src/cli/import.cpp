// dtrain import gpt2 / llama: Hugging Face weights -> a dtrain run directory (checkpoint/hf_import.h).
#include "cli/command.h"

#include <functional>
#include <memory>

#include "checkpoint/hf_import.h"

namespace dtrain::cli {

namespace {
struct ImportArgs {
  std::string file, out;
  std::string config;  // gpt2's --config RECIPE: its [model] must fit the file ("" = from config.json)
};

// `dtrain import <name> SOURCE --out DIR`: the subcommand with its source and --out, whose entry
// point runs import_fn on them.
struct Source {
  const char* name;
  const char* about;
  const char* arg;  // the positional's name, help and type
  const char* arg_help;
  const char* arg_type;
};
CLI::App* add_source(CLI::App* c, Run& run, const std::shared_ptr<ImportArgs>& a, const Source& src,
                     std::function<void(const ImportArgs&)> import_fn) {
  auto* s = c->add_subcommand(src.name, src.about);
  s->add_option(src.arg, a->file, src.arg_help)->type_name(src.arg_type)->required();
  s->add_option("--out", a->out, "run directory to create")->type_name("DIR")->required();
  s->callback([a, import_fn, &run] {
    run = [a, import_fn] {
      import_fn(*a);
      return 0;
    };
  });
  return s;
}
}  // namespace

void add_import(CLI::App& app, Run& run) {
  auto* c = app.add_subcommand("import", "turn another framework's weights into a dtrain checkpoint");
  c->require_subcommand(1);
  auto a = std::make_shared<ImportArgs>();
  auto* g = add_source(
      c, run, a,
      {"gpt2", "Hugging Face GPT-2 model.safetensors or model directory -> run directory with a step-0 checkpoint",
       "file",
       "a model directory (model.safetensors, config.json, the tokenizer's vocab.json + merges.txt), or its "
       "model.safetensors (config.json is read from beside it)",
       "FILE|DIR"},
      [](const ImportArgs& x) { import_gpt2(x.file, x.out, x.config); });
  g->add_option("--config", a->config, "recipe whose [model] must fit the file (needed when no config.json gives n_head)")
      ->type_name("RECIPE");
  set_examples(g, {"dtrain import gpt2 ~/hf/gpt2 --out runs/gpt2             (a save_pretrained directory)",
                   "dtrain import gpt2 ~/hf/gpt2/model.safetensors --out runs/gpt2",
                   "dtrain import gpt2 weights.safetensors --out runs/g --config configs/tiny_gpt.toml",
                   "then: dtrain sample --checkpoint runs/gpt2 --prompt \"Hello\""});
  auto* l = add_source(c, run, std::make_shared<ImportArgs>(),
                       {"llama", "Hugging Face Llama / Qwen2 model directory -> run directory with a step-0 checkpoint",
                        "dir",
                        "a save_pretrained directory of LlamaForCausalLM or Qwen2ForCausalLM: config.json, and "
                        "model.safetensors or model.safetensors.index.json with its shards",
                        "DIR"},
                       [](const ImportArgs& x) { import_llama(x.file, x.out); });
  set_examples(l, {"dtrain import llama ~/hf/SmolLM2-135M --out runs/smollm",
                   "then: dtrain sample --checkpoint runs/smollm --prompt \"Hello\""});
  set_examples(c, {"dtrain import gpt2 ~/hf/gpt2 --out runs/gpt2", "dtrain import llama ~/hf/llama --out runs/llama",
                   "dtrain import gpt2 --help"});
}

}  // namespace dtrain::cli

// dtrain import gpt2: Hugging Face GPT-2 weights -> a dtrain run directory (checkpoint/hf_import.h).
#include "cli/command.h"
#include "checkpoint/hf_import.h"

namespace dtrain::cli {

namespace {
struct ImportGpt2Args {
  std::string file, out;
  std::string config;  // --config RECIPE: its [model] must fit the file ("" = from config.json)
};
}  // namespace

void add_import(CLI::App& app, Run& run) {
  auto a = std::make_shared<ImportGpt2Args>();
  auto* c = app.add_subcommand("import", "turn another framework's weights into a dtrain checkpoint");
  c->require_subcommand(1);
  auto* g = c->add_subcommand(
      "gpt2", "Hugging Face GPT-2 model.safetensors or model directory -> run directory with a step-0 checkpoint");
  g->add_option("file", a->file,
                "a model directory (model.safetensors, config.json, the tokenizer's vocab.json + merges.txt), or its "
                "model.safetensors (config.json is read from beside it)")
      ->type_name("FILE|DIR")
      ->required();
  g->add_option("--out", a->out, "run directory to create")->type_name("DIR")->required();
  g->add_option("--config", a->config, "recipe whose [model] must fit the file (needed when no config.json gives n_head)")
      ->type_name("RECIPE");
  set_examples(g, {"dtrain import gpt2 ~/hf/gpt2 --out runs/gpt2             (a save_pretrained directory)",
                   "dtrain import gpt2 ~/hf/gpt2/model.safetensors --out runs/gpt2",
                   "dtrain import gpt2 weights.safetensors --out runs/g --config configs/tiny_gpt.toml",
                   "then: dtrain sample --checkpoint runs/gpt2 --prompt \"Hello\""});
  auto la = std::make_shared<ImportGpt2Args>();
  auto* l = c->add_subcommand(
      "llama", "Hugging Face Llama / Qwen2 model directory -> run directory with a step-0 checkpoint");
  l->add_option("dir", la->file,
                "a save_pretrained directory of LlamaForCausalLM or Qwen2ForCausalLM: config.json, and "
                "model.safetensors or model.safetensors.index.json with its shards")
      ->type_name("DIR")
      ->required();
  l->add_option("--out", la->out, "run directory to create")->type_name("DIR")->required();
  set_examples(l, {"dtrain import llama ~/hf/SmolLM2-135M --out runs/smollm",
                   "then: dtrain sample --checkpoint runs/smollm --prompt \"Hello\""});
  l->callback([la, &run] {
    run = [la] {
      import_llama(la->file, la->out);
      return 0;
    };
  });
  set_examples(c, {"dtrain import gpt2 ~/hf/gpt2 --out runs/gpt2", "dtrain import llama ~/hf/llama --out runs/llama",
                   "dtrain import gpt2 --help"});
  g->callback([a, &run] {
    run = [a] {
      import_gpt2(a->file, a->out, a->config);
      return 0;
    };
  });
}

}  // namespace dtrain::cli

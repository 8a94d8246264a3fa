// dtrain checkpoint consolidate: a checkpoint's model as a plain model directory
// (checkpoint/consolidate.h); dtrain checkpoint merge-lora: a LoRA checkpoint's adapters merged
// into their base model, a Hugging Face model directory (checkpoint/lora_files.h).
#include <fmt/ranges.h>

#include "cli/command.h"
#include "checkpoint/consolidate.h"
#include "checkpoint/lora_files.h"

namespace dtrain::cli {

namespace {

struct ConsolidateArgs {
  std::string path, out;
};

int cmd_consolidate(const ConsolidateArgs& a) {
  const ConsolidatedModel m = consolidate_checkpoint(a.path, a.out);
  fmt::print("checkpoint {} verified\n", m.checkpoint);
  fmt::print("wrote {}: {} ({} tensors; {} bytes in all)\n", m.out, fmt::join(m.files, ", "), m.tensors, m.bytes);
  return 0;
}

struct MergeLoraArgs {
  std::string path, base, out;
};

int cmd_merge_lora(const MergeLoraArgs& a) {
  const MergedLora m = merge_lora(a.path, a.base, a.out);
  fmt::print("adapters {} merged into {} ({} weights updated)\n", m.adapter_dir, m.base, m.merged);
  fmt::print("wrote {}: model.safetensors ({} tensors) and the base model's config.json\n", m.out, m.tensors);
  return 0;
}

}  // namespace

void add_checkpoint(CLI::App& app, Run& run) {
  auto* c = app.add_subcommand("checkpoint", "work with checkpoints (consolidate, merge-lora)");
  c->require_subcommand(1);
  auto a = std::make_shared<ConsolidateArgs>();
  auto* k = c->add_subcommand(
      "consolidate",
      "verify a checkpoint and write its model into a plain directory that torchvision / transformers load");
  k->add_option("path", a->path, "checkpoint directory, or run directory (its latest valid checkpoint)")
      ->type_name("RUN_OR_CHECKPOINT_DIR")
      ->required();
  k->add_option("--out", a->out,
                "directory to write (must not exist or be empty; default RUN_DIR/consolidated/step_XXXXXXXX)")
      ->type_name("DIR");
  set_footer(k,
      "The command verifies the checkpoint against its SHA256SUMS and writes model.safetensors in PyTorch's names\n"
      "and layouts: a copy of the checkpoint's own, or, for a ZeRO-3 run (each rank of the shard group saved its\n"
      "pieces in model-<i>-of-<N>.safetensors), every tensor put together from the shards. A GPT checkpoint's\n"
      "config.json, vocab.json and merges.txt are copied beside it, each copy checked against SHA256SUMS again.\n"
      "The optimizer state and state.json are not copied. eval, sample, inspect and model.init_from read a ZeRO-3\n"
      "checkpoint as it is; this is for torchvision, transformers and other readers of plain safetensors.",
      {"dtrain checkpoint consolidate runs/gpt_fortunes --out gpt_fortunes_hf",
       "dtrain checkpoint consolidate runs/resnet20_fmnist/checkpoints/step_00001000"});
  run_when_parsed(k, run, a, cmd_consolidate);

  auto m = std::make_shared<MergeLoraArgs>();
  auto* g = c->add_subcommand(
      "merge-lora", "merge a LoRA checkpoint's adapters into their base model: a Hugging Face model directory");
  g->add_option("path", m->path,
                "LoRA checkpoint directory, run directory (its latest valid checkpoint) or PEFT adapter directory")
      ->type_name("RUN_OR_CHECKPOINT_DIR")
      ->required();
  g->add_option("--out", m->out, "directory to write (must not exist or be empty)")->type_name("DIR")->required();
  g->add_option("--base", m->base,
                "the base model (default: adapter_config.json's base_model_name_or_path, the run's model.init_from)")
      ->type_name("MODEL_DIR");
  set_footer(g,
      "Each adapted weight becomes W + (lora_alpha / r) lora_B lora_A (transposed for GPT-2's Conv1D weights,\n"
      "fan_in_fan_out), computed in f32 with double sums; every other tensor of the base model is copied (as f32).\n"
      "OUT gets model.safetensors and the base model's config.json (and its tokenizer files when present), so\n"
      "AutoModelForCausalLM.from_pretrained(OUT) and `dtrain sample --checkpoint OUT` load the merged model.",
      {"dtrain checkpoint merge-lora runs/llama_lora --out llama_lora_merged",
       "dtrain checkpoint merge-lora runs/gpt2_lora/checkpoints/step_00000200 --base gpt2_hf --out gpt2_merged"});
  run_when_parsed(g, run, m, cmd_merge_lora);
}

}  // namespace dtrain::cli

// dtrain checkpoint consolidate: a checkpoint's model as a plain model directory
// (checkpoint/consolidate.h).
#include <fmt/ranges.h>

#include "cli/command.h"
#include "checkpoint/consolidate.h"

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

}  // namespace

void add_checkpoint(CLI::App& app, Run& run) {
  auto* c = app.add_subcommand("checkpoint", "work with checkpoints (consolidate)");
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
}

}  // namespace dtrain::cli

// dtrain checkpoint consolidate: a checkpoint's model as a plain model directory
// (train/consolidate.h).
#include <fmt/ranges.h>

#include "cli/command.h"
#include "train/consolidate.h"

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
      "verify a checkpoint and copy its model into a plain directory that torchvision / transformers load");
  k->add_option("path", a->path, "checkpoint directory, or run directory (its latest valid checkpoint)")
      ->type_name("RUN_OR_CHECKPOINT_DIR")
      ->required();
  k->add_option("--out", a->out,
                "directory to write (must not exist or be empty; default RUN_DIR/consolidated/step_XXXXXXXX)")
      ->type_name("DIR");
  k->footer(
      "Every checkpoint's model.safetensors already holds the whole model in PyTorch's names (ZeRO-3 gathers it\n"
      "when it saves; no per-rank model shards are written), so this command verifies the checkpoint against its\n"
      "SHA256SUMS and copies model.safetensors, plus a GPT checkpoint's config.json, vocab.json and merges.txt,\n"
      "each copy checked against SHA256SUMS again. The optimizer state and state.json are not copied.\n\n"
      "Examples:\n"
      "  dtrain checkpoint consolidate runs/gpt_fortunes --out gpt_fortunes_hf\n"
      "  dtrain checkpoint consolidate runs/resnet20_fmnist/checkpoints/step_00001000");
  k->callback([a, &run] { run = [a] { return cmd_consolidate(*a); }; });
}

}  // namespace dtrain::cli

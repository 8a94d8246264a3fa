// dtrain eval: evaluate a saved checkpoint on the recipe's evaluation split.
#include <filesystem>

#include "cli/commands.h"
#include "core/log.h"
#include "train/checkpoint.h"
#include "train/init_from.h"
#include "train/step.h"
#include "train/train_state.h"

namespace dtrain {

namespace stdfs = std::filesystem;

// A checkpoint directory, RUN_DIR/checkpoints/best (checkpoint.keep_best), or a run
// directory (its newest valid checkpoint).
std::string resolve_checkpoint_dir(const std::string& path_in) {
  std::string path = path_in;
  // RUN_DIR/checkpoints/best: the checkpoint best.json names (checkpoint.keep_best)
  const stdfs::path p(path);
  if (!stdfs::exists(path) && p.filename() == "best" && stdfs::exists(p.parent_path() / "best.json")) {
    path = CheckpointManager(p.parent_path().parent_path().string()).best_dir();
    if (path.empty()) user_error("{}: best.json does not name a checkpoint", (p.parent_path() / "best.json").string());
  }
  if (!stdfs::exists(path)) user_error("checkpoint {} does not exist", path);
  if (stdfs::exists(path + "/model.safetensors") || stdfs::exists(path + "/SHA256SUMS")) {
    std::string problem = CheckpointManager::verify(path);
    if (!problem.empty()) user_error("checkpoint {} failed verification: {}", path, problem);
    return path;
  }
  if (stdfs::is_directory(path + "/checkpoints")) {
    std::vector<std::string> notes;
    std::string ck = CheckpointManager(path).latest_valid(&notes);
    for (auto& n : notes) log::warn("{}", n);
    if (ck.empty()) user_error("{}: no valid checkpoint under {}/checkpoints", path, path);
    return ck;
  }
  user_error("{} is neither a checkpoint directory (model.safetensors, SHA256SUMS) nor a run directory", path);
}

int cmd_eval(const EvalArgs& a) {
  Config cfg = Config::load(a.config, a.overrides);
  if (!a.device.empty()) cfg.set("run.device", "\"" + a.device + "\"");
  if (a.checkpoint.empty()) user_error("dtrain eval: --checkpoint DIR is required");
  // weights alone (a safetensors file, a Hugging Face model directory) or a checkpoint
  const bool weights_only = !weights_only_file(a.checkpoint).empty();
  std::string ck = weights_only ? a.checkpoint : resolve_checkpoint_dir(a.checkpoint);
  SessionOptions so;
  so.with_train_data = false;
  so.with_optimizer = false;
  auto s = make_session(cfg, so);
  if (!s->task->has_eval()) user_error("{}: data.kind = \"{}\" has no evaluation split", cfg.source(), cfg.s("data.kind"));
  if (weights_only)
    init_model_from(*s, ck, /*strict=*/true);
  else
    load_model_weights(*s, ck);
  EvalStats ev = evaluate(*s);
  if (s->task->kind() == "lm")
    fmt::print("checkpoint {} | {} tokens | val loss {:.4f} | val perplexity {:.3f}\n", ck, ev.tokens, ev.loss,
               ev.perplexity);
  else if (s->task->kind() == "segment")
    fmt::print("checkpoint {} | {} samples | val loss {:.4f} | mIoU {:.4f} | mDice {:.4f}\n", ck, ev.samples, ev.loss,
               ev.mean_iou, ev.mean_dice);
  else
    fmt::print("checkpoint {} | {} samples | test loss {:.4f} | test accuracy {:.2f}%{}\n", ck, ev.samples, ev.loss,
               100 * ev.accuracy,
               ev.accuracy_top5 >= 0 ? fmt::format(" | top-5 {:.2f}%", 100 * ev.accuracy_top5) : std::string());
  return 0;
}

}  // namespace dtrain

// dtrain eval: evaluate a saved checkpoint (or weights alone) on the recipe's evaluation split.
#include <fmt/format.h>

#include "cli/command.h"
#include "core/error.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/init_from.h"
#include "session/step.h"
#include "checkpoint/train_state.h"

namespace dtrain::cli {

namespace {

struct EvalArgs : RecipeArgs {
  std::string checkpoint;  // checkpoint directory (or a run dir: its latest), or weights alone
};

int cmd_eval(const EvalArgs& a) {
  Config cfg = Config::load(a.config, a.overrides, a.device);
  if (a.checkpoint.empty()) user_error("dtrain eval: --checkpoint DIR is required");
  // weights alone (a safetensors file, a Hugging Face model directory) or a checkpoint
  const bool weights_only = !weights_only_file(a.checkpoint).empty();
  const std::string ck = weights_only ? a.checkpoint : resolve_checkpoint_dir(a.checkpoint);
  SessionOptions so;
  so.with_train_data = false;
  so.with_optimizer = false;
  auto s = make_session(cfg, so);
  if (!s->task->has_eval()) user_error("{}: data.kind = \"{}\" has no evaluation split", cfg.source(), cfg.data.kind);
  if (weights_only)
    init_model_from(*s, ck, /*strict=*/true);
  else
    load_model_weights(*s, ck);
  const EvalStats ev = evaluate(*s);
  if (!ev.samples) user_error("{}: the evaluation split holds no samples", cfg.source());
  fmt::print("checkpoint {} | {}\n", ck, s->task->report(ev).line);
  return 0;
}

}  // namespace

void add_eval(CLI::App& app, Run& run) {
  auto a = std::make_shared<EvalArgs>();
  auto* c = add_recipe_command(app, *a, "eval", "evaluate a checkpoint on the recipe's eval split", "recipe (TOML)",
                               true);
  c->add_option("--checkpoint", a->checkpoint,
                "checkpoint directory, a run directory (its latest), or weights alone: a safetensors file with "
                "PyTorch names or a Hugging Face model directory")
      ->type_name("DIR")
      ->required();
  add_recipe_options(c, a->overrides, a->device);
  set_examples(c, {"dtrain eval configs/resnet20_fmnist.toml --checkpoint runs/resnet20_fmnist",
                   "dtrain eval configs/resnet20_fmnist.toml --checkpoint runs/resnet20_fmnist/checkpoints/best",
                   "dtrain eval configs/gpt_fortunes.toml --checkpoint runs/gpt_fortunes/checkpoints/step_00000800",
                   "dtrain eval cfg.toml --checkpoint resnet18.safetensors     (weights with PyTorch names)"});
  run_when_parsed(c, run, a, cmd_eval);
}

}  // namespace dtrain::cli

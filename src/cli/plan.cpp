// dtrain plan: the memory a rank of a recipe will hold, predicted before it trains, for every
// parallel.zero stage (train/memory_plan.h); --measure runs one real step per layout to compare.
#include <algorithm>

#include "cli/command.h"
#include "backend/backend.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "train/memory_plan.h"
#include "train/memory_probe.h"

namespace dtrain::cli {

namespace {

struct PlanArgs {
  std::string config;
  std::vector<std::string> overrides;
  std::string device;
  int nproc = 0;
  bool measure = false;
  std::string json;
};

constexpr int kMaxMeasureRanks = 8;

int cmd_plan(const PlanArgs& a) {
  Config cfg = Config::load(a.config, a.overrides);
  if (!a.device.empty()) cfg.set("run.device", "\"" + a.device + "\"");
  if (a.nproc < 1) user_error("dtrain plan: --nproc {}: expected the number of ranks, at least 1", a.nproc);
  if (cfg.i("parallel.pipeline") > 1)
    user_error("dtrain plan: parallel.pipeline = {}: the plan knows data-parallel layouts only (set parallel.pipeline = 1)",
               cfg.i("parallel.pipeline"));
  if (cfg.i("parallel.tensor") > 1)
    user_error("dtrain plan: parallel.tensor = {}: the plan knows data-parallel layouts only (set parallel.tensor = 1)",
               cfg.i("parallel.tensor"));
  if (cfg.b("parallel.sequence"))
    user_error("dtrain plan: parallel.sequence = true: the plan knows data-parallel layouts only (it needs "
               "parallel.tensor > 1; set parallel.sequence = false)");
  const std::string& dev = cfg.s("run.device");
  const std::string device = dev == "auto" ? (cuda_device_count() > 0 ? "cuda" : "cpu") : dev;
  if (a.measure && a.nproc > kMaxMeasureRanks)
    user_error("dtrain plan: --measure runs the {} ranks as threads of this process on the CPU; at most {}",
               a.nproc, kMaxMeasureRanks);
  if (a.measure && device != "cpu")
    user_error("dtrain plan: --measure runs the ranks on the CPU over Gloo, but the plan is for {} "
               "(run.device = \"{}\"); add --device cpu",
               device, dev);
  const std::unique_ptr<Runtime> model = declare_model(cfg);
  std::vector<ActivationProfile> profiles;
  for (const std::string& rc : recompute_choices()) profiles.push_back(measure_activations(cfg, rc, 1));
  MemoryPlan plan = make_memory_plan(model->params, cfg, a.nproc, device, profiles);
  if (a.measure)
    for (PlanRow& row : plan.rows)
      row.measured = measure_ranks(cfg, std::max(row.zero, 0), a.nproc, row.recompute, 1).at(0).after_steps;
  fmt::print("{}", memory_plan_table(plan));
  if (!a.json.empty()) fs::write_file_atomic(a.json, memory_plan_json(plan).dump(2) + "\n");
  return 0;
}

}  // namespace

void add_plan(CLI::App& app, Run& run) {
  auto a = std::make_shared<PlanArgs>();
  auto* c = app.add_subcommand(
      "plan",
      "predict a rank's memory (parameters, gradients, optimizer state, ZeRO buffers, activations) for every "
      "parallel.zero stage, before training");
  c->add_option("config", a->config, "recipe (TOML)")->type_name("CONFIG")->required();
  c->add_option("--nproc", a->nproc, "data-parallel ranks (1: one process, no data parallelism)")
      ->type_name("N")
      ->required();
  c->add_flag("--measure", a->measure,
              "also run one real training step per layout on the CPU (the ranks as threads over Gloo, N <= 8) "
              "and print the measured peak beside the prediction");
  c->add_option("--json", a->json, "also write the plan (every quantity in bytes) as JSON to this file")
      ->type_name("FILE");
  add_recipe_options(c, a->overrides, a->device);
  c->footer(
      "One row per parallel.zero stage (one for --nproc 1) and train.recompute choice; rank 0's bytes.\n"
      "The model's state follows the code's allocation rules exactly: the flat parameter, gradient and 16-bit\n"
      "buffers, the optimizer state of rank 0's ZeRO-1/2 range, ZeRO-1/2's padded buffer, ZeRO-3's unit shards\n"
      "(ceil(numel / N) each) and windows, every allocation rounded as the device's allocator rounds it.\n"
      "Activations are measured: the arenas' high-water marks of one real forward + backward of the recipe at\n"
      "batch 1 on the CPU (and of one evaluation batch), scaled linearly to the recipe's per-rank batch; the\n"
      "arenas' blocks follow from them as core/buffer.h grows them. Not counted: CUDA workspaces outside the\n"
      "arenas, Gloo/NCCL buffers, host memory (docs/observability.md, \"Memory plan\").\n\n"
      "Examples:\n"
      "  dtrain plan configs/gpt_fortunes.toml --nproc 8\n"
      "  dtrain plan configs/bench/gpt2_124m.toml --nproc 64 --set train.batch_size=16 --json plan.json\n"
      "  dtrain plan configs/resnet20_fmnist.toml --nproc 4 --device cpu --measure");
  c->callback([a, &run] { run = [a] { return cmd_plan(*a); }; });
}

}  // namespace dtrain::cli

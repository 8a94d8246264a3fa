// dtrain plan: the memory a rank of a recipe will hold, predicted before it trains, for every
// parallel.zero stage (plan/memory_plan.h); --measure runs one real step per layout to compare.
// With --gpus N instead of --nproc: the 3D-parallel layouts of a GPT recipe on N GPUs, ranked by
// predicted step time (plan/layout_planner.h).
#include <algorithm>
#include <optional>

#include "cli/command.h"
#include "backend/backend.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "models/gpt.h"
#include "plan/layout_planner.h"
#include "session/session.h"
#include "session/task.h"
#include "plan/memory_plan.h"
#include "plan/memory_probe.h"

namespace dtrain::cli {

namespace {

struct PlanArgs : RecipeArgs {
  int nproc = 0;
  bool measure = false;
  std::string json;
  // --gpus mode (the layout planner)
  std::optional<int> gpus;
  std::string gpu;
  std::optional<int> gpus_per_node, max_mbs, top;
  std::optional<double> intra_gbps, inter_gbps;
  std::optional<int64_t> global_batch;
  bool show_excluded = false;
};

// The options each mode owns, named when given in the other mode.
std::string given(const std::vector<std::pair<const char*, bool>>& opts) {
  std::string out;
  for (const auto& [name, set] : opts)
    if (set) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

int cmd_plan_layouts(const PlanArgs& a, const Config& cfg) {
  namespace par = dtrain::parallel;
  if (cfg.model.kind != "gpt")
    user_error("dtrain plan --gpus: model.kind = \"{}\": the layout planner knows GPT recipes only", cfg.model.kind);
  const std::string& dtype = cfg.precision.dtype;
  if (dtype != "bf16" && dtype != "fp16")
    user_error("dtrain plan --gpus: precision.dtype = \"{}\": the layout planner models 16-bit mixed precision "
               "(add --set precision.dtype=\"bf16\")", dtype);
  const GptSpec spec = gpt_spec_from(cfg);
  const std::string name = cfg.run.name;
  const par::ModelShape m = par::model_shape(name, spec);
  par::Cluster c;
  c.gpu = par::gpu_spec(a.gpu.empty() ? "h100" : a.gpu);
  c.gpus = *a.gpus;
  if (a.gpus_per_node) c.gpus_per_node = *a.gpus_per_node;
  if (a.intra_gbps && !(*a.intra_gbps > 0))
    user_error("dtrain plan: --intra-gbps {}: expected a bandwidth above 0 (GB/s)", *a.intra_gbps);
  if (a.inter_gbps && !(*a.inter_gbps > 0))
    user_error("dtrain plan: --inter-gbps {}: expected a bandwidth above 0 (GB/s)", *a.inter_gbps);
  if (a.intra_gbps) c.gpu.intra_bytes_per_s = *a.intra_gbps * 1e9;
  if (a.inter_gbps) c.gpu.inter_bytes_per_s = *a.inter_gbps * 1e9;
  par::TrainShape t;
  t.global_batch = a.global_batch ? *a.global_batch
                                  : cfg.train.batch_size * cfg.train.grad_accum * int64_t(c.gpus);
  t.optimizer_states = cfg.optim.name == "sgd" ? (cfg.optim.momentum > 0 ? 1 : 0) : 2;
  if (a.max_mbs) t.max_mbs = *a.max_mbs;
  const int top = a.top.value_or(10);
  if (top < 1) user_error("dtrain plan: --top {}: expected at least 1", top);
  const par::Plan plan = par::plan_layouts(m, c, t);
  fmt::print("{}", par::plan_table(plan, top, a.show_excluded));
  if (!a.json.empty()) write_output_file("--json", a.json, par::plan_json(plan, top).dump(2) + "\n");
  return 0;
}

constexpr int kMaxMeasureRanks = 8;

int cmd_plan(const PlanArgs& a) {
  const bool gpus_mode = a.gpus.has_value();
  if (gpus_mode && (a.nproc != 0 || a.measure || !a.device.empty()))
    user_error("dtrain plan: --gpus (layout search) does not take {} (memory per rank); give one mode",
               given({{"--nproc", a.nproc != 0}, {"--measure", a.measure}, {"--device", !a.device.empty()}}));
  const std::string gpus_only =
      given({{"--gpu", !a.gpu.empty()}, {"--gpus-per-node", a.gpus_per_node.has_value()},
             {"--intra-gbps", a.intra_gbps.has_value()}, {"--inter-gbps", a.inter_gbps.has_value()},
             {"--global-batch", a.global_batch.has_value()}, {"--max-mbs", a.max_mbs.has_value()},
             {"--top", a.top.has_value()}, {"--show-excluded", a.show_excluded}});
  if (!gpus_mode && !gpus_only.empty())
    user_error("dtrain plan: {} belong to the layout search: add --gpus N", gpus_only);
  if (!gpus_mode && a.nproc == 0)
    user_error("dtrain plan: give --nproc N (memory per rank of this recipe) or --gpus N (layouts on N GPUs)");
  Config cfg = Config::load(a.config, a.overrides);
  if (gpus_mode) {
    if (*a.gpus < 1) user_error("dtrain plan: --gpus {}: expected the number of GPUs, at least 1", *a.gpus);
    return cmd_plan_layouts(a, cfg);
  }
  if (!a.device.empty()) cfg.assign(cfg.run.device, a.device);
  if (a.nproc < 1) user_error("dtrain plan: --nproc {}: expected the number of ranks, at least 1", a.nproc);
  refuse_model_parallel(cfg, "dtrain plan",
                        "the memory plan of --nproc knows data-parallel layouts only (--gpus N ranks "
                        "model-parallel ones)");
  const std::string& dev = cfg.run.device;
  const std::string device = dev == "auto" ? (cuda_device_count() > 0 ? "cuda" : "cpu") : dev;
  if (a.measure && a.nproc > kMaxMeasureRanks)
    user_error("dtrain plan: --measure runs the {} ranks as threads of this process on the CPU; at most {}",
               a.nproc, kMaxMeasureRanks);
  if (a.measure && device != "cpu")
    user_error("dtrain plan: --measure runs the ranks on the CPU over Gloo, but the plan is for {} "
               "(run.device = \"{}\"); add --device cpu",
               device, dev);
  // lora.enabled: the LoRA plan, then the same recipe as full fine-tuning beside it
  std::vector<Config> cfgs = {cfg};
  if (cfg.lora.enabled) {
    cfgs.push_back(cfg);
    cfgs.back().assign(cfgs.back().lora.enabled, false);
  }
  nlohmann::json plans = nlohmann::json::array();
  for (const Config& c : cfgs) {
    const std::unique_ptr<Runtime> model = declare_model(c);
    std::vector<ActivationProfile> profiles;
    for (const std::string& rc : recompute_choices(c)) profiles.push_back(measure_activations(c, rc, 1));
    MemoryPlan plan = make_memory_plan(model->params, c, a.nproc, device, profiles, model->base.get());
    if (cfgs.size() > 1) plan.title = c.lora.enabled ? "LoRA" : "full fine-tuning";
    if (a.measure)
      for (PlanRow& row : plan.rows)
        row.measured = measure_ranks(c, std::max(row.zero, 0), a.nproc, row.recompute, 1).at(0).after_steps;
    fmt::print("{}{}", plans.empty() ? "" : "\n", memory_plan_table(plan));
    plans.push_back(memory_plan_json(plan));
  }
  if (!a.json.empty())
    write_output_file("--json", a.json, (plans.size() == 1 ? plans[0] : nlohmann::json{{"plans", plans}}).dump(2) + "\n");
  return 0;
}

}  // namespace

void add_plan(CLI::App& app, Run& run) {
  auto a = std::make_shared<PlanArgs>();
  auto* c = add_recipe_command(
      app, *a, "plan",
      "predict a rank's memory (parameters, gradients, optimizer state, ZeRO buffers, activations) for every "
      "parallel.zero stage, before training; with --gpus N, rank a GPT's 3D-parallel layouts on N GPUs",
      "recipe (TOML)", true);
  c->add_option("--nproc", a->nproc, "data-parallel ranks (1: one process, no data parallelism)")
      ->type_name("N");
  c->add_flag("--measure", a->measure,
              "also run one real training step per layout on the CPU (the ranks as threads over Gloo, N <= 8) "
              "and print the measured peak beside the prediction");
  c->add_option("--json", a->json, "also write the plan (every quantity in bytes) as JSON to this file")
      ->type_name("FILE");
  c->add_option("--gpus", a->gpus,
                "layout search instead: every dp x tp x pp x v x ZeRO x recompute x micro-batch layout of the GPT "
                "recipe on N GPUs, ranked by predicted step time")
      ->type_name("N");
  c->add_option("--gpu", a->gpu, "with --gpus: h100 (default), h200, a100, a100-40gb, l40s")->type_name("KIND");
  c->add_option("--gpus-per-node", a->gpus_per_node, "with --gpus: GPUs in a node (default 8)")->type_name("G");
  c->add_option("--intra-gbps", a->intra_gbps,
                "with --gpus: per-GPU bus bandwidth inside a node in GB/s (gigabytes; default: the GPU's table value)")
      ->type_name("GB/S");
  c->add_option("--inter-gbps", a->inter_gbps,
                "with --gpus: per-GPU bus bandwidth between nodes in GB/s (gigabytes; default: the GPU's table value)")
      ->type_name("GB/S");
  c->add_option("--global-batch", a->global_batch,
                "with --gpus: sequences per optimizer step (default: train.batch_size x train.grad_accum x N)")
      ->type_name("B");
  c->add_option("--max-mbs", a->max_mbs, "with --gpus: largest micro-batch tried (1, 2, 4, ... up to it; default 16)")
      ->type_name("B");
  c->add_option("--top", a->top, "with --gpus: rows of the ranking to print (default 10)")->type_name("K");
  c->add_flag("--show-excluded", a->show_excluded,
              "with --gpus: list every excluded layout with the first constraint it fails");
  add_recipe_options(c, a->overrides, a->device);
  set_footer(c,
      "One row per parallel.zero stage (one for --nproc 1) and train.recompute choice; rank 0's bytes.\n"
      "The model's state follows the code's allocation rules exactly: the flat parameter, gradient and 16-bit\n"
      "buffers, the optimizer state of rank 0's ZeRO-1/2 range, ZeRO-1/2's padded buffer, ZeRO-3's unit shards\n"
      "(ceil(numel / N) each) and windows, every allocation rounded as the device's allocator rounds it.\n"
      "Activations are measured: the arenas' high-water marks of one real forward + backward of the recipe at\n"
      "batch 1 on the CPU (and of one evaluation batch), scaled linearly to the recipe's per-rank batch; the\n"
      "arenas' blocks follow from them as core/buffer.h grows them. Not counted: CUDA workspaces outside the\n"
      "arenas, Gloo/NCCL buffers, host memory (docs/observability.md, \"Memory plan\").\n\n"
      "--gpus N: a model, not a measurement (docs/scaling.md, \"Layout planner\"): memory per GPU (ZeRO state,\n"
      "Korthikanti et al. activations, 1F1B in-flight micro-batches) and step time (GEMM efficiency by width,\n"
      "alpha-beta collectives, pipeline bubble, overlap of data-parallel traffic) of every layout; each\n"
      "excluded layout names the first constraint it fails, summarised by count.",
      {"dtrain plan configs/gpt_fortunes.toml --nproc 8",
       "dtrain plan configs/bench/gpt2_124m.toml --nproc 64 --set train.batch_size=16 --json plan.json",
       "dtrain plan configs/resnet20_fmnist.toml --nproc 4 --device cpu --measure",
       "dtrain plan configs/plan/gpt3_175b.toml --gpus 1024 --gpu a100 --global-batch 1536",
       "dtrain plan configs/plan/gpt2_1558m.toml --gpus 8 --global-batch 1024 --top 5 --json layouts.json"});
  run_when_parsed(c, run, a, cmd_plan);
}

}  // namespace dtrain::cli

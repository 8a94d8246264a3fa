// dtrain bench: steady-state training throughput of a recipe (warm-up, then N timed steps:
// throughput, the step-time breakdown, MFU and the cost of observability: timed steps
// alternate between "off" (train_step alone) and "on" (train_step + what the trainer does
// for metrics every step at most: registry record, publish, Prometheus render); interleaving
// keeps the two medians comparable on a noisy machine); --collectives: an nccl-tests-style
// sweep of the collectives; --predict-scaling: the data-parallel efficiency model.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/command.h"
#include "comm/collective_bench.h"
#include "comm/communicator.h"
#include "comm/env.h"
#include "comm/launcher.h"
#include "comm/rendezvous.h"
#include "comm/store.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "obs/metrics.h"
#include "obs/nvml.h"
#include "obs/peak_flops.h"
#include "obs/prometheus.h"
#include "plan/scaling.h"
#include "session/flops.h"
#include "session/step.h"

namespace dtrain::cli {

namespace {

struct BenchArgs : RecipeArgs {
  int warmup = 5, steps = 20;
  std::string json;  // also write the results as one JSON object to this file
  bool collectives = false, predict_scaling = false;
  comm::CollectiveBenchArgs coll;
  std::string ops_csv;  // --ops
  // --predict-scaling
  std::vector<std::string> entries;  // "name:step_s:grad_bytes[...]"; empty = ResNet-50 H100 measured
  std::string measured_csv;          // optional collective-bench output (table or --csv) to fit a link
  std::vector<int> gpus = {8, 64, 512};
};

int cmd_bench(const BenchArgs& a) {
  Config cfg = Config::load(a.config, a.overrides, a.device);
  if (a.steps < 1 || a.warmup < 0) user_error("dtrain bench: --steps must be >= 1 and --warmup >= 0");
  refuse_model_parallel(cfg, "dtrain bench",
                        "bench runs one process; model-parallel layouts need ranks (dtrain train --nproc-per-node)");
  SessionOptions so;
  so.with_eval_data = false;
  auto s = make_session(cfg, so);
  const double lr = cfg.optim.lr;
  for (int i = 0; i < a.warmup; ++i) train_step(*s, i, lr);
  std::vector<double> step_s, off_s, on_s, obs_s;
  StepTimes sum;
  int64_t samples = 0;
  MetricRegistry reg(cfg.run.name, 0);
  size_t rendered = 0;
  s->be->profiler_range(true);  // the timed steps are the profiler's range (scripts/prof/ktrace.cpp)
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.steps; ++i) {
    auto ts = std::chrono::steady_clock::now();
    StepStats st = train_step(*s, a.warmup + i, lr);
    if (i % 2 == 1) {  // observability on
      auto to = std::chrono::steady_clock::now();
      reg.record_step({st.t.total_s, st.t.data_s, st.t.forward_s, st.t.backward_s, st.sync_s, st.t.optimizer_s,
                       st.samples, 0});
      reg.set_loss(st.loss);
      reg.set_lr(lr);
      reg.publish();
      rendered += render_prometheus(*reg.snapshot()).size();
      obs_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - to).count());
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - ts).count();
    (i % 2 == 1 ? on_s : off_s).push_back(dt);
    step_s.push_back(st.t.total_s);
    sum.data_s += st.t.data_s;
    sum.forward_s += st.t.forward_s;
    sum.backward_s += st.t.backward_s;
    sum.optimizer_s += st.t.optimizer_s;
    samples += st.samples;
  }
  double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s->be->profiler_range(false);
  std::sort(step_s.begin(), step_s.end());
  double median = step_s[step_s.size() / 2];
  const double rate = double(samples) / wall;
  // MFU: as in `dtrain train` (unknown device and no observability.peak_tflops: not shown)
  Nvml nvml;
  std::string dev_name;
  const double peak = session_peak_flops(*s, nvml, 0, &dev_name);
  const double fpu = train_flops_per_unit(*s);
  const double mfu = mfu_ratio(fpu > 0 ? fpu * rate : kUnknown, peak);
  auto pct = [&](double x) { return wall > 0 ? 100.0 * x / wall : 0.0; };
  fmt::print("bench {} | device {} | {} params | batch {} x accum {} | {} warm-up + {} timed steps\n", cfg.source(),
             s->be->name(), s->params.num_params(), cfg.train.batch_size, cfg.train.grad_accum, a.warmup,
             a.steps);
  fmt::print("throughput: {:.1f} {}/s (median step {:.4f} s){}\n", rate,
             s->task->unit() == "tok" ? "tokens" : "images", median,
             std::isfinite(mfu) ? fmt::format(" | mfu {:.2f}% of {:.1f} TFLOP/s", 100 * mfu, peak / 1e12) : "");
  if (fpu > 0) fmt::print("model FLOPs: {:.4g} per {} (training)\n", fpu, s->task->unit() == "tok" ? "token" : "image");
  if (!off_s.empty() && !on_s.empty()) {
    // The on/off medians carry the machine's noise; the observability work itself is
    // timed directly too (its median against the "off" median step).
    const double off = quantile(off_s, 0.5), on = quantile(on_s, 0.5), obs = quantile(obs_s, 0.5);
    fmt::print("observability: median step {:.4f} s off, {:.4f} s on ({:+.2f}%); the work itself (record + publish + "
               "Prometheus render of {} B) {:.1f} us per step = {:.4f}% of a step\n",
               off, on, 100 * (on / off - 1), rendered / on_s.size(), 1e6 * obs, 100 * obs / off);
  }
  fmt::print("breakdown: data {:.1f}% | forward {:.1f}% | backward {:.1f}% | optimizer {:.1f}%\n", pct(sum.data_s),
             pct(sum.forward_s), pct(sum.backward_s), pct(sum.optimizer_s));
  if (s->graphs)  // train.cuda_graph: how often the micro-batches ran as a replayed graph
    fmt::print("cuda graph: {} captures, {} replays in {} micro-batches\n", s->graphs->captures(),
               s->graphs->replays(), (a.warmup + a.steps) * cfg.train.grad_accum);
  if (!a.json.empty()) {
    const std::string unit = s->task->unit() == "tok" ? "tokens" : "images";
    auto opt = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
    nlohmann::json j = {
        {"recipe", cfg.source()},
        {"version", DTRAIN_VERSION},
        {"device", s->be->name()},
        {"gpu", dev_name.empty() ? nlohmann::json(nullptr) : nlohmann::json(dev_name)},
        {"precision", cfg.precision.dtype},
        {"params", s->params.num_params()},
        {"batch_size", cfg.train.batch_size},
        {"grad_accum", cfg.train.grad_accum},
        {"warmup_steps", a.warmup},
        {"timed_steps", a.steps},
        {"unit", unit},
        {unit + "_per_s", rate},
        {"median_step_s", median},
        {"flops_per_" + std::string(unit == "tokens" ? "token" : "image"), fpu > 0 ? nlohmann::json(fpu) : nlohmann::json(nullptr)},
        {"mfu", opt(mfu)},
        {"peak_flops", peak > 0 ? nlohmann::json(peak) : nlohmann::json(nullptr)},
        {"share", {{"data", pct(sum.data_s) / 100}, {"forward", pct(sum.forward_s) / 100},
                   {"backward", pct(sum.backward_s) / 100}, {"optimizer", pct(sum.optimizer_s) / 100}}},  // of the wall time
        {"overrides", a.overrides}};
    if (s->graphs) j["cuda_graph"] = {{"captures", s->graphs->captures()}, {"replays", s->graphs->replays()}};
    write_output_file("--json", a.json, j.dump(2) + "\n");
  }
  return 0;
}


// Launches nproc_per_node workers when > 1 and not already a worker; otherwise joins (or
// forms, in a one-process world) the job, runs the sweep and rank 0 prints the table to
// stdout. Returns 0 on success, 1 when any row has #wrong > 0 (or a worker failed).
int cmd_bench_collectives(const comm::CollectiveBenchArgs& a) {
  comm::validate_collective_args(a);  // before launching
  comm::DistEnv env = comm::dist_env();
  if (a.nproc_per_node > 1 && env.source == "none") {
    comm::LaunchOptions o;
    o.nproc_per_node = a.nproc_per_node;
    o.master_addr = a.master_addr;
    o.master_port = a.master_port;
    o.extra_env["OMP_NUM_THREADS"] = "1";
    const std::vector<std::string> argv =
        comm::worker_argv(comm::current_argv(), comm::self_exe(), {"--nproc-per-node", "--master-addr", "--master-port"});
    log::info("launching {} collective-benchmark worker(s)", a.nproc_per_node);
    return comm::launch(o, argv);
  }
  if (a.nproc_per_node > 1)
    log::warn("already a worker of a {} launch (RANK {} of {}): ignoring --nproc-per-node", env.source, env.rank,
              env.world_size);
  return comm::collective_bench_job(a);
}


int cmd_predict_scaling(const BenchArgs& a) {
  std::vector<parallel::ScalingInputs> inputs;
  for (const auto& e : a.entries) inputs.push_back(parallel::parse_scaling_entry(e));
  if (inputs.empty()) inputs.push_back(parallel::resnet50_h100_measured());
  for (int g : a.gpus)
    if (g < 1) user_error("--gpus {}: expected positive GPU counts", g);
  std::vector<parallel::LinkModel> links = {parallel::nvlink_h100(), parallel::ib_400g()};
  if (!a.measured_csv.empty()) {
    std::ifstream f(a.measured_csv);
    if (!f) user_error("--measured {}: cannot open the file", a.measured_csv);
    std::stringstream ss;
    ss << f.rdbuf();
    int n = 0;
    auto rows = comm::parse_collective_output(ss.str(), a.measured_csv, &n);
    links.push_back(parallel::fit_link_from_rows(rows, n, "measured", a.measured_csv));
  }
  fmt::print("{}", parallel::predict_scaling_table(inputs, links, a.gpus));
  return 0;
}

}  // namespace

void add_bench(CLI::App& app, Run& run) {
  auto a = std::make_shared<BenchArgs>();
  auto* c = add_recipe_command(app, *a, "bench", "measure steady-state training throughput and MFU",
                               "recipe (TOML); not with --collectives / --predict-scaling", false);
  comm::CollectiveBenchArgs& cb = a->coll;
  c->add_flag("--collectives", a->collectives, "all-reduce / reduce-scatter / all-gather bandwidth, as nccl-tests reports it");
  c->add_flag("--predict-scaling", a->predict_scaling, "predicted data-parallel efficiency at 8, 64 and 512 GPUs");
  c->add_option("--nproc-per-node", cb.nproc_per_node, "--collectives: worker processes")->check(CLI::Range(1, 1024));
  c->add_option("--min-bytes", cb.min_bytes, "--collectives: smallest message")->check(CLI::Range(int64_t(4), int64_t(1) << 40));
  c->add_option("--max-bytes", cb.max_bytes, "--collectives: largest message")->check(CLI::Range(int64_t(4), int64_t(1) << 40));
  c->add_option("--step-factor", cb.step_factor, "--collectives: size multiplier")->check(CLI::Range(2, 1024));
  c->add_option("--iters", cb.iters, "--collectives: timed calls per size")->check(CLI::Range(1, 100000));
  c->add_option("--ops", a->ops_csv, "--collectives: comma-separated subset of allreduce,reduce_scatter,allgather");
  c->add_option("--master-addr", cb.master_addr, "--collectives: rendezvous host");
  c->add_option("--master-port", cb.master_port, "--collectives: rendezvous port")->check(CLI::Range(1, 65535));
  c->add_option("--csv", cb.csv, "--collectives: also write the rows as CSV to this file");
  c->add_option("--entry", a->entries, "--predict-scaling: NAME:STEP_S:GRAD_BYTES[:BWD_SHARE[:OVERLAP]] (repeatable)");
  c->add_option("--measured", a->measured_csv, "--predict-scaling: collective-bench output to fit a measured link");
  auto* warmup = c->add_option("--warmup", a->warmup, "untimed steps first")->capture_default_str()->check(CLI::Range(0, 1000000));
  c->add_option("--steps", a->steps, "timed steps")->capture_default_str()->check(CLI::Range(1, 1000000));
  c->add_option("--json", a->json, "also write the results (throughput, step breakdown, MFU, FLOPs) as JSON to this file")
      ->type_name("FILE");
  add_recipe_options(c, a->overrides, a->device);
  set_examples(c, {"dtrain bench configs/bench/resnet20_fmnist_cpu.toml --json out.json",
                   "dtrain bench configs/bench/gpt2_124m.toml --device cuda --steps 50",
                   "dtrain bench --collectives --nproc-per-node 2 --max-bytes 16777216",
                   "dtrain bench --predict-scaling --entry gpt2:0.35:497664000 --measured coll.csv"});
  c->callback([a, warmup, &run] {
    run = [a, warmup] {
      if (a->collectives) {
        comm::CollectiveBenchArgs cb = a->coll;
        cb.device = a->device.empty() ? "cpu" : a->device;
        if (warmup->count()) cb.warmup = a->warmup;
        if (!a->ops_csv.empty()) {
          cb.ops.clear();
          size_t start = 0;
          while (start <= a->ops_csv.size()) {
            size_t comma = a->ops_csv.find(',', start);
            if (comma == std::string::npos) comma = a->ops_csv.size();
            if (comma > start) cb.ops.push_back(a->ops_csv.substr(start, comma - start));
            start = comma + 1;
          }
        }
        return cmd_bench_collectives(cb);
      }
      if (a->predict_scaling) return cmd_predict_scaling(*a);
      if (a->config.empty()) user_error("dtrain bench: give a recipe, or --collectives / --predict-scaling");
      return cmd_bench(*a);
    };
  });
}

}  // namespace dtrain::cli

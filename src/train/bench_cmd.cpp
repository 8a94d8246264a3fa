// dtrain bench: warm-up, then N timed training steps; steady-state throughput and the
// step-time breakdown, MFU, and the cost of observability: timed steps alternate between
// "off" (train_step alone) and "on" (train_step + what the trainer does for metrics every
// step at most: registry record, publish, Prometheus render); interleaving keeps the two
// medians comparable on a noisy machine.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>

#include "obs/metrics.h"
#include "obs/nvml.h"
#include "obs/peak_flops.h"
#include "obs/prometheus.h"
#include "train/flops.h"

#include "cli/commands.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "train/step.h"

namespace dtrain {

int cmd_bench(const BenchArgs& a) {
  Config cfg = Config::load(a.config, a.overrides);
  if (!a.device.empty()) cfg.set("run.device", "\"" + a.device + "\"");
  if (a.steps < 1 || a.warmup < 0) user_error("dtrain bench: --steps must be >= 1 and --warmup >= 0");
  SessionOptions so;
  so.with_eval_data = false;
  auto s = make_session(cfg, so);
  const double lr = cfg.f("optim.lr");
  for (int i = 0; i < a.warmup; ++i) train_step(*s, i, lr);
  std::vector<double> step_s, off_s, on_s, obs_s;
  StepTimes sum;
  int64_t samples = 0;
  MetricRegistry reg(cfg.s("run.name"), 0);
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
  double peak = 0;
  const double override_tf = cfg.f("observability.peak_tflops");
  std::string dev_name;
  if (s->be->device().is_cuda()) {
    Nvml nvml;
    if (nvml.available())
      for (auto& g : nvml.sample())
        if (dev_name.empty()) dev_name = g.name;
  }
  if (s->be->device().is_cuda() || override_tf > 0)
    peak = resolve_peak_flops(dev_name, peak_precision(cfg.s("precision.dtype"), cfg.b("precision.tf32")), override_tf);
  const double fpu = train_flops_per_unit(*s);
  const double mfu = mfu_ratio(fpu > 0 ? fpu * rate : kUnknown, peak);
  auto pct = [&](double x) { return wall > 0 ? 100.0 * x / wall : 0.0; };
  fmt::print("bench {} | device {} | {} params | batch {} x accum {} | {} warm-up + {} timed steps\n", cfg.source(),
             s->be->name(), s->params.num_params(), cfg.i("train.batch_size"), cfg.i("train.grad_accum"), a.warmup,
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
               s->graphs->replays(), (a.warmup + a.steps) * cfg.i("train.grad_accum"));
  if (!a.json.empty()) {
    const std::string unit = s->task->unit() == "tok" ? "tokens" : "images";
    auto opt = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
    nlohmann::json j = {
        {"recipe", cfg.source()},
        {"version", DTRAIN_VERSION},
        {"device", s->be->name()},
        {"gpu", dev_name.empty() ? nlohmann::json(nullptr) : nlohmann::json(dev_name)},
        {"precision", cfg.s("precision.dtype")},
        {"params", s->params.num_params()},
        {"batch_size", cfg.i("train.batch_size")},
        {"grad_accum", cfg.i("train.grad_accum")},
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
    fs::write_file_atomic(a.json, j.dump(2) + "\n");
  }
  return 0;
}

}  // namespace dtrain

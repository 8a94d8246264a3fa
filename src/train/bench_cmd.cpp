// dtrain bench: warm-up, then N timed training steps; steady-state throughput and the
// step-time breakdown.
#include <algorithm>
#include <chrono>

#include "cli/commands.h"
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
  std::vector<double> step_s;
  StepTimes sum;
  int64_t samples = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.steps; ++i) {
    StepStats st = train_step(*s, a.warmup + i, lr);
    step_s.push_back(st.t.total_s);
    sum.data_s += st.t.data_s;
    sum.forward_s += st.t.forward_s;
    sum.backward_s += st.t.backward_s;
    sum.optimizer_s += st.t.optimizer_s;
    samples += st.samples;
  }
  double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::sort(step_s.begin(), step_s.end());
  double median = step_s[step_s.size() / 2];
  auto pct = [&](double x) { return wall > 0 ? 100.0 * x / wall : 0.0; };
  fmt::print("bench {} | device {} | {} params | batch {} x accum {} | {} warm-up + {} timed steps\n", cfg.source(),
             s->be->name(), s->params.num_params(), cfg.i("train.batch_size"), cfg.i("train.grad_accum"), a.warmup,
             a.steps);
  fmt::print("throughput: {:.1f} {}/s (median step {:.4f} s)\n", double(samples) / wall,
             s->task->unit() == "tok" ? "tokens" : "images", median);
  fmt::print("breakdown: data {:.1f}% | forward {:.1f}% | backward {:.1f}% | optimizer {:.1f}%\n", pct(sum.data_s),
             pct(sum.forward_s), pct(sum.backward_s), pct(sum.optimizer_s));
  return 0;
}

}  // namespace dtrain

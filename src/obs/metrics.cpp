#include "obs/metrics.h"

#include <algorithm>
#include <chrono>

namespace dtrain {

double quantile_sorted(const std::vector<double>& v, double q) {
  if (v.empty()) return kUnknown;
  if (q <= 0) return v.front();
  if (q >= 1) return v.back();
  double pos = q * double(v.size() - 1);
  size_t lo = size_t(pos);
  double frac = pos - double(lo);
  if (lo + 1 >= v.size()) return v.back();
  return v[lo] + (v[lo + 1] - v[lo]) * frac;
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return quantile_sorted(v, q);
}

StepWindow::StepWindow(size_t capacity) : buf_(std::max<size_t>(capacity, 1)) {}

void StepWindow::add(const StepSample& s) {
  buf_[next_] = s;
  next_ = (next_ + 1) % buf_.size();
  n_ = std::min(n_ + 1, buf_.size());
}

std::vector<StepSample> StepWindow::samples() const {
  std::vector<StepSample> out;
  out.reserve(n_);
  size_t start = (next_ + buf_.size() - n_) % buf_.size();
  for (size_t i = 0; i < n_; i++) out.push_back(buf_[(start + i) % buf_.size()]);
  return out;
}

std::vector<double> StepWindow::totals_sorted() const {
  std::vector<double> t;
  t.reserve(n_);
  for (const auto& s : samples()) t.push_back(s.total_s);
  std::sort(t.begin(), t.end());
  return t;
}

MetricRegistry::MetricRegistry(std::string run, int rank, size_t window) : window_(window) {
  state_.run = std::move(run);
  state_.rank = rank;
  auto empty = std::make_shared<Snapshot>(state_);
  snap_ = std::move(empty);
}

void MetricRegistry::record_step(const StepSample& s) {
  update([&](Snapshot& st) {
    window_.add(s);
    st.step++;
    st.step_count++;
    st.step_seconds_sum += s.total_s;
    st.samples_total += s.samples;
    st.tokens_total += s.tokens;
  });
}

void MetricRegistry::set_step(int64_t step) { update([&](Snapshot& st) { st.step = step; }); }
void MetricRegistry::set_loss(double v) { update([&](Snapshot& st) { st.loss = v; }); }
void MetricRegistry::set_lr(double v) { update([&](Snapshot& st) { st.lr = v; }); }
void MetricRegistry::set_eval(int64_t step, double loss, const std::string& metric, double value) {
  update([&](Snapshot& st) {
    st.eval_step = step;
    st.eval_loss = loss;
    st.eval_metric = metric;
    st.eval_value = value;
  });
}
void MetricRegistry::set_eval_best(double value) {
  update([&](Snapshot& st) { st.eval_best = value; });
}
void MetricRegistry::set_loss_scale(double scale, int64_t skipped_steps) {
  update([&](Snapshot& st) {
    st.loss_scale = scale;
    st.skipped_steps_total = skipped_steps;
  });
}
void MetricRegistry::set_mfu(double ratio) { update([&](Snapshot& st) { st.mfu_ratio = ratio; }); }
void MetricRegistry::set_arena_high_water(double bytes) {
  update([&](Snapshot& st) { st.arena_high_water_bytes = bytes; });
}
void MetricRegistry::add_moe(const std::vector<int64_t>& expert_tokens, int64_t dropped, double aux_loss) {
  update([&](Snapshot& st) {
    st.moe_expert_tokens_total.resize(std::max(st.moe_expert_tokens_total.size(), expert_tokens.size()), 0);
    for (size_t e = 0; e < expert_tokens.size(); ++e) st.moe_expert_tokens_total[e] += expert_tokens[e];
    st.moe_dropped_tokens_total = std::max<int64_t>(st.moe_dropped_tokens_total, 0) + dropped;
    st.moe_aux_loss = aux_loss;
  });
}
void MetricRegistry::set_gpus(std::vector<GpuStat> gpus) {
  update([&](Snapshot& st) { st.gpus = std::move(gpus); });
}
void MetricRegistry::add_checkpoint(double seconds) {
  update([&](Snapshot& st) {
    st.checkpoints_total++;
    st.last_checkpoint_s = seconds;
  });
}
void MetricRegistry::add_checkpoint_failure() {
  update([](Snapshot& st) { st.checkpoint_failures_total++; });
}
void MetricRegistry::add_resume() { update([](Snapshot& st) { st.resumes_total++; }); }
void MetricRegistry::add_preemption() { update([](Snapshot& st) { st.preemptions_total++; }); }
void MetricRegistry::add_restarts(int64_t n) { update([&](Snapshot& st) { st.restarts_total += n; }); }
void MetricRegistry::add_stragglers(int64_t n) {
  update([&](Snapshot& st) { st.stragglers_total += n; });
}

void MetricRegistry::publish() {
  auto snap = std::make_shared<Snapshot>();
  {
    std::lock_guard<std::mutex> lk(state_mu_);
    *snap = state_;
    std::vector<StepSample> w = window_.samples();
    snap->window_steps = w.size();
    if (!w.empty()) {
      std::vector<double> t;
      t.reserve(w.size());
      double d = 0, f = 0, b = 0, s = 0, o = 0;
      for (const auto& x : w) {
        t.push_back(x.total_s);
        d += x.data_s;
        f += x.forward_s;
        b += x.backward_s;
        s += x.sync_s;
        o += x.optimizer_s;
      }
      std::sort(t.begin(), t.end());
      double n = double(w.size());
      snap->step_p50_s = quantile_sorted(t, 0.5);
      snap->step_p95_s = quantile_sorted(t, 0.95);
      snap->step_p99_s = quantile_sorted(t, 0.99);
      snap->data_s = d / n;
      snap->forward_s = f / n;
      snap->backward_s = b / n;
      snap->sync_s = s / n;
      snap->optimizer_s = o / n;
    }
  }
  snap->time_unix =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::shared_ptr<const Snapshot> c = std::move(snap);
  std::lock_guard<std::mutex> lk(snap_mu_);
  snap_.swap(c);
  // `c` now holds the previous snapshot; it is freed after the lock is released (locals
  // are destroyed in reverse order), or later by a reader still holding it.
}

std::shared_ptr<const Snapshot> MetricRegistry::snapshot() const {
  std::lock_guard<std::mutex> lk(snap_mu_);
  return snap_;
}

}  // namespace dtrain

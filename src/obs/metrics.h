#pragma once
// The metric registry: the trainer records steps, counters and gauges into it on the
// training thread and publishes an immutable Snapshot once per log step. Readers (the
// Prometheus /metrics endpoint, reports) take the latest snapshot without ever blocking
// the training loop: publish() builds the copy first and only swaps a shared_ptr under
// a mutex; snapshot() copies that shared_ptr under the same mutex.
//
// Counters count since this process started (a restarted or resumed process starts them
// at 0 again; Prometheus' rate()/increase() handle counter resets).
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dtrain {

// Seconds of one training step, split into phases (the trainer's StepTimes plus sync_s,
// the part of the gradient all-reduce NOT hidden behind backward). Phases need not sum
// to total_s exactly; the rest is "other" (launch overhead, clipping, logging).
struct StepSample {
  double total_s = 0, data_s = 0, forward_s = 0, backward_s = 0, sync_s = 0, optimizer_s = 0;
  int64_t samples = 0, tokens = 0;
};

// One GPU as NVML (or the CUDA backend) sees it. Negative = not known.
struct GpuStat {
  int index = 0;
  std::string name;
  double utilization_ratio = -1;  // 0..1, NVML's "GPU busy" over its last sample period
  double memory_used_bytes = -1;
  double memory_total_bytes = -1;
};

// Exact quantile of `v` (sorted in place) with linear interpolation between closest
// ranks (NumPy's default, "type 7"): q = 0 is the minimum, q = 1 the maximum.
// NaN for an empty vector.
double quantile_sorted(const std::vector<double>& sorted, double q);
double quantile(std::vector<double> v, double q);

// The last `capacity` step samples (a ring).
class StepWindow {
 public:
  explicit StepWindow(size_t capacity = 100);
  void add(const StepSample& s);
  size_t size() const { return n_; }
  size_t capacity() const { return buf_.size(); }
  std::vector<StepSample> samples() const;  // oldest first
  std::vector<double> totals_sorted() const;

 private:
  std::vector<StepSample> buf_;
  size_t next_ = 0, n_ = 0;
};

inline constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();

struct Snapshot {
  std::string run;  // label run="..."
  int rank = 0;     // label rank="..."
  double time_unix = 0;  // when it was published
  int64_t step = 0;      // optimizer steps completed (global step, resumed runs included)

  // Step time over the window (the last window_steps steps); NaN when empty.
  size_t window_steps = 0;
  double step_p50_s = kUnknown, step_p95_s = kUnknown, step_p99_s = kUnknown;
  // Means over the window, per phase.
  double data_s = kUnknown, forward_s = kUnknown, backward_s = kUnknown, sync_s = kUnknown,
         optimizer_s = kUnknown;
  // Whole process: the summary's _sum and _count.
  double step_seconds_sum = 0;
  int64_t step_count = 0;

  int64_t samples_total = 0, tokens_total = 0;
  int64_t checkpoints_total = 0, checkpoint_failures_total = 0;
  int64_t resumes_total = 0, preemptions_total = 0, restarts_total = 0, stragglers_total = 0;

  // Gauges; NaN / negative = not known yet (left out of the exposition).
  double loss = kUnknown, lr = kUnknown, mfu_ratio = kUnknown;
  // fp16 dynamic loss scaling (NaN / -1 without it: left out of the exposition)
  double loss_scale = kUnknown;
  int64_t skipped_steps_total = -1;
  double last_checkpoint_s = kUnknown;
  // the most recent evaluation (rank 0): its step, loss and task metric (accuracy, mIoU or
  // perplexity, named by eval_metric); the best value when checkpoint.keep_best ranks them
  int64_t eval_step = -1;
  double eval_loss = kUnknown, eval_value = kUnknown, eval_best = kUnknown;
  std::string eval_metric;
  double arena_high_water_bytes = -1;
  std::vector<GpuStat> gpus;
  // a mixture-of-experts model (empty / NaN / -1 otherwise): the slots routed to each expert since
  // the process started (rank 0's), the load-balancing loss of the most recent logged step and the
  // slots dropped by the capacity factor since the process started
  std::vector<int64_t> moe_expert_tokens_total;
  double moe_aux_loss = kUnknown;
  int64_t moe_dropped_tokens_total = -1;
};

class MetricRegistry {
 public:
  explicit MetricRegistry(std::string run = "", int rank = 0, size_t window = 100);

  // ---- writers (the training thread; each call takes an uncontended mutex) ----
  void record_step(const StepSample& s);  // step += 1, samples/tokens totals, the window
  void set_step(int64_t step);            // e.g. after a resume
  void set_loss(double v);
  void set_lr(double v);
  void set_mfu(double ratio);  // NaN = unknown (peak FLOP/s of the device not known)
  void set_loss_scale(double scale, int64_t skipped_steps);  // fp16 only
  // metric: "accuracy" | "miou" | "perplexity" (a label value of dtrain_eval_metric)
  void set_eval(int64_t step, double loss, const std::string& metric, double value);
  void set_eval_best(double value);
  void set_arena_high_water(double bytes);
  void set_gpus(std::vector<GpuStat> gpus);
  // a mixture of experts' logged step: its slots per expert and dropped slots (added to the
  // totals) and its load-balancing loss
  void add_moe(const std::vector<int64_t>& expert_tokens, int64_t dropped, double aux_loss);
  void add_checkpoint(double seconds);  // a checkpoint was written in `seconds`
  void add_checkpoint_failure();        // a write failed, or a checkpoint was found invalid
  void add_resume();
  void add_preemption();
  void add_restarts(int64_t n = 1);
  void add_stragglers(int64_t n = 1);

  // Builds a Snapshot of the current state and makes it the one readers see.
  void publish();

  // ---- readers (any thread; never waits on the trainer beyond a pointer copy) ----
  // Never null: an empty snapshot (step 0) before the first publish().
  std::shared_ptr<const Snapshot> snapshot() const;

 private:
  // Runs f(state_) under state_mu_ (every writer).
  template <typename F>
  void update(const F& f) {
    std::lock_guard<std::mutex> lk(state_mu_);
    f(state_);
  }
  mutable std::mutex state_mu_;  // guards the fields below (writers + publish)
  Snapshot state_;               // counters and gauges; quantile fields filled in publish()
  StepWindow window_;
  mutable std::mutex snap_mu_;  // guards snap_ only
  std::shared_ptr<const Snapshot> snap_;
};

}  // namespace dtrain

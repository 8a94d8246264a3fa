#pragma once
// What a training run reports, in one component; the Trainer only calls it. The start banner
// and run_start event; each step's gauges; the log step (console line, metrics.jsonl row,
// TensorBoard scalars, the Prometheus snapshot, stragglers across ranks); the evaluations;
// the run_end summary. Rank 0 alone writes the run directory (the others pass none); the
// rank statistics of a log step are a collective of every rank.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/clock.h"
#include "session/task.h"

namespace dtrain {

struct Session;
struct DistRuntime;
struct StepStats;
struct TrainState;
struct ParallelLayout;
class RunDir;
class MetricRegistry;
class Nvml;

// "1:02:03", "4:05"; "?" when unknown
std::string hms(double seconds);

class Reporter {
 public:
  struct Parts {
    Session& s;
    DistRuntime* d = nullptr;   // null: one process
    RunDir* run = nullptr;      // rank 0's; null on the other ranks
    MetricRegistry& reg;
    Nvml& nvml;
    const ParallelLayout& layout;
    std::vector<std::string> hosts;  // every rank's host name (data parallel)
    double flops_per_unit = 0, peak = 0;  // MFU: model FLOPs per loss unit, the devices' peak
    int world_size = 1;  // every rank of the job
  };
  explicit Reporter(Parts p);

  void start(const std::string& run_dir, const TrainState& ts);  // rank 0: the banner, run_start
  void begin_window();  // the loop starts: the first log window's clock
  // every step, every rank: the step's samples, phases, busy time (the step minus its
  // gradient sync) and gradient bytes; the loss scale gauge
  void step(const StepStats& ss, double busy_s);
  void progress(int64_t step, int64_t total, double loss, double wall_time_s);  // rank 0, a terminal
  // the log step (every log.every_steps and the last): collective over the ranks
  void log(int64_t step, const StepStats& ss, double lr, double wall_time_s);
  // an evaluation: every rank that holds evaluation data runs it; rank 0 reports it
  std::optional<EvalReport> evaluate(int64_t step, double wall_time_s);
  // rank 0: the run_end event and the "done:" line (`final_eval`: the final evaluation's report)
  void end(const std::string& run_dir, const TrainState& ts, bool stopped_early,
           const std::optional<EvalReport>& final_eval);

 private:
  Parts p_;
  Clock::time_point t_window_;
  int64_t window_samples_ = 0, rank_samples_ = 0;
  std::vector<double> busy_window_;  // this rank's busy time per step of the window
  uint64_t grad_bytes_ = 0;          // this rank's gradient payload bytes over this session's steps
  double pp_idle_s_ = 0, pp_busy_s_ = 0, pp_theory_ = -1;  // the pipeline's waiting and computing time
};

}  // namespace dtrain

#pragma once
// The Trainer: one training run of a recipe on this process (one rank of a data-parallel
// job, or the only process). Its phases:
//   setup   everything that can fail on bad input (the parallel layout, session,
//           rendezvous, metrics endpoint, keep_best / init_from checks), then the run
//           directory, resume or init_from, data parallelism, the start banner;
//   loop    steps until the end, a signal (preemption: checkpoint, exit 0) or early stop;
//           per step: the log step, on_eval (evaluation, keep_best, early stop) and
//           periodic checkpoints;
//   finish  the final checkpoint, the replica check, the final evaluation and summary.
// What the run reports (console, metrics.jsonl, TensorBoard, Prometheus, events) is the
// Reporter's (train/reporter.h). Rank 0 alone writes the run directory; checkpoints are
// collective.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/env.h"
#include "config/config.h"

namespace dtrain {

struct BestMetric;

// What a `dtrain train` invocation resolved to.
struct TrainRequest {
  Config cfg;
  std::string run_dir;
  bool resume = false;       // continue from the newest valid checkpoint
  bool resume_dir = false;   // the run directory was named (--resume RUN_DIR): it must exist
};

class Trainer {
 public:
  Trainer(TrainRequest req, const comm::DistEnv& env);
  ~Trainer();
  // The whole run; 0 when it completed or was preempted. Throws dtrain::Error.
  int run();

 private:
  struct State;
  void setup();
  void resume_or_init();
  bool loop();  // false: stopped by a signal (the preemption checkpoint is written)
  bool on_eval(int64_t step);  // true: early stop
  void mark_best(int64_t step, const BestMetric& m);  // its checkpoint is committed
  void finish();
  std::unique_ptr<State> st_;
};

}  // namespace dtrain

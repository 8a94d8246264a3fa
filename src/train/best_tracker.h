#pragma once
// checkpoint.keep_best and train.early_stop_patience: the best evaluation of a run, continued
// from checkpoints/best.json on resume. Every rank keeps the same verdicts (rank 0's, shared
// through the store by the trainer); rank 0 alone writes best.json.
#include <cstdint>

#include "checkpoint/checkpoint.h"
#include "session/task.h"

namespace dtrain {

class BestTracker {
 public:
  // keep_best off: improves() is always false. patience 0: no early stop.
  BestTracker(bool keep_best, int64_t patience, int64_t eval_every)
      : on_(keep_best), patience_(patience), every_(eval_every) {}
  bool on() const { return on_; }
  bool have() const { return have_; }
  double value() const { return value_; }
  int64_t step() const { return step_; }  // of the best evaluation (-1: none)
  int64_t patience() const { return patience_; }
  // Resumes from the run's best.json (its value and step); nothing when there is none.
  void restore(const CheckpointManager& cm);
  // A finite metric strictly better than the best so far (keep_best on).
  bool improves(const BestMetric& m) const;
  // The evaluation at `now` ends the run: `patience` evaluations in a row since the best did
  // not improve on it (a resumed run that had stopped early stops again at once).
  bool exhausted(int64_t now) const;
  // A better evaluation at step `at`, whose checkpoint is committed: every rank keeps it;
  // rank 0 (lead) writes best.json pointing at `ckpt_dir`.
  void mark(int64_t at, const BestMetric& m, bool lead, const CheckpointManager& cm);

 private:
  bool on_ = false;
  int64_t patience_ = 0, every_ = 0;
  bool have_ = false;
  double value_ = 0;
  int64_t step_ = -1;
};

}  // namespace dtrain

#pragma once
// One training step and one evaluation pass over a Session. Shared by train and bench.
#include <cstdint>

#include "session/session.h"

namespace dtrain::parallel {
class DataParallel;
}

namespace dtrain {

struct StepStats {
  double loss = 0;        // mean over the samples (GPT: tokens) of the step
  int64_t samples = 0;    // images / sequences ... in loss units: tokens for GPT (all ranks)
  int64_t local_samples = 0;  // the same, this rank alone
  double grad_norm = -1;  // when clipping is on
  double sync_s = 0;      // data parallel: exposed gradient communication (not hidden by backward)
  float loss_scale = 1;   // the fp16 loss scale this step ran with (1 for fp32 / bf16)
  bool skipped = false;   // fp16: non-finite gradients, no update (the scale was halved)
  // pipeline parallelism: the schedule's bubble (theory), and the time the stages waited for
  // receives over the time they computed (the pipeline phase, summed over the stages)
  double pp_bubble_theory = -1, pp_idle_s = 0, pp_busy_s = 0;
  StepTimes t;
};

// Zero grads, grad_accum micro-batches of the task's forward+loss, backward, clipping,
// optimizer. With data parallelism (`dp`, every rank calls train_step with the same step)
// gradients are averaged over ranks and loss and samples summed, so the StepStats equal
// those of one process running the ranks' batches as micro-batches. `stop` (optional): in,
// this rank wants to stop after this step (a signal); out, some rank does.
StepStats train_step(Session& s, int64_t step, double lr, parallel::DataParallel* dp = nullptr,
                     bool* stop = nullptr);

// The task's evaluation (EvalStats in session/task.h); empty stats when there is no eval data.
// dp: ZeRO-3 gathers the units collectively, so every rank must call it then.
EvalStats evaluate(Session& s, parallel::DataParallel* dp = nullptr);

}  // namespace dtrain

#pragma once
// One training step and one evaluation pass over a Session. Shared by train and bench.
#include <cstdint>

#include "train/session.h"

namespace dtrain {

struct StepTimes {
  double data_s = 0, forward_s = 0, backward_s = 0, optimizer_s = 0, total_s = 0;
};

struct StepStats {
  double loss = 0;        // mean over the samples of the step
  int64_t samples = 0;
  double grad_norm = -1;  // when clipping is on
  StepTimes t;
};

// Fills `batch` with the next training batch: from the loader, or synthetic data.
void next_train_batch(Session& s, ImageBatch& batch, uint64_t synthetic_seed);

// Zero grads, grad_accum micro-batches of forward+loss+backward, clipping, optimizer.
StepStats train_step(Session& s, int64_t step, double lr);

struct EvalStats {
  double loss = 0, accuracy = 0;
  int64_t samples = 0;
};
EvalStats evaluate(Session& s);

}  // namespace dtrain

#pragma once
// One training step and one evaluation pass over a Session. Shared by train and bench.
#include <cstdint>

#include "train/session.h"

namespace dtrain::dist {
class Communicator;
class GradBuckets;
class ZeroSharder;
}  // namespace dtrain::dist

namespace dtrain {

struct StepTimes {
  double data_s = 0, forward_s = 0, backward_s = 0, optimizer_s = 0, total_s = 0;
};

struct StepStats {
  double loss = 0;        // mean over the samples (GPT: tokens) of the step
  int64_t samples = 0;    // images / sequences ... in loss units: tokens for GPT (all ranks)
  int64_t local_samples = 0;  // the same, this rank alone
  double grad_norm = -1;  // when clipping is on
  double sync_s = 0;      // data parallel: exposed gradient communication (not hidden by backward)
  float loss_scale = 1;   // the fp16 loss scale this step ran with (1 for fp32 / bf16)
  bool skipped = false;   // fp16: non-finite gradients, no update (the scale was halved)
  StepTimes t;
};

// Data parallelism for train_step (null = single process). Every rank calls train_step
// with the same step. Gradients are averaged over ranks (bucketed all-reduce overlapping
// backward, or ZeRO-2 reduce-scatter); loss and samples are summed over ranks, so the
// StepStats equal those of one process running the ranks' batches as micro-batches.
struct DistStep {
  dist::Communicator* comm = nullptr;
  dist::GradBuckets* buckets = nullptr;  // zero 0/1
  dist::ZeroSharder* zero = nullptr;     // zero 1/2
  int zero_stage = 0;
  bool sync_bn = false;  // model.sync_bn: batch-norm statistics over all ranks
  // in: this rank wants to stop after this step (signal); out: some rank does
  bool stop = false;
  // 4 f32 on the device for the step's small all-reduces (loss/samples/stop, the ZeRO-2
  // gradient norm): made at the first step and reused, so later steps allocate nothing.
  Buffer& scratch(Backend& be) {
    if (!scratch_.data()) scratch_ = Buffer(be, 4 * sizeof(float));
    return scratch_;
  }
  Buffer scratch_;
};

// Fills `batch` with the next training batch: from the loader, or synthetic data.
void next_train_batch(Session& s, ImageBatch& batch, uint64_t synthetic_seed);

// Zero grads, grad_accum micro-batches of the task's forward+loss, backward, clipping, optimizer.
StepStats train_step(Session& s, int64_t step, double lr, DistStep* d = nullptr);

// The task's evaluation (EvalStats in train/task.h); empty stats when there is no eval data.
EvalStats evaluate(Session& s);

}  // namespace dtrain

#pragma once
// The end of every training step, plain or pipelined, after its last backward (Megatron's
// finalize_model_grads and optimizer step, with PyTorch GradScaler's skip): the gradients
// reduced over the data group (the pipeline's tied embedding summed over its first and last
// stage), the tensor group's partial gradients summed, the step's agreement over every axis
// of the mesh (loss, samples, stop and fp16 overflow), the norm over every shard and stage,
// clipping, the optimizer and ZeRO's gather of the updated shards. One path whatever the
// layout: the strategy objects (DataParallel, TensorParallelOps, PipelineSync) answer for their
// axis, and each is absent when its dimension is 1.
#include <cstdint>
#include <functional>

#include "core/buffer.h"
#include "nn/params.h"
#include "obs/step_timer.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "parallel/data_parallel.h"
#include "parallel/pipeline_sync.h"
#include "parallel/tensor_parallel.h"

namespace dtrain::parallel {

// The groups a step's gradients are reduced over and agreed on; null where the dimension is 1.
struct StepGroups {
  DataParallel* dp = nullptr;
  TensorParallelOps* tp = nullptr;
  PipelineSync* stages = nullptr;  // pipeline parallelism
};

// What this rank's passes of the step produced.
struct StepLocal {
  std::function<double()> read_loss;  // this rank's loss sum (reads the device: synchronises)
  double samples = 0;                 // this rank's loss units (tokens for GPT)
  bool stop = false;                  // this rank wants to stop after the step (a signal)
  double idle_s = 0, busy_s = 0;      // pipeline: this stage's waiting and computing
};

// The step as the job sees it.
struct StepEnd {
  double loss_sum = 0, samples = 0;  // summed over the data ranks (the loss: the last stage's)
  bool stop = false;                 // some rank wants to stop
  bool skipped = false;              // fp16: some rank's gradients overflowed, nothing updated
  float loss_scale = 1;              // the fp16 loss scale the step ran with (1 otherwise)
  double grad_norm = -1;             // when clipping (train.clip_grad_norm > 0)
  double sync_s = 0;                 // exposed gradient communication and agreement
  double pp_idle_s = 0, pp_busy_s = 0;  // pipeline: summed over the stages
};

struct StepSyncOptions {
  double clip_grad_norm = 0;  // 0: no clipping
  // this process's rank in the whole mesh (failpoint step.grad_overflow)
  int global_rank = 0;
};

class StepSync {
 public:
  StepSync(ParamStore& ps, Arena& arena, LossScaler& scaler, Optimizer& opt, StepTimer& tm, StepGroups g,
           StepSyncOptions o);
  // After the last micro-batch's backward, on every rank with the same `step` (numbered from
  // 0): everything down to the updated parameters. `arena` must be empty (it lends scratch
  // and is reset). Collective over every group.
  StepEnd finish(int64_t step, double lr, const StepLocal& mine);

 private:
  bool local_grads_finite(int64_t step);
  void agree(StepEnd& e, bool& finite);
  double grad_norm(double inv_scale, const ShardedGrads& shards);
  bool update(StepEnd& e, double lr, bool finite, const ShardedGrads& shards);

  ParamStore& ps_;
  Arena& arena_;
  LossScaler& scaler_;
  Optimizer& opt_;
  StepTimer& tm_;
  StepGroups g_;
  StepSyncOptions o_;
};

}  // namespace dtrain::parallel

#pragma once
// Pipeline parallelism (parallel.pipeline = P; GPipe, 1F1B, Megatron's interleaved 1F1B)
// for GPT: the blocks cut into P*V stages (parallel/pipeline_schedule.h), rank r holding
// chunks c = 0..V-1 (virtual stage c*P + r) as GptModel stages (GptSpec::pp_*), with the
// embedding on stage 0 and ln_f + the tied head on the last; activations and their
// gradients travel point to point on the mesh's "pp" group.
//
// A step runs this rank's schedule over the train.grad_accum micro-batches. Each stage keeps
// only its input per in-flight micro-batch (the receive buffer, or the token ids) and runs
// its forward again right before its backward (GPipe's re-materialisation: one more forward
// per micro-batch, activation memory of one micro-batch per stage). The activations and
// gradients move in the groups of parallel::pipeline_p2p_plan (NCCL's rules: in order on the
// pp communicator's stream, sends and receives paired by order, each group's receives
// posted with the previous step's sends, as Megatron does).
// The last stage computes the loss (the micro-batches' sums, as one process does); the
// first and last stage both hold wte and sum their gradients after the backward (Megatron's
// embedding group, parallel/pipeline_sync.h), so both copies stay equal.
#include <memory>
#include <string>
#include <vector>

#include "nn/params.h"

#include "comm/communicator.h"
#include "core/buffer.h"
#include "models/gpt.h"
#include "parallel/pipeline_schedule.h"
#include "session/pipeline_layout.h"
#include "parallel/pipeline_sync.h"
#include "parallel/tensor_parallel.h"
#include "config/config.h"

namespace dtrain {

struct Runtime;
struct StepTimes;
class Task;
namespace parallel {
class DataParallel;
}

// The spec of chunk `chunk` of pipeline rank `rank` (P >= 2).
GptSpec pipeline_chunk_spec(const GptSpec& full, const PipelineLayout& l, int rank, int chunk);

// The time a step's pipeline phase took on this rank and the part of it spent waiting: for
// receives, for its sends to complete, and at the end for the last stage to finish its
// schedule (one barrier of the pp group) - the bubble, and any imbalance between stages.
struct PipeTimes {
  double idle_s = 0, busy_s = 0;
};

class Pipeline {
 public:
  // `chunks`: this rank's models (chunk c = virtual stage c*P + rank), built into s.params.
  Pipeline(const PipelineLayout& l, int rank, std::vector<GptModel*> chunks);
  int rank() const { return rank_; }
  int stages() const { return l_.stages; }
  bool first() const { return rank_ == 0; }
  bool last() const { return rank_ == l_.stages - 1; }
  const PipelineLayout& layout() const { return l_; }
  double bubble_theory(int64_t micro_batches) const {
    return parallel::pipeline_bubble_theory(l_.schedule, l_.stages, int(micro_batches), l_.virtual_stages);
  }
  // The announcement: "pipeline parallel: 2 stages (2 x 1 x 1 mesh, ...) | schedule 1f1b | ...".
  std::string describe(int data, int tensor, int64_t micro_batches) const;
  // The "pp" group (rank = pipeline stage); set after the communicators exist.
  void attach(comm::Communicator* pp) {
    pp_ = pp;
    sync_.attach(pp);
  }
  // The one-process model's spec (no stage, no tensor parallelism).
  GptSpec full_spec() const;
  comm::Communicator* comm() const { return pp_; }

  // The forward and backward passes of one step's `accum` micro-batches (staged through the
  // task, every rank the same ones): gradients accumulated into s.params, the loss sum of
  // micro-batch m in s.loss_slot(m) on the last stage (0 elsewhere). Adds the data wait to
  // t.data_s; returns the loss units (tokens) of the step and this rank's times.
  // ZeRO-3 (`dp` with unit hooks): each action is a pass of its own (a forward: gathered
  // without gradients; a backward: the forward again and the backward, whose gradients are
  // reduce-scattered into the rank's shards as each unit ends).
  int64_t train(Runtime& s, Task& task, int64_t accum, StepTimes& t, PipeTimes& times, int64_t step,
                parallel::DataParallel* dp = nullptr);
  // Evaluation: one batch x [B,T] (targets y [B*T]) through every stage; the loss summed over
  // the batch on the last stage, 0 elsewhere. Every rank calls it for every batch.
  double eval_loss_sum(Runtime& s, const Tensor& x, const Tensor& y, const Tensor& positions = Tensor());
  // The step's collectives over the gradients these passes produced (tied embedding, norm,
  // sums over the stages): parallel/pipeline_sync.h.
  parallel::PipelineSync& sync() { return sync_; }

  // ---- checkpoints (pipeline_ckpt.cpp): the universal layout is the one-process model's ----
  // The full model's parameters, declared only (no storage): names, shapes, offsets, hash.
  const ParamStore& full_layout();
  // Where stage `rank`'s universal layout (its parameters without tensor parallelism's cut)
  // lies in the full model's: one piece per parameter.
  std::vector<FlatPiece> stage_pieces(int rank);
  // This stage's universal values from the full model's universal flat vector.
  std::vector<float> stage_slice(const std::vector<float>& full);

 private:
  GptModel& chunk(int c) { return *chunks_[size_t(c)]; }
  comm::Communicator& pp();
  PipelineLayout l_;
  int rank_ = 0;
  std::vector<GptModel*> chunks_;
  comm::Communicator* pp_ = nullptr;
  std::unique_ptr<Arena> keep_;  // the step's inputs, receive and send buffers
  std::unique_ptr<ParamStore> full_;  // full_layout()
  parallel::PipelineSync sync_;
};

}  // namespace dtrain

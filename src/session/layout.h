#pragma once
// The run's parallel layout, resolved and validated once from the recipe and the world size
// (as torchtitan's ParallelDims): pipeline x data x tensor ranks, the ZeRO stage and its shard
// groups, the pipeline's stages, and the batch. Every other place asks it: the trainer for a
// rank's coordinates and session options, the communicator setup for the mesh, the CLI for a
// launch's checks, the planner for its rows.
//
// Ranks are tensor-innermost and pipeline-outermost: rank = p*(D*T) + d*T + t, so a tensor
// group is T consecutive ranks and a shard group S consecutive data ranks.
//
// The global batch belongs to the layout: micro_batch x grad_accum x data. A recipe may state
// it (train.global_batch, as DeepSpeed's train_batch_size); the accumulation is then derived for
// the world it runs on. A resume on another world size keeps the checkpoint's global batch the
// same way, or exits 2 naming the keys when no whole accumulation gives it; either way
// batch_note says what was derived.
#include <cstdint>
#include <string>

#include "config/config.h"
#include "session/pipeline.h"
#include "session/session.h"

namespace dtrain {

struct ParallelLayout {
  int world = 1;         // ranks
  int pipeline = 1;      // P: stages (outermost)
  int data = 1;          // D: data-parallel ranks of each stage
  int tensor = 1;        // T: tensor-parallel ranks (innermost)
  bool sequence = false; // sequence parallelism over the tensor group
  int zero = 0;          // ZeRO stage (no effect with D = 1)
  int shard_group = 1;   // ZeRO-3 hybrid sharding: consecutive data ranks per shard group (divides D)
  PipelineLayout pipe;   // stages, virtual stages, schedule, blocks per stage (P = 1: one stage)
  int64_t micro_batch = 1;  // per data rank (train.batch_size)
  int64_t grad_accum = 1;   // micro-batches per optimizer step
  std::string batch_note;   // non-empty when the accumulation was derived: what and why

  int64_t global_batch() const { return micro_batch * grad_accum * data; }

  struct Coord {
    int pipe = 0, data = 0, tensor = 0;
  };
  Coord coord(int rank) const;
  int rank_of(const Coord& c) const;
  // A rank's session: its data/tensor/pipeline coordinates, ZeRO's sharding (the caller sets
  // with_eval_data and the device)
  SessionOptions session_options(int rank) const;
  // "2 stages x 2 data x 2 tensor ranks, ZeRO-1, global batch 32 = 4 x 4 micro-batches x 2"
  std::string describe() const;
};

// The layout of `cfg` over `world` ranks. Derives train.grad_accum where the global batch
// decides it, and writes it into cfg: the recipe's train.global_batch, else, when resuming a
// checkpoint that `resumed_data_ranks` data ranks wrote (0: none) and this layout has another
// number, the checkpoint's `resumed_global_batch`. Then checks every rule of the layout and
// names all that fail in one UserError (exit 2).
ParallelLayout resolve_layout(Config& cfg, int world, int64_t resumed_global_batch = 0, int resumed_data_ranks = 0);

}  // namespace dtrain

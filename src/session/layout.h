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
#include "parallel/grad_compression.h"
#include "session/pipeline_layout.h"
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
  DType reduce_dtype = DType::F32;         // ZeRO-3's reduce-scatter (parallel.reduce_dtype)
  parallel::CompressionOptions compression;  // of the bucket all-reduces (parallel.grad_compression)
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

// The rules resolve_layout applies (session/layout_rules.cpp), each on its own for the
// planner and the tests.
// parallel.shard_group_size for `world` ranks, resolved: world when 0 (or when ZeRO-3 is
// off and it equals world), else the value. UserError naming the key when it does not
// divide world, or when it is set without parallel.zero = 3.
int resolve_shard_group_size(const Config& cfg, int world);
// parallel.reduce_dtype: F32 or BF16; UserError naming the key when bf16 is set without
// parallel.zero = 3 (stages 0-2 reduce in f32 only).
DType resolve_reduce_dtype(const Config& cfg);
// parallel.grad_compression and the powersgd keys. UserError naming the keys for a
// compression under parallel.zero >= 2 (the reduce-scatter paths), parallel.tensor > 1, or
// powersgd with precision.dtype = "fp16" (an overflowed step would poison the error feedback).
parallel::CompressionOptions resolve_grad_compression(const Config& cfg);

// parallel.tensor checked against the world size and the rest of the recipe: UserError naming
// the keys when it does not divide `world`, or with what tensor parallelism does not support
// yet (a model other than GPT, ZeRO, recompute, CUDA graphs, 16-bit precision), and
// parallel.sequence without T > 1 or with a T that does not divide model.block_size. Returns T.
int check_tensor_parallel(const Config& cfg, int world);
// The pipeline shape of a recipe, checked (UserError naming the keys and the numbers): P
// must divide `world` together with parallel.tensor (world = pipeline x data x tensor),
// the model must be GPT, and the schedule's conditions hold (interleaved: grad_accum
// divisible by P, n_layer by P*V unless parallel.stage_layers is set); features the
// pipeline does not support are refused. P = 1: an empty layout (stages 1).
PipelineLayout check_pipeline(const Config& cfg, int world);

}  // namespace dtrain

#pragma once
// ZeRO stages 1 and 2 over the data-parallel group: rank r owns elements
// shard_range(total, r, world) of the flat buffers (its optimizer state and, for stage 2, its
// reduced gradients). Shards are equal-sized ceil(total/world) except the tail, so the
// collectives work on a padded buffer of world * ceil(total/world) elements.
//
// The sharder owns the stage-specific parts of a training step, so the step never branches
// on the stage: which gradients the step reduced (reduce_grads), where their norm comes
// from (grad_sq_norm) and which part a rank checks for overflow (reduced_grads).
#include <cstdint>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "nn/params.h"

namespace dtrain::parallel {

// Rank r's contiguous range: [r*s, min((r+1)*s, total)) with s = ceil(total/world).
FlatRange shard_range(int64_t total, int rank, int world);

// x summed over the group (one f32 all-reduce through `scratch`, >= 4 bytes on the device):
// the gradient norm's squares of the shards. Collective.
double sum_over_group(comm::Communicator& comm, Backend& be, const Buffer& scratch, double x);

class ZeroSharder {
 public:
  // stage 1: only the optimizer state is sharded (gradients are all-reduced in buckets);
  // stage 2: gradients are reduce-scattered, each rank keeping its own shard.
  ZeroSharder(comm::Communicator& comm, ParamStore& ps, int stage);
  int stage() const { return stage_; }
  FlatRange range() const { return range_; }  // pass to the optimizer
  // Stage 2: gradients of every rank reduced (Avg) into this rank's range of flat_grads
  // (the rest of flat_grads is left as it was); stage 1: nothing (the buckets reduced them).
  // Returns the seconds spent.
  double reduce_grads();
  // The gradients this rank holds reduced: its shard (stage 2) or all of them (stage 1).
  Tensor reduced_grads() const;
  // Squared L2 norm of the whole reduced gradient, times scale^2 (collective under stage 2:
  // the shards' squares summed over ranks, computed on the device).
  double grad_sq_norm(double scale);
  // After the optimizer updated this rank's range of flat_params: every rank receives
  // every shard. Returns seconds spent.
  double allgather_params();

 private:
  comm::Communicator& comm_;
  ParamStore& ps_;
  int stage_ = 1;
  FlatRange range_;
  int64_t shard_ = 0;  // ceil(total / world)
  Buffer padded_, shard_buf_, norm_buf_;
};

}  // namespace dtrain::parallel

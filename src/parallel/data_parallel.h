#pragma once
// Data parallelism as the training step sees it: DDP's bucketed all-reduce (zero 0), ZeRO-1
// (the optimizer state sharded, gradients all-reduced in buckets) and ZeRO-2 (gradients
// reduce-scattered too), behind one interface so the step never branches on the stage.
//
// ZeRO-3 (parallel/zero3.h) shards the parameters too: its unit hooks gather and release
// each unit's parameters around its use and reduce-scatter its gradients. With hybrid
// sharding (shard_group_size S < the group's size) it runs on the shard group of S
// consecutive ranks and averages the reduced gradients over the replicate group; agree(),
// sync_sum() and everything else stay on the whole group.
//
// A step calls, in order: begin_micro(last) before each micro-batch's forward (grad_hook
// launches bucket all-reduces as gradients become ready; unit_hooks() go into the Ctx),
// end_micro() after each micro-batch's backward, reduce_grads() after the last backward, agree() once (the step's one small all-reduce of loss, samples, stop and
// overflow flags), grad_norm() when clipping, the optimizer over optimizer_range(), then
// gather_params().
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "nn/params.h"
#include "parallel/grad_buckets.h"
#include "parallel/tensor_parallel.h"
#include "parallel/zero.h"
#include "parallel/zero3.h"

namespace dtrain::parallel {

struct DataParallelOptions {
  int zero_stage = 0;     // 0 | 1 | 2 | 3 (3: the ParamStore is sharded, ParamStore::set_sharding)
  double bucket_mb = 25;  // gradient bucket size (the first bucket is at most 1 MiB)
  bool sync_bn = false;   // batch-norm statistics summed over the group
  // ZeRO-3 hybrid sharding: shard within groups of this many consecutive ranks (comm::
  // DeviceMesh::shard_group), replicate across them; 0 or the group's size = no hybrid. The
  // ParamStore must be sharded over it (set_sharding(rank % S, S)).
  int shard_group_size = 0;
  // ZeRO-3: the dtype the gradient windows are reduce-scattered in (F32 or BF16,
  // parallel.reduce_dtype); the other stages take F32 only.
  DType reduce_dtype = DType::F32;
  // Gradient compression of the bucket all-reduces (parallel.grad_compression; stages 0-1).
  CompressionOptions compression;
};

// What every rank must agree on at the end of a step.
struct StepFlags {
  double loss_sum = 0;     // summed over ranks
  double samples = 0;      // summed over ranks
  bool stop = false;       // some rank wants to stop after this step (a signal)
  bool nonfinite = false;  // some rank's reduced gradients hold inf/nan (fp16: skip the step)
};

class DataParallel {
 public:
  // Broadcasts rank 0's parameters and buffers and checks that every rank holds them, then
  // plans the buckets / shards (hybrid sharding: splits the shard and replicate groups from
  // `comm`). Collective.
  DataParallel(comm::Communicator& comm, ParamStore& ps, const DataParallelOptions& o);
  int zero_stage() const { return opts_.zero_stage; }
  comm::Communicator& comm() { return comm_; }
  // The range of the flat buffers this rank's optimizer updates: everything, or its shard.
  FlatRange optimizer_range() const;
  // Before each micro-batch's forward; last = the micro-batch whose gradients are reduced.
  void begin_micro(bool last);
  // A step without backward hooks (a pipeline's: the gradients are reduced after its last
  // backward): the buckets expect that reduction. ZeRO-3 reduces per pass (begin_micro).
  void expect_reduction();
  // Does the reduction leave each rank a shard of the flat gradients (ZeRO-2's
  // reduce-scatter)? Then a sum over other ranks' ranges must come before it, and the
  // updated parameters are complete only after gather_params.
  bool scatters_grads() const;
  // Are the parameters themselves sharded (ZeRO-3)?
  bool shards_params() const { return zero3_ != nullptr; }
  // After each micro-batch's backward (ZeRO-3: the root units' reduce-scatter and the wait
  // for every unit's); returns the seconds spent waiting.
  double end_micro();
  // ZeRO-3's gather/release hooks for Ctx::units (forward, backward and evaluation); null
  // otherwise.
  UnitHooks* unit_hooks();
  // Around an evaluation's forwards (ZeRO-3: the root units gathered once). Collective.
  void begin_eval();
  void end_eval();
  // Every parameter in the flat layout on the host, gathered (ZeRO-3) for a checkpoint;
  // empty when the ParamStore holds them all. Collective.
  std::vector<float> gather_full_params();
  // Ctx::grad_ready (bucket all-reduces overlapping backward); empty without buckets.
  std::function<void(int)> grad_hook();
  // Ctx::sync_sum (model.sync_bn); empty when off.
  std::function<void(Tensor&)> sync_sum();
  // After the last micro-batch's backward: waits for the buckets, reduce-scatters under
  // ZeRO-2. Returns the seconds spent waiting.
  double reduce_grads();
  // The gradients this rank holds reduced (its shard under ZeRO-2): what it checks for
  // overflow.
  Tensor reduced_grads() const;
  // L2 norm of the whole reduced gradient times |scale| (collective under ZeRO-2).
  double grad_norm(double scale);
  // Where the reduced gradients are for a norm computed elsewhere (tensor and pipeline
  // parallelism): ZeRO-2's shard range of flat_grads, ZeRO-3's unit shards, and the group to
  // sum the shards' squares over; otherwise all of flat_grads on every rank and no group.
  ShardedGrads sharded_grads();
  // The ranks whose optimizer ranges (ZeRO-1/2) or shards (ZeRO-3; hybrid sharding: the shard
  // group, the replicas hold the same ones) make up the whole state: this group or a sub-group.
  comm::Communicator& state_comm();
  // One all-reduce of the step's flags (mine -> the group's). Collective.
  StepFlags agree(const StepFlags& mine);
  // After the optimizer: every rank receives the updated shards (ZeRO); seconds spent.
  double gather_params();
  const GradBuckets* buckets() const { return buckets_.get(); }
  // PowerSGD's state of this rank (parallel.grad_compression = "powersgd"; empty otherwise)
  // for a checkpoint, and its load (GradCompressor::export_state / import_state; false when
  // it does not fit, nothing changed).
  std::vector<ParamStore::Exported> compression_state() const;
  bool load_compression_state(const TensorLookup& lookup);
  // The optimizer step the next reduce_grads() belongs to (set once after a resume).
  void set_step(int64_t step);
  // Payload bytes this rank sent for the last step's gradient reduction (the bucket
  // all-reduces, compressed or not; ZeRO-2's reduce-scatter). 0 with ZeRO-3.
  uint64_t grad_bytes() const { return grad_bytes_; }
  const Zero3* zero3() const { return zero3_.get(); }

 private:
  comm::Communicator& comm_;
  ParamStore& ps_;
  DataParallelOptions opts_;
  std::unique_ptr<comm::Communicator> shard_, replicate_;  // hybrid sharding (before zero3_: outlive it)
  std::unique_ptr<GradBuckets> buckets_;  // zero 0/1
  std::unique_ptr<ZeroSharder> zero_;     // zero 1/2
  std::unique_ptr<Zero3> zero3_;          // zero 3
  Buffer flags_;                          // 4 f32 on the device for agree()
  uint64_t grad_bytes_ = 0;
};

// The whole gradient's L2 norm times |scale| on one process (what DataParallel::grad_norm
// gives when every rank holds all reduced gradients).
double full_grad_norm(Backend& be, const Tensor& grads, double scale);

}  // namespace dtrain::parallel

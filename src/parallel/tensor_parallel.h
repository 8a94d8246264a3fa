#pragma once
// Tensor parallelism over a communicator (parallel.tensor = T; Megatron-LM): the group's
// collectives for the layers (nn/tp.h), the gathers that turn the ranks' parts into the
// universal layout (checkpoints), and the gradient norm of a tensor-parallel model.
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "nn/params.h"
#include "nn/tp.h"

namespace dtrain::parallel {

// The layers' view of a tensor-parallel communicator ("tp" group of comm::split_mesh).
class CommTensorParallel final : public TensorParallelOps {
 public:
  explicit CommTensorParallel(comm::Communicator& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  void allreduce_sum(Tensor& t) override { c_.allreduce(t, comm::ReduceOp::Sum); }
  void allreduce_max(Tensor& t) override { c_.allreduce(t, comm::ReduceOp::Max); }
  void allgather(const Tensor& shard, Tensor& out) override { c_.allgather(shard, out); }
  void reduce_scatter_sum(const Tensor& in, Tensor& out_shard) override {
    c_.reduce_scatter(in, out_shard, comm::ReduceOp::Sum);
  }
  comm::Communicator& comm() { return c_; }

 private:
  comm::Communicator& c_;
};

// Every rank's flat vector of ps's local layout (host, num_params() values) assembled into
// the universal layout (ParamStore::tp_assemble), on every rank. Collective over the group.
std::vector<float> tp_gather_universal(comm::Communicator& tp, const ParamStore& ps, const std::vector<float>& local);
// The parameters in the universal layout (for export_state). Collective over the group.
std::vector<float> tp_gather_params(comm::Communicator& tp, const ParamStore& ps);
// Optimizer state (Optimizer::export_state of an optimizer owning the whole local layout)
// in the universal layout: every F32 state assembled, the rest ("step") as it is. Collective.
std::vector<ParamStore::Exported> tp_gather_state(comm::Communicator& tp, const ParamStore& ps,
                                                  std::vector<ParamStore::Exported> local);
// The gradients a rank holds reduced, for a norm or a sum computed outside the data-parallel
// code (tensor and pipeline parallelism): `pieces` of the flat layout (FlatPiece::global) at
// FlatPiece::local of `grads` (ZeRO-2: its one shard range of flat_grads; ZeRO-3: the unit
// shards in shard_grads), and `group`, the ranks whose pieces make up the whole (the shard
// group). Default: every gradient in flat_grads, on every rank (ZeRO 0/1), no group. The
// tensor-parallel ranks of a tp group share one local layout, hence the same pieces.
struct ShardedGrads {
  std::vector<FlatPiece> pieces;
  Tensor grads;
  comm::Communicator* group = nullptr;
};

// Sequence parallelism (parallel.sequence): the gradients of the replicated parameters that
// each rank computed from its rows only (ParamDesc::tp_partial: the layer norms) summed over
// the group, in one all-reduce of their concatenation (those inside `shards` only). Call once
// per step after the backward (and the data-parallel reduction, which commutes with it),
// before the gradient norm and the optimizer. `arena` (empty) lends the staging buffer and is
// reset after. Collective.
void tp_sum_partial_grads(TensorParallelOps& tp, const ParamStore& ps, Arena& arena, const ShardedGrads& shards = {});

// A step's stop request (a signal) and fp16 overflow (the cut parameters' gradients differ
// per rank) ORed over the tensor-parallel group, so its ranks stop or skip at the same step.
// The data-parallel agreement (DataParallel::agree) covers the data group only; done over each
// axis of the mesh in turn, the flags reach every rank. `arena` lends two floats, reset after.
// Collective.
struct TpFlags {
  bool stop = false, nonfinite = false;
};
TpFlags tp_agree(TensorParallelOps& tp, Backend& be, Arena& arena, TpFlags mine);

// The squared gradients of ps that `shards` holds, {of the tensor-parallel cut parameters
// (ParamDesc::tp_dim >= 0), of the rest}, per parameter in order; parameters for which `skip`
// is true are left out. On this rank only (see sum_over_shards).
struct GradSquares {
  double cut = 0, whole = 0;
};
GradSquares grad_squares(const ParamStore& ps, const ShardedGrads& shards = {},
                         const std::function<bool(const ParamDesc&)>& skip = {});
// The squares of the shards summed over shards.group (when there is one): {cut, whole} in one
// f32 all-reduce lent by `arena` (reset after). Collective over the group.
GradSquares sum_over_shards(const ShardedGrads& shards, Backend& be, Arena& arena, GradSquares sq);

// The L2 norm of the whole model's gradient times |scale|: the parts of cut parameters summed
// over the group, the replicated ones (equal on every rank) counted once; sharded gradients'
// squares summed over their group first. Collective. `arena` (empty: the step's, between
// micro-batches) lends the all-reduced scalars and is reset after.
double tp_grad_norm(TensorParallelOps& tp, const ParamStore& ps, Arena& arena, double scale,
                    const ShardedGrads& shards = {});

}  // namespace dtrain::parallel

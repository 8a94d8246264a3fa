#pragma once
// The pipeline's collectives over a step's gradients (Megatron's embedding group and its
// all-reduces over the pipeline group): the tied parameter's gradients summed over the first
// and last stage, values summed over the stages, the whole model's gradient norm, and the
// tied weights made equal again after a sharded update. The schedule's passes
// (session/pipeline.h) produce the gradients; this is what a step does with them.
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "nn/params.h"
#include "parallel/tensor_parallel.h"

namespace dtrain::parallel {

class DataParallel;

class PipelineSync {
 public:
  // `rank` of `stages` on the pipeline group; `tied`: the parameter the first and last stage
  // share (gpt_tied_param), "" when the head is untied.
  PipelineSync(int rank, int stages, std::string tied);
  // The "pp" group (rank = pipeline stage); set after the communicators exist.
  void attach(comm::Communicator* pp) { pp_ = pp; }
  bool first() const { return rank_ == 0; }
  bool last() const { return rank_ == stages_ - 1; }

  // The data-parallel reduction (dp may be null) with the tied embedding's gradients summed
  // where the strategy needs them: before a reduction that scatters the gradients (ZeRO-2:
  // the two stages' shards of the tied rows lie at other offsets), else after it (ZeRO-3:
  // from the gathered shards). Returns the seconds spent waiting for the reduction.
  double reduce(ParamStore& ps, Arena& arena, DataParallel* dp);
  // After the optimizer: the tied copies equal again where the update ran on shards (ZeRO-2).
  void after_update(ParamStore& ps, DataParallel* dp);
  // The tied parameter's gradients of the first and last stage summed (both end with the same
  // bits). Not collective beyond those two. ZeRO-3 (`shards`: the shard group): each stage's
  // gradient is all-gathered from the unit shards first, and each rank keeps its own shard
  // of the sum.
  void sum_tied(ParamStore& ps, Arena& arena, comm::Communicator* shards = nullptr);
  // ZeRO-2: after the step, the last stage takes the first's tied weights, bit for bit (their
  // reduce-scatters may add the data ranks in different orders: more than 2 data ranks).
  void copy_tied_weights(ParamStore& ps);
  // The L2 norm of the whole model's gradient (every stage, the tied parameter counted once)
  // times |scale|, with tensor parallelism's parts and ZeRO-2's shards (their group sums the
  // squares). Collective over the pp (and tp, and under ZeRO-2 dp) group.
  double grad_norm(ParamStore& ps, TensorParallelOps* tp, Arena& arena, double scale, const ShardedGrads& shards = {});
  // Sums `v` over the pipeline group (f32), in place. Collective.
  void sum(Backend& be, std::vector<double>& v);

 private:
  void sum_tied_sharded(ParamStore& ps, Arena& arena, int id, comm::Communicator& shards);
  void swap_with_peer(const Tensor& mine, const Tensor& theirs, const std::string& what);
  comm::Communicator& pp();
  int rank_ = 0, stages_ = 1;
  std::string tied_;
  comm::Communicator* pp_ = nullptr;
  Buffer flags_;
};

}  // namespace dtrain::parallel

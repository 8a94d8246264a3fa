#pragma once
// Tensor parallelism as the layers see it (parallel.tensor = T; Megatron-LM, Shoeybi et al.
// 2019): the collectives over this rank's tensor-parallel group, behind an interface so the
// model layer needs no communicator (parallel/tensor_parallel.h implements it over one).
// Ctx::tp is null outside tensor parallelism.
//
// A tensor-parallel parameter is rank r's part of the full tensor (ParamDesc::tp_dim): the
// ParamStore keeps the part and maps it to the universal flat layout, the one a single
// process has (ParamStore::tp_pieces), for initialisation, checkpoints and optimizer state.
#include "core/tensor.h"

namespace dtrain {

class TensorParallelOps {
 public:
  virtual ~TensorParallelOps() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // t summed over the group, in place (f32, bf16 or f16 on the backend's device; 16-bit
  // sums as the communicator adds them); every rank gets the same bits
  virtual void allreduce_sum(Tensor& t) = 0;
  // t (f32) replaced by its elementwise max over the group, in place
  virtual void allreduce_max(Tensor& t) = 0;
  // out [size() * n] = every rank's shard [n], in rank order (f32, bf16 or f16)
  virtual void allgather(const Tensor& shard, Tensor& out) = 0;
  // out_shard [n] = the sum over the group of every rank's in[rank()*n, (rank()+1)*n) (f32, bf16 or f16;
  // in has size() * n elements): sequence parallelism's reduce-scatter
  virtual void reduce_scatter_sum(const Tensor& in, Tensor& out_shard) = 0;
};

}  // namespace dtrain

#include "nn/seq_parallel.h"

namespace dtrain {

namespace {
TensorParallelOps& group(Ctx& ctx) {
  DTRAIN_CHECK(ctx.tp && ctx.tp->size() > 1, "sequence parallelism without a tensor-parallel group");
  return *ctx.tp;
}
}  // namespace

Tensor sp_gather_rows(Ctx& ctx, const Tensor& shard) {
  TensorParallelOps& tp = group(ctx);
  DTRAIN_CHECK(shard.ndim() >= 1 && is_float(shard.dtype), "sequence parallel gather of {}", shard.str());
  Shape s = shard.shape;
  s[0] *= tp.size();
  Tensor full = ctx.arena.alloc(shard.dtype, s);
  Tensor out = full.view(Shape{full.numel()});
  tp.allgather(shard.view(Shape{shard.numel()}), out);
  return full;
}

Tensor sp_scatter_rows(Ctx& ctx, const Tensor& full, Arena* arena) {
  TensorParallelOps& tp = group(ctx);
  DTRAIN_CHECK(full.ndim() >= 1 && is_float(full.dtype) && full.dim(0) % tp.size() == 0,
               "sequence parallel reduce-scatter of {} over {} ranks", full.str(), tp.size());
  Shape s = full.shape;
  s[0] /= tp.size();
  Tensor shard = (arena ? *arena : ctx.arena).alloc(full.dtype, s);
  Tensor out = shard.view(Shape{shard.numel()});
  tp.reduce_scatter_sum(full.view(Shape{full.numel()}), out);
  return shard;
}

}  // namespace dtrain

// CudaBackend's mixture-of-experts ops: validation + launches of moe_ops.cu.
#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/expect.h"
#include "backend/cuda/moe_kernels.h"

namespace dtrain {
namespace k = cuda_kernels;
using namespace cuda_expect;

void CudaBackend::moe_route_fwd(const Tensor& logits, int top_k, bool norm_topk, int64_t capacity, Tensor& probs,
                                Tensor& lse, Tensor& sel, Tensor& weights, Tensor& counts, Tensor& order, Tensor& pos,
                                Tensor& stats) {
  const char* op = "moe_route_fwd";
  expect_float(logits, op, "logits");
  DTRAIN_CHECK(logits.ndim() == 2 && logits.dim(1) >= 1 && top_k >= 1 && top_k <= logits.dim(1),
               "{}: logits {} with top_k {}", op, logits.str(), top_k);
  const int64_t N = logits.dim(0), E = logits.dim(1), K = top_k;
  expect_like(probs, DType::F32, N * E, op, "probs");
  expect_like(lse, DType::F32, N, op, "lse");
  expect_like(sel, DType::I32, N * K, op, "sel");
  expect_like(weights, DType::F32, N * K, op, "weights");
  expect_like(counts, DType::I32, E, op, "counts");
  expect_like(order, DType::I32, N * K, op, "order");
  expect_like(pos, DType::I32, N * K, op, "pos");
  expect_like(stats, DType::F32, E + 1, op, "stats");
  k::moe_route_fwd(logits.data, logits.dtype, N, E, top_k, norm_topk, capacity, probs.f32(), lse.f32(),
                   static_cast<int32_t*>(sel.data), weights.f32(), static_cast<int32_t*>(counts.data),
                   static_cast<int32_t*>(order.data), static_cast<int32_t*>(pos.data), stats.f32(), stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
}

void CudaBackend::moe_route_bwd(const Tensor& probs, const Tensor& lse, const Tensor& sel, const Tensor& weights,
                                const Tensor& dweights, const Tensor& paux, float zscale, bool norm_topk,
                                Tensor& dlogits) {
  const char* op = "moe_route_bwd";
  DTRAIN_CHECK(probs.ndim() == 2 && sel.ndim() == 2 && sel.dim(0) == probs.dim(0), "{}: probs {} sel {}", op,
               probs.str(), sel.str());
  const int64_t N = probs.dim(0), E = probs.dim(1), K = sel.dim(1);
  expect_like(probs, DType::F32, N * E, op, "probs");
  expect_like(lse, DType::F32, N, op, "lse");
  expect_like(sel, DType::I32, N * K, op, "sel");
  expect_like(weights, DType::F32, N * K, op, "weights");
  expect_like(dweights, DType::F32, N * K, op, "dweights");
  if (paux.defined()) expect_like(paux, DType::F32, E, op, "paux");
  expect_float(dlogits, op, "dlogits");
  expect_like(dlogits, dlogits.dtype, N * E, op, "dlogits");
  float* ws = static_cast<float*>(scratch_.get(size_t(std::max<int64_t>(N * E, 1)) * sizeof(float)));
  k::moe_route_bwd(probs.f32(), lse.f32(), static_cast<const int32_t*>(sel.data), weights.f32(), dweights.f32(),
                   paux.defined() ? paux.f32() : nullptr, zscale, norm_topk, N, E, int(K), dlogits.data,
                   dlogits.dtype, stream_, ws);
  DTRAIN_KERNEL_CHECK(what(op, probs));
}

void CudaBackend::moe_gather(const Tensor& x, const Tensor& order, int top_k, Tensor& y) {
  const char* op = "moe_gather";
  expect_float(x, op, "x");
  DTRAIN_CHECK(x.ndim() == 2 && top_k >= 1, "{}: x {} must be [N,C]", op, x.str());
  const int64_t C = x.dim(1), M = order.numel();
  expect_like(order, DType::I32, M, op, "order");
  expect_like(y, x.dtype, M * C, op, "y");
  k::moe_gather(x.data, static_cast<const int32_t*>(order.data), top_k, M, C, y.data, x.dtype, stream_);
  DTRAIN_KERNEL_CHECK(what(op, x));
}

void CudaBackend::moe_combine(const Tensor& ye, const Tensor& pos, const Tensor& weights, int top_k, Tensor& y,
                              bool accumulate) {
  const char* op = "moe_combine";
  expect_float(ye, op, "ye");
  DTRAIN_CHECK(ye.ndim() == 2 && y.ndim() == 2 && ye.dim(1) == y.dim(1) && top_k >= 1, "{}: ye {} y {}", op, ye.str(),
               y.str());
  const int64_t N = y.dim(0), C = y.dim(1);
  expect_like(y, ye.dtype, N * C, op, "y");
  expect_like(pos, DType::I32, N * top_k, op, "pos");
  if (weights.defined()) expect_like(weights, DType::F32, N * top_k, op, "weights");
  k::moe_combine(ye.data, static_cast<const int32_t*>(pos.data), weights.defined() ? weights.f32() : nullptr, top_k,
                 N, C, y.data, accumulate, ye.dtype, stream_);
  DTRAIN_KERNEL_CHECK(what(op, ye));
}

void CudaBackend::moe_combine_bwd(const Tensor& dy, const Tensor& ye, const Tensor& pos, const Tensor& weights,
                                  int top_k, Tensor& dye, Tensor& dweights) {
  const char* op = "moe_combine_bwd";
  expect_float(dy, op, "dy");
  DTRAIN_CHECK(dy.ndim() == 2 && ye.ndim() == 2 && ye.dim(1) == dy.dim(1) && ye.dim(0) == dy.dim(0) * top_k,
               "{}: dy {} ye {} top_k {}", op, dy.str(), ye.str(), top_k);
  const int64_t N = dy.dim(0), C = dy.dim(1);
  expect_like(ye, dy.dtype, N * top_k * C, op, "ye");
  expect_like(dye, dy.dtype, N * top_k * C, op, "dye");
  expect_like(pos, DType::I32, N * top_k, op, "pos");
  expect_like(weights, DType::F32, N * top_k, op, "weights");
  expect_like(dweights, DType::F32, N * top_k, op, "dweights");
  k::moe_combine_bwd(dy.data, ye.data, static_cast<const int32_t*>(pos.data), weights.f32(), top_k, N, C, dye.data,
                     dweights.f32(), dy.dtype, stream_);
  DTRAIN_KERNEL_CHECK(what(op, dy));
}

}  // namespace dtrain

// Softmax cross-entropy with label smoothing (PyTorch F.cross_entropy, reduction='none'):
//   loss_i = lse_i - (1-eps) * x[i,y_i] - (eps/C) * sum_j x[i,j]
//   dlogits = grad_scale * (softmax(x_i) - (1-eps) * onehot(y_i) - eps/C)
// One block per row; max, sum-exp and sum are fixed-order block reductions (stable and
// deterministic).
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"

namespace dtrain::cuda_kernels {
namespace {

template <typename T>
__global__ void softmax_xent_k(const T* logits, int C, const int32_t* labels, float eps,
                               float grad_scale, float* losses, T* dlogits) {
  __shared__ float sh[kThreads];
  int64_t row = blockIdx.x;
  const T* x = logits + row * C;
  int y = labels[row];
  bool bad = y < 0 || y >= C;

  float mx = -INFINITY;
  for (int j = threadIdx.x; j < C; j += blockDim.x) mx = fmaxf(mx, to_f(x[j]));
  mx = block_max(mx, sh);

  float se = 0.f, sx = 0.f;
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    float v = to_f(x[j]);
    se += expf(v - mx);
    sx += v;
  }
  se = block_sum(se, sh);
  sx = block_sum(sx, sh);
  float lse = mx + logf(se);

  if (threadIdx.x == 0) {
    losses[row] = bad ? NAN : lse - (1.f - eps) * to_f(x[y]) - eps / float(C) * sx;
  }
  if (dlogits) {
    T* d = dlogits + row * C;
    float inv = 1.f / se;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
      float p = expf(to_f(x[j]) - mx) * inv;
      float t = eps / float(C) + (j == y ? 1.f - eps : 0.f);
      d[j] = from_f<T>(bad ? NAN : grad_scale * (p - t));
    }
  }
}

}  // namespace

void softmax_xent(const void* logits, DType t, int N, int C, const int32_t* labels,
                  float label_smoothing, float grad_scale, float* losses, void* dlogits,
                  cudaStream_t s) {
  if (N == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    softmax_xent_k<T><<<N, kThreads, 0, s>>>(static_cast<const T*>(logits), C, labels,
                                             label_smoothing, grad_scale, losses,
                                             static_cast<T*>(dlogits));
  });
}

}  // namespace dtrain::cuda_kernels

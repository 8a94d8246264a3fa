// Softmax cross-entropy with label smoothing (PyTorch F.cross_entropy, reduction='none'):
//   loss_i = lse_i - (1-eps) * x[i,y_i] - (eps/C) * sum_j x[i,j]
//   dlogits = grad_scale * (softmax(x_i) - (1-eps) * onehot(y_i) - eps/C)
// Rows are independent; the work per row picks the kernel:
//   C <= kThreadRowC   one thread per row, the row in registers (segmentation: millions
//                      of rows of a few classes; a warp reads consecutive rows, coalesced)
//   C <= kWarpRowC     one warp per row, lane-strided over the classes
//   larger             one block per row (vocabulary-sized rows)
// Max, sum-exp and sum are fixed-order reductions (stable and deterministic).
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"

namespace dtrain::cuda_kernels {
namespace {

constexpr int kThreadRowC = 16, kWarpRowC = 1024;

// logits [N,C] (C <= MAXC), labels [N], losses [N], dlogits [N,C] or null
template <typename T, int MAXC>
__global__ void xent_thread_k(const T* logits, int64_t N, int C, const int32_t* labels,
                              float eps, float grad_scale, float* losses, T* dlogits) {
  DTRAIN_GRID_STRIDE(row, N) {
    const T* x = logits + row * C;
    const int y = labels[row];
    const bool bad = y < 0 || y >= C;
    float v[MAXC];
    float mx = -INFINITY, sx = 0.f, xy = 0.f;
#pragma unroll
    for (int j = 0; j < MAXC; ++j)
      if (j < C) {
        v[j] = to_f(x[j]);
        mx = fmaxf(mx, v[j]);
        sx += v[j];
        if (j == y) xy = v[j];
      }
    float se = 0.f;
#pragma unroll
    for (int j = 0; j < MAXC; ++j)
      if (j < C) se += expf(v[j] - mx);
    const float lse = mx + logf(se);
    losses[row] = bad ? NAN : lse - (1.f - eps) * xy - eps / float(C) * sx;
    if (dlogits) {
      T* d = dlogits + row * C;
      const float inv = 1.f / se;
#pragma unroll
      for (int j = 0; j < MAXC; ++j)
        if (j < C) {
          const float p = expf(v[j] - mx) * inv;
          const float t = eps / float(C) + (j == y ? 1.f - eps : 0.f);
          d[j] = from_f<T>(bad ? NAN : grad_scale * (p - t));
        }
    }
  }
}

// Same, one warp per row; blocks of kThreads (8 rows at a time), grid-stride over rows.
template <typename T>
__global__ void xent_warp_k(const T* logits, int64_t N, int C, const int32_t* labels, float eps,
                            float grad_scale, float* losses, T* dlogits) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int64_t row = int64_t(blockIdx.x) * warps + (threadIdx.x >> 5); row < N;
       row += int64_t(gridDim.x) * warps) {  // uniform per warp
    const T* x = logits + row * C;
    const int y = labels[row];
    const bool bad = y < 0 || y >= C;
    float mx = -INFINITY;
    for (int j = lane; j < C; j += 32) mx = fmaxf(mx, to_f(x[j]));
    mx = warp_max(mx);
    float se = 0.f, sx = 0.f;
    for (int j = lane; j < C; j += 32) {
      const float v = to_f(x[j]);
      se += expf(v - mx);
      sx += v;
    }
    se = warp_sum(se);
    sx = warp_sum(sx);
    const float lse = mx + logf(se);
    if (lane == 0) losses[row] = bad ? NAN : lse - (1.f - eps) * to_f(x[y]) - eps / float(C) * sx;
    if (dlogits) {
      T* d = dlogits + row * C;
      const float inv = 1.f / se;
      for (int j = lane; j < C; j += 32) {
        const float p = expf(to_f(x[j]) - mx) * inv;
        const float t = eps / float(C) + (j == y ? 1.f - eps : 0.f);
        d[j] = from_f<T>(bad ? NAN : grad_scale * (p - t));
      }
    }
  }
}

// Same, one block per row (grid N).
template <typename T>
__global__ void xent_block_k(const T* logits, int C, const int32_t* labels, float eps,
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
    const T* x = static_cast<const T*>(logits);
    T* d = static_cast<T*>(dlogits);
    if (C <= kThreadRowC)
      xent_thread_k<T, kThreadRowC><<<grid_waves(N), kThreads, 0, s>>>(
          x, N, C, labels, label_smoothing, grad_scale, losses, d);
    else if (C <= kWarpRowC)
      xent_warp_k<T><<<grid_waves(int64_t(N) * 32), kThreads, 0, s>>>(
          x, N, C, labels, label_smoothing, grad_scale, losses, d);
    else
      xent_block_k<T><<<N, kThreads, 0, s>>>(x, C, labels, label_smoothing, grad_scale, losses, d);
  });
}

}  // namespace dtrain::cuda_kernels

// Vocabulary-parallel cross-entropy kernels (backend.h, "vocabulary-parallel cross-entropy"):
// one block per row. Sums and maxima are block tree reductions in f32, the row's
// exp-sum in double (as the CPU's).
#include <cmath>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/gpt_kernels.h"
#include "core/targets.h"

namespace dtrain::cuda_kernels {

namespace {

template <typename T>
__global__ void vocab_max_k(const T* z, int64_t Vl, int64_t valid, float* mx) {
  __shared__ float sh[kThreads];
  const T* x = z + int64_t(blockIdx.x) * Vl;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < valid; c += blockDim.x) m = fmaxf(m, to_f(x[c]));
  sh[threadIdx.x] = m;
  __syncthreads();
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + st]);
    __syncthreads();
  }
  if (threadIdx.x == 0) mx[blockIdx.x] = sh[0];
}

template <typename T>
__global__ void vocab_parts_k(const T* z, int64_t Vl, int64_t valid, const int32_t* labels, int64_t offset,
                              int64_t classes, const float* gmax, float* parts) {
  __shared__ double sh[kThreads];
  const int64_t row = blockIdx.x;
  const T* x = z + row * Vl;
  const float m = gmax[row];
  double s = 0;
  for (int64_t c = threadIdx.x; c < valid; c += blockDim.x) s += double(expf(to_f(x[c]) - m));
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st) sh[threadIdx.x] += sh[threadIdx.x + st];
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  const int32_t lab = labels[row];
  const int64_t y = int64_t(lab) - offset;
  parts[2 * row] = float(sh[0]);
  const bool bad = (lab < 0 || lab >= classes) && lab != kIgnoreTarget;
  parts[2 * row + 1] = bad ? NAN : (y >= 0 && y < valid ? to_f(x[y]) : 0.f);
}

template <typename T>
__global__ void vocab_finish_k(const T* z, int64_t Vl, int64_t valid, const int32_t* labels, int64_t offset,
                               const float* gmax, const float* sums, float grad_scale, float* losses, T* dz) {
  const int64_t row = blockIdx.x;
  const float m = gmax[row], se = sums[2 * row], target = sums[2 * row + 1];
  const bool ignored = labels[row] == kIgnoreTarget;  // not a target: no loss, no gradient
  if (threadIdx.x == 0 && losses) losses[row] = ignored ? 0.f : float(double(m) + log(double(se)) - double(target));
  if (!dz) return;
  const T* x = z + row * Vl;
  T* d = dz + row * Vl;
  const float inv = float(1.0 / double(se));
  const int64_t y = int64_t(labels[row]) - offset;
  const bool bad = isnan(target);
  for (int64_t c = threadIdx.x; c < Vl; c += blockDim.x) {
    float g = 0.f;
    if (c < valid && !ignored) g = bad ? NAN : grad_scale * (expf(to_f(x[c]) - m) * inv - (c == y ? 1.f : 0.f));
    d[c] = from_f<T>(g);
  }
}

}  // namespace

void vocab_xent_max(const void* logits, DType t, int64_t N, int64_t Vl, int64_t valid, float* mx, cudaStream_t s) {
  if (N == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    vocab_max_k<T><<<unsigned(N), kThreads, 0, s>>>(static_cast<const T*>(logits), Vl, valid, mx);
  });
}

void vocab_xent_parts(const void* logits, DType t, int64_t N, int64_t Vl, int64_t valid, const int32_t* labels,
                      int64_t offset, int64_t classes, const float* gmax, float* parts, cudaStream_t s) {
  if (N == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    vocab_parts_k<T><<<unsigned(N), kThreads, 0, s>>>(static_cast<const T*>(logits), Vl, valid, labels, offset,
                                                      classes, gmax, parts);
  });
}

void vocab_xent_finish(const void* logits, DType t, int64_t N, int64_t Vl, int64_t valid, const int32_t* labels,
                       int64_t offset, const float* gmax, const float* sums, float grad_scale, float* losses,
                       void* dlogits, cudaStream_t s) {
  if (N == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    vocab_finish_k<T><<<unsigned(N), kThreads, 0, s>>>(static_cast<const T*>(logits), Vl, valid, labels, offset,
                                                       gmax, sums, grad_scale, losses, static_cast<T*>(dlogits));
  });
}

}  // namespace dtrain::cuda_kernels

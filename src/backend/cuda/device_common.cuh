#pragma once
// Device-side helpers shared by the .cu files: f32 load/store for every float storage
// dtype, dtype dispatch, launch sizing and a deterministic block reduction.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace dtrain::cuda_kernels {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

// The coordinates of flat index i of an [N,H,W,C] tensor.
struct NhwcIdx {
  int n, h, w, c;
};
__device__ __forceinline__ NhwcIdx nhwc_index(int64_t i, int H, int W, int C) {
  const int64_t r = i / C, rw = r / W;
  return {int(rw / H), int(rw % H), int(r % W), int(i % C)};
}

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// Runtime-dtype access, for small per-channel parameter vectors.
__device__ __forceinline__ float load_any(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::BF16: return to_f(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::F16: return to_f(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store_any(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::BF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case DType::F16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// Calls f(T{}) with T the storage type of float dtype t.
template <typename F>
inline void dispatch_float(DType t, F&& f) {
  switch (t) {
    case DType::BF16: f(__nv_bfloat16{}); break;
    case DType::F16: f(__half{}); break;
    default: f(float{}); break;
  }
}

constexpr int kThreads = 256;
inline unsigned grid_for(int64_t n, int threads = kThreads) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > 65535LL * 16) b = 65535LL * 16;  // grid-stride loops cover the rest
  return unsigned(b);
}

// Grid for a grid-stride loop over n items: one item per thread up to a few waves of
// an H100 (132 SMs x 8 blocks of 256), then each thread takes several items.
constexpr int64_t kMaxStreamBlocks = 4096;
inline unsigned grid_waves(int64_t n, int threads = kThreads) {
  int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 1 ? 1 : (b > kMaxStreamBlocks ? kMaxStreamBlocks : b));
}

// Row chunks of a two-pass column reduction over x [M, cols] (pass 1: one block per
// (column tile, row chunk)): about target_blocks blocks, at least 64 rows a chunk, at most
// 1024 chunks. A function of (M, cols) only, so results are reproducible.
inline int reduction_row_chunks(int64_t M, int64_t cols, int64_t col_tile, int64_t target_blocks) {
  const int64_t tiles = (cols + col_tile - 1) / col_tile;
  const int64_t want = (target_blocks + tiles - 1) / tiles;
  const int64_t by_rows = (M + 63) / 64;
  int64_t c = want < by_rows ? want : by_rows;
  if (c > 1024) c = 1024;
  return int(c < 1 ? 1 : c);
}

// ---- 16-byte vector access ----
// V consecutive T as one aligned load/store; kVec<T> elements make 16 bytes (8 bf16/f16,
// 4 f32). Callers check is_aligned() on every pointer and use V = 1 otherwise.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <typename T>
constexpr int kVec = int(16 / sizeof(T));

inline bool is_aligned(const void* p, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

template <int V, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[V]) {
  const Pack<T, V> k = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = to_f(k.v[j]);
}
template <int V, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[V]) {
  Pack<T, V> k;
#pragma unroll
  for (int j = 0; j < V; ++j) k.v[j] = from_f<T>(in[j]);
  *reinterpret_cast<Pack<T, V>*>(p) = k;
}

#define DTRAIN_GRID_STRIDE(i, n)                                                      \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);           \
       i += int64_t(gridDim.x) * blockDim.x)

// The same with index type I (uint32_t where the launcher knows n < 2^31: cheaper index
// division; i + stride cannot wrap).
#define DTRAIN_GRID_STRIDE_T(I, i, n)                                                  \
  for (I i = I(blockIdx.x) * blockDim.x + threadIdx.x; i < I(n);                      \
       i += I(gridDim.x) * blockDim.x)

// Sum of v over the block in a fixed order (deterministic). blockDim.x must be a power
// of two <= 1024; `sh` has blockDim.x entries. All threads receive the result.
template <typename A>
__device__ A block_sum(A v, A* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  A r = sh[0];
  __syncthreads();
  return r;
}
// Warp-wide sum / max by xor butterfly: every lane gets the same bits (a + b == b + a in
// IEEE arithmetic), and the order is fixed, so results are deterministic.
template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float block_max(float v, float* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  float r = sh[0];
  __syncthreads();
  return r;
}

}  // namespace dtrain::cuda_kernels

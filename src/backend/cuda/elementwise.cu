// Elementwise kernels, bias add, and the deterministic reductions (sum of squares,
// all-finite, column sums). Storage dtypes f32/bf16/f16; arithmetic in f32.
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"

namespace dtrain::cuda_kernels {
namespace {

template <typename T>
__global__ void fill_k(T* y, int64_t n, float v) {
  T tv = from_f<T>(v);
  DTRAIN_GRID_STRIDE(i, n) y[i] = tv;
}
template <typename TI, typename TO>
__global__ void cast_k(const TI* x, TO* y, int64_t n) {
  DTRAIN_GRID_STRIDE(i, n) y[i] = from_f<TO>(to_f(x[i]));
}
template <typename T>
__global__ void add_k(const T* a, const T* b, T* y, int64_t n) {
  DTRAIN_GRID_STRIDE(i, n) y[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}
// BLAS convention: beta == 0 does not read y.
template <typename T>
__global__ void axpby_k(float alpha, const T* x, float beta, T* y, int64_t n) {
  DTRAIN_GRID_STRIDE(i, n) {
    float r = alpha * to_f(x[i]);
    if (beta != 0.f) r += beta * to_f(y[i]);
    y[i] = from_f<T>(r);
  }
}
template <typename T>
__global__ void scale_k(T* y, int64_t n, float v) {
  DTRAIN_GRID_STRIDE(i, n) y[i] = from_f<T>(to_f(y[i]) * v);
}
// NaN propagates like torch.relu.
template <typename T>
__global__ void relu_fwd_k(const T* x, T* y, int64_t n) {
  DTRAIN_GRID_STRIDE(i, n) {
    float v = to_f(x[i]);
    y[i] = from_f<T>((v > 0.f || v != v) ? v : 0.f);
  }
}
template <typename T>
__global__ void relu_bwd_k(const T* y, const T* dy, T* dx, int64_t n) {
  DTRAIN_GRID_STRIDE(i, n) dx[i] = from_f<T>(to_f(y[i]) > 0.f ? to_f(dy[i]) : 0.f);
}
// y [M,N] += bias [N]
template <typename T>
__global__ void add_bias_k(T* y, const void* bias, DType tb, int64_t M, int64_t N) {
  DTRAIN_GRID_STRIDE(i, M * N) y[i] = from_f<T>(to_f(y[i]) + load_any(bias, tb, i % N));
}

// ---- sum of squares: fixed grid, double partials, one final block ----
template <typename T>
__global__ void sumsq_partial_k(const T* x, int64_t n, double* partials) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  DTRAIN_GRID_STRIDE(i, n) {
    double v = to_f(x[i]);
    acc += v * v;
  }
  double r = block_sum(acc, sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = r;
}
__global__ void sum_partials_k(const double* partials, int nparts, double* out) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) acc += partials[i];
  double r = block_sum(acc, sh);
  if (threadIdx.x == 0) *out = r;
}
template <typename T>
__global__ void all_finite_k(const T* x, int64_t n, int* flag) {
  DTRAIN_GRID_STRIDE(i, n) {
    float v = to_f(x[i]);
    if (!isfinite(v)) *flag = 1;  // benign race: every writer stores 1
  }
}

// ---- column sums: pass 1 block (32 cols x 8 row-lanes) per (column tile, row chunk) ----
// x [M,N]; partials [chunks, N] (float2 .x used); pass 2 one thread per column.
constexpr int kColTile = 32, kRowLanes = 8;
template <typename T>
__global__ void colsum_partial_k(const T* x, int64_t M, int64_t N, int64_t rows_per_chunk,
                                 float2* partials) {
  __shared__ float sh[kRowLanes][kColTile];
  int64_t c = int64_t(blockIdx.x) * kColTile + threadIdx.x;
  int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  int64_t r1 = min(M, r0 + rows_per_chunk);
  float acc = 0.f;
  if (c < N)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) acc += to_f(x[r * N + c]);
  sh[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < N) {
    float s = 0.f;
    for (int k = 0; k < kRowLanes; ++k) s += sh[k][threadIdx.x];
    partials[int64_t(blockIdx.y) * N + c] = make_float2(s, 0.f);
  }
}
template <typename TY>
__global__ void colsum_final_k(const float2* partials, int chunks, int64_t N, TY* y,
                               bool accumulate) {
  DTRAIN_GRID_STRIDE(c, N) {
    double s = 0.0;
    for (int k = 0; k < chunks; ++k) s += partials[int64_t(k) * N + c].x;
    float r = float(s);
    if (accumulate) r += to_f(y[c]);
    y[c] = from_f<TY>(r);
  }
}

}  // namespace

void fill(void* y, DType t, int64_t n, float v, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    fill_k<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<T*>(y), n, v);
  });
}
void cast(const void* x, DType tx, void* y, DType ty, int64_t n, cudaStream_t s) {
  dispatch_float(tx, [&](auto ti) {
    dispatch_float(ty, [&](auto to) {
      using TI = decltype(ti);
      using TO = decltype(to);
      cast_k<TI, TO><<<grid_for(n), kThreads, 0, s>>>(static_cast<const TI*>(x),
                                                     static_cast<TO*>(y), n);
    });
  });
}
void add(const void* a, const void* b, void* y, DType t, int64_t n, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    add_k<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                             static_cast<T*>(y), n);
  });
}
void axpby(float alpha, const void* x, float beta, void* y, DType t, int64_t n, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    axpby_k<T><<<grid_for(n), kThreads, 0, s>>>(alpha, static_cast<const T*>(x), beta,
                                               static_cast<T*>(y), n);
  });
}
void scale(void* y, DType t, int64_t n, float v, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    scale_k<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<T*>(y), n, v);
  });
}
void relu_fwd(const void* x, void* y, DType t, int64_t n, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    relu_fwd_k<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y), n);
  });
}
void relu_bwd(const void* y, const void* dy, void* dx, DType t, int64_t n, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    relu_bwd_k<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(y),
                                                  static_cast<const T*>(dy), static_cast<T*>(dx), n);
  });
}
void add_bias(void* y, DType ty, const void* bias, DType tb, int64_t M, int64_t N, cudaStream_t s) {
  dispatch_float(ty, [&](auto tag) {
    using T = decltype(tag);
    add_bias_k<T><<<grid_for(M * N), kThreads, 0, s>>>(static_cast<T*>(y), bias, tb, M, N);
  });
}

void sum_squares(const void* x, DType t, int64_t n, double* partials, double* out, cudaStream_t s) {
  int blocks = int(grid_for(n));
  if (blocks > kReduceBlocks) blocks = kReduceBlocks;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    sumsq_partial_k<T><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), n, partials);
  });
  sum_partials_k<<<1, kThreads, 0, s>>>(partials, blocks, out);
}
void all_finite(const void* x, DType t, int64_t n, int* flag, cudaStream_t s) {
  cudaMemsetAsync(flag, 0, sizeof(int), s);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    all_finite_k<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(x), n, flag);
  });
}

// Number of row chunks: a function of (M, N) only, so results are reproducible.
int colsum_chunks(int64_t M, int64_t N) {
  int64_t tiles = (N + kColTile - 1) / kColTile;
  int64_t want = (2048 + tiles - 1) / tiles;            // ~2048 blocks in pass 1
  int64_t by_rows = (M + 63) / 64;                      // at least 64 rows per chunk
  int64_t c = want < by_rows ? want : by_rows;
  if (c > 1024) c = 1024;
  return int(c < 1 ? 1 : c);
}
size_t colsum_scratch_bytes(int64_t M, int64_t N) {
  return size_t(colsum_chunks(M, N)) * size_t(N) * sizeof(float2);
}
void sum_rows(const void* x, DType tx, int64_t M, int64_t N, void* y, DType ty, bool accumulate,
              void* scratch, cudaStream_t s) {
  int chunks = colsum_chunks(M, N);
  int64_t rows = (M + chunks - 1) / chunks;
  float2* partials = static_cast<float2*>(scratch);
  dim3 grid(unsigned((N + kColTile - 1) / kColTile), unsigned(chunks));
  dispatch_float(tx, [&](auto tag) {
    using T = decltype(tag);
    colsum_partial_k<T><<<grid, dim3(kColTile, kRowLanes), 0, s>>>(static_cast<const T*>(x), M, N,
                                                                 rows, partials);
  });
  dispatch_float(ty, [&](auto tag) {
    using T = decltype(tag);
    colsum_final_k<T><<<grid_for(N), kThreads, 0, s>>>(partials, chunks, N, static_cast<T*>(y),
                                                      accumulate);
  });
}

}  // namespace dtrain::cuda_kernels

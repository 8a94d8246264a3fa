// Elementwise kernels, bias add, and the deterministic reductions (sum of squares,
// all-finite, column sums). Storage dtypes f32/bf16/f16; arithmetic in f32.
#include <type_traits>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"

namespace dtrain::cuda_kernels {
namespace {

// ---- flat elementwise kernels over n elements ----
// 16-byte vectors (V = kVec<T>: 8 bf16/f16 or 4 f32 per access) when every pointer is
// 16-byte aligned, else V = 1. Vectors [0, n/V) by grid stride; the n % V tail elements
// go one each to the first threads of the grid. Outputs may alias inputs (each thread
// reads its elements before writing them). Arithmetic in f32.
template <typename T, int V>
__device__ __forceinline__ int64_t tail_index(int64_t n) {
  return n / V * V + int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}

// y = op()
template <typename T, int V, typename Op>
__global__ void map0_k(T* y, int64_t n, Op op) {
  DTRAIN_GRID_STRIDE(i, n / V) {
    float r[V];
#pragma unroll
    for (int j = 0; j < V; ++j) r[j] = op();
    store_vec<V>(y + i * V, r);
  }
  if (V > 1) {
    int64_t t = tail_index<T, V>(n);
    if (t < n) y[t] = from_f<T>(op());
  }
}
// y = op(x)
template <typename T, int V, typename Op>
__global__ void map1_k(const T* x, T* y, int64_t n, Op op) {
  DTRAIN_GRID_STRIDE(i, n / V) {
    float a[V];
    load_vec<V>(x + i * V, a);
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] = op(a[j]);
    store_vec<V>(y + i * V, a);
  }
  if (V > 1) {
    int64_t t = tail_index<T, V>(n);
    if (t < n) y[t] = from_f<T>(op(to_f(x[t])));
  }
}
// y = op(a, b)
template <typename T, int V, typename Op>
__global__ void map2_k(const T* a, const T* b, T* y, int64_t n, Op op) {
  DTRAIN_GRID_STRIDE(i, n / V) {
    float va[V], vb[V];
    load_vec<V>(a + i * V, va);
    load_vec<V>(b + i * V, vb);
#pragma unroll
    for (int j = 0; j < V; ++j) va[j] = op(va[j], vb[j]);
    store_vec<V>(y + i * V, va);
  }
  if (V > 1) {
    int64_t t = tail_index<T, V>(n);
    if (t < n) y[t] = from_f<T>(op(to_f(a[t]), to_f(b[t])));
  }
}
// y (TO) = x (TI) rounded; V elements per access (16 bytes on the wider side).
template <typename TI, typename TO, int V>
__global__ void cast_k(const TI* x, TO* y, int64_t n) {
  DTRAIN_GRID_STRIDE(i, n / V) {
    float a[V];
    load_vec<V>(x + i * V, a);
    store_vec<V>(y + i * V, a);
  }
  if (V > 1) {
    int64_t t = tail_index<TI, V>(n);
    if (t < n) y[t] = from_f<TO>(to_f(x[t]));
  }
}

struct ConstOp {
  float v;
  __device__ float operator()() const { return v; }
};
struct ScaleOp {
  float v;
  __device__ float operator()(float a) const { return a * v; }
};
struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
// BLAS convention: beta == 0 does not read y (AxOp), else AxpbyOp(x, y).
struct AxOp {
  float alpha;
  __device__ float operator()(float x) const { return alpha * x; }
};
struct AxpbyOp {
  float alpha, beta;
  __device__ float operator()(float x, float y) const {
    float r = alpha * x;
    r += beta * y;
    return r;
  }
};
// NaN propagates like torch.relu.
struct ReluOp {
  __device__ float operator()(float v) const { return (v > 0.f || v != v) ? v : 0.f; }
};
// dx = y > 0 ? dy : 0 (op(y, dy))
struct ReluBwdOp {
  __device__ float operator()(float y, float dy) const { return y > 0.f ? dy : 0.f; }
};

template <typename T, typename Op>
void launch_map0(void* y, int64_t n, Op op, cudaStream_t s) {
  T* yt = static_cast<T*>(y);
  constexpr int V = kVec<T>;
  if (is_aligned(y, 16))
    map0_k<T, V><<<grid_waves(n / V), kThreads, 0, s>>>(yt, n, op);
  else
    map0_k<T, 1><<<grid_waves(n), kThreads, 0, s>>>(yt, n, op);
}
template <typename T, typename Op>
void launch_map1(const void* x, void* y, int64_t n, Op op, cudaStream_t s) {
  const T* xt = static_cast<const T*>(x);
  T* yt = static_cast<T*>(y);
  constexpr int V = kVec<T>;
  if (is_aligned(x, 16) && is_aligned(y, 16))
    map1_k<T, V><<<grid_waves(n / V), kThreads, 0, s>>>(xt, yt, n, op);
  else
    map1_k<T, 1><<<grid_waves(n), kThreads, 0, s>>>(xt, yt, n, op);
}
template <typename T, typename Op>
void launch_map2(const void* a, const void* b, void* y, int64_t n, Op op, cudaStream_t s) {
  const T* at = static_cast<const T*>(a);
  const T* bt = static_cast<const T*>(b);
  T* yt = static_cast<T*>(y);
  constexpr int V = kVec<T>;
  if (is_aligned(a, 16) && is_aligned(b, 16) && is_aligned(y, 16))
    map2_k<T, V><<<grid_waves(n / V), kThreads, 0, s>>>(at, bt, yt, n, op);
  else
    map2_k<T, 1><<<grid_waves(n), kThreads, 0, s>>>(at, bt, yt, n, op);
}

// y [M,N] += bias [N], V consecutive elements per thread (N % V == 0, aligned); I is the
// index type (uint32_t when M*N/V fits: cheap division)
template <typename T, typename B, int V, typename I>
__global__ void add_bias_k(T* y, const B* bias, I groups, int gn) {
  DTRAIN_GRID_STRIDE_T(I, i, groups) {
    const int c0 = int(i % I(gn)) * V;
    float v[V];
    load_vec<V>(y + int64_t(i) * V, v);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] += to_f(bias[c0 + j]);
    store_vec<V>(y + int64_t(i) * V, v);
  }
}

// ---- sum of squares: fixed grid, double partials, one final block ----
template <typename T, bool kSquare>
__global__ void sumsq_partial_k(const T* x, int64_t n, double* partials) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  DTRAIN_GRID_STRIDE(i, n) {
    double v = to_f(x[i]);
    acc += kSquare ? v * v : v;
  }
  double r = block_sum(acc, sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = r;
}
// *out = (accumulate ? *out : 0) + scale * sum(partials)
__global__ void sum_partials_k(const double* partials, int nparts, double* out, double scale,
                               bool accumulate) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) acc += partials[i];
  double r = block_sum(acc, sh);
  if (threadIdx.x == 0) *out = accumulate ? *out + scale * r : scale * r;
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
  dispatch_float(t, [&](auto tag) { launch_map0<decltype(tag)>(y, n, ConstOp{v}, s); });
}
void cast(const void* x, DType tx, void* y, DType ty, int64_t n, cudaStream_t s) {
  dispatch_float(tx, [&](auto ti) {
    dispatch_float(ty, [&](auto to) {
      using TI = decltype(ti);
      using TO = decltype(to);
      constexpr int V = int(16 / (sizeof(TI) > sizeof(TO) ? sizeof(TI) : sizeof(TO)));
      const TI* xt = static_cast<const TI*>(x);
      TO* yt = static_cast<TO*>(y);
      if (is_aligned(x, sizeof(TI) * V) && is_aligned(y, sizeof(TO) * V))
        cast_k<TI, TO, V><<<grid_waves(n / V), kThreads, 0, s>>>(xt, yt, n);
      else
        cast_k<TI, TO, 1><<<grid_waves(n), kThreads, 0, s>>>(xt, yt, n);
    });
  });
}
void add(const void* a, const void* b, void* y, DType t, int64_t n, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) { launch_map2<decltype(tag)>(a, b, y, n, AddOp{}, s); });
}
void axpby(float alpha, const void* x, float beta, void* y, DType t, int64_t n, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    if (beta == 0.f)
      launch_map1<T>(x, y, n, AxOp{alpha}, s);
    else
      launch_map2<T>(x, y, y, n, AxpbyOp{alpha, beta}, s);
  });
}
void scale(void* y, DType t, int64_t n, float v, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) { launch_map1<decltype(tag)>(y, y, n, ScaleOp{v}, s); });
}
void relu_fwd(const void* x, void* y, DType t, int64_t n, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) { launch_map1<decltype(tag)>(x, y, n, ReluOp{}, s); });
}
void relu_bwd(const void* y, const void* dy, void* dx, DType t, int64_t n, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) { launch_map2<decltype(tag)>(y, dy, dx, n, ReluBwdOp{}, s); });
}
void add_bias(void* y, DType ty, const void* bias, DType tb, int64_t M, int64_t N, cudaStream_t s) {
  dispatch_float(ty, [&](auto tag) {
    using T = decltype(tag);
    dispatch_float(tb, [&](auto btag) {
      using B = decltype(btag);
      const B* b = static_cast<const B*>(bias);
      auto launch = [&](auto vtag) {
        constexpr int V = decltype(vtag)::value;
        const int64_t groups = M * N / V;
        if (groups < (int64_t(1) << 31))
          add_bias_k<T, B, V, uint32_t><<<grid_waves(groups), kThreads, 0, s>>>(
              static_cast<T*>(y), b, uint32_t(groups), int(N / V));
        else
          add_bias_k<T, B, V, int64_t><<<grid_waves(groups), kThreads, 0, s>>>(
              static_cast<T*>(y), b, groups, int(N / V));
      };
      if (N % kVec<T> == 0 && is_aligned(y, 16))
        launch(std::integral_constant<int, kVec<T>>{});
      else
        launch(std::integral_constant<int, 1>{});
    });
  });
}

void sum_squares(const void* x, DType t, int64_t n, double* partials, double* out, cudaStream_t s,
                 bool square, double scale, bool accumulate) {
  int blocks = int(grid_for(n));
  if (blocks > kReduceBlocks) blocks = kReduceBlocks;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    if (square)
      sumsq_partial_k<T, true><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), n, partials);
    else
      sumsq_partial_k<T, false><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), n, partials);
  });
  sum_partials_k<<<1, kThreads, 0, s>>>(partials, blocks, out, scale, accumulate);
}
void all_finite(const void* x, DType t, int64_t n, int* flag, cudaStream_t s) {
  cudaMemsetAsync(flag, 0, sizeof(int), s);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    all_finite_k<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(x), n, flag);
  });
}

// Row chunks of pass 1 (~2048 blocks of kColTile columns)
int colsum_chunks(int64_t M, int64_t N) { return reduction_row_chunks(M, N, kColTile, 2048); }
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

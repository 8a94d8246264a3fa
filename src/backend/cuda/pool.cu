// Pooling in NHWC. Backward passes are gathers (each input element collects from the
// output windows that cover it), so they are deterministic and need no atomics.
//   max: PyTorch semantics (padding is never the max, NaN wins, first max in scan order
//        receives the gradient); the forward records each window's winner in a u8
//        argmax, which is all the backward reads besides dy
//   avg: count_include_pad = true; divisor = window clipped to the padded input
#include <initializer_list>
#include <type_traits>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"

namespace dtrain::cuda_kernels {
namespace {

// Output windows covering input row h: oh in [lo, hi]
__device__ inline void covering(int h, int k, int s, int p, int O, int* lo, int* hi) {
  int a = h + p - k + 1;  // smallest window start (in padded coords) covering h is >= a
  *lo = a <= 0 ? 0 : (a + s - 1) / s;
  int b = (h + p) / s;
  *hi = b < O - 1 ? b : O - 1;
}

// Flat index i of [N, A, B, G] -> (n, a, b, cg); I is uint32_t when the total fits in
// 31 bits (cheap division), else int64_t.
template <typename I>
__device__ __forceinline__ void split_nabg(I i, int A, int B, int G, int* n, int* a, int* b,
                                           int* cg) {
  *cg = int(i % I(G));
  i /= I(G);
  *b = int(i % I(B));
  i /= I(B);
  *a = int(i % I(A));
  *n = int(i / I(A));
}

// V consecutive bytes (V = the pooling kernels' vector width: 1, 4 or 8) as one aligned
// load or store.
template <int V>
__device__ __forceinline__ void load_u8(const uint8_t* p, uint8_t (&out)[V]) {
  if constexpr (V == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    memcpy(out, &u, 8);
  } else if constexpr (V == 4) {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(p);
    memcpy(out, &u, 4);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = p[j];
  }
}
template <int V>
__device__ __forceinline__ void store_u8(uint8_t* p, const uint8_t (&in)[V]) {
  if constexpr (V == 8) {
    uint2 u;
    memcpy(&u, in, 8);
    *reinterpret_cast<uint2*>(p) = u;
  } else if constexpr (V == 4) {
    uint32_t u;
    memcpy(&u, in, 4);
    *reinterpret_cast<uint32_t*>(p) = u;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = in[j];
  }
}

// y [N,OH,OW,C] = window max of x [N,H,W,C]; one thread per (n, oh, ow, group of V
// channels). Scan order row-major from -inf; a cell wins when greater, or when NaN (the
// last NaN wins), as PyTorch and the CPU. argmax (may be null) gets the winner's offset in
// the unclipped window; before any win, the first valid cell's.
template <typename T, int V, typename I>
__global__ void maxpool_fwd_k(const T* x, T* y, uint8_t* argmax, PoolGeom g) {
  const int G = g.C / V;
  const I total = I(g.N) * g.OH * g.OW * G;
  DTRAIN_GRID_STRIDE_T(I, i, total) {
    int n, oh, ow, cg;
    split_nabg<I>(i, g.OH, g.OW, G, &n, &oh, &ow, &cg);
    const int h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
    const int ha = max(h0, 0), hb = min(h0 + g.kh, g.H);
    const int wa = max(w0, 0), wb = min(w0 + g.kw, g.W);
    float best[V];
    uint8_t arg[V];
#pragma unroll
    for (int j = 0; j < V; ++j) best[j] = -INFINITY, arg[j] = uint8_t((ha - h0) * g.kw + (wa - w0));
    for (int a = ha; a < hb; ++a)
      for (int b = wa; b < wb; ++b) {
        float v[V];
        load_vec<V>(x + ((int64_t(n) * g.H + a) * g.W + b) * g.C + cg * V, v);
        const uint8_t pos = uint8_t((a - h0) * g.kw + (b - w0));
#pragma unroll
        for (int j = 0; j < V; ++j)
          if (v[j] > best[j] || v[j] != v[j]) best[j] = v[j], arg[j] = pos;
      }
    const int64_t o = ((int64_t(n) * g.OH + oh) * g.OW + ow) * g.C + cg * V;
    store_vec<V>(y + o, best);
    if (argmax) store_u8<V>(argmax + o, arg);
  }
}

// dx [N,H,W,C] (+)= the gradient of the max pool, gather form, one thread per (n, h, w,
// group of V channels): input cell (h, w) sums dy over the covering windows whose argmax
// names it, in (oh, ow) order (as the CPU's scatter adds). Reads argmax (1 byte) per
// window and dy only where a window's max is here. With accumulate the sum is rounded to T
// (as a store would) and added to dx. Deterministic, no atomics.
template <typename T, int V, typename I>
__global__ void maxpool_bwd_k(const uint8_t* argmax, const T* dy, T* dx, PoolGeom g,
                              bool accumulate) {
  const int G = g.C / V;
  const I total = I(g.N) * g.H * g.W * G;
  DTRAIN_GRID_STRIDE_T(I, i, total) {
    int n, h, w, cg;
    split_nabg<I>(i, g.H, g.W, G, &n, &h, &w, &cg);
    const int c0 = cg * V;
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    int ohl, ohh, owl, owh;
    covering(h, g.kh, g.sh, g.ph, g.OH, &ohl, &ohh);
    covering(w, g.kw, g.sw, g.pw, g.OW, &owl, &owh);
    for (int oh = ohl; oh <= ohh; ++oh)
      for (int ow = owl; ow <= owh; ++ow) {
        const uint8_t mine = uint8_t((h - (oh * g.sh - g.ph)) * g.kw + (w - (ow * g.sw - g.pw)));
        const int64_t o = ((int64_t(n) * g.OH + oh) * g.OW + ow) * g.C + c0;
        uint8_t a[V];
        load_u8<V>(argmax + o, a);
        bool any = false;
#pragma unroll
        for (int j = 0; j < V; ++j) any |= a[j] == mine;
        if (!any) continue;
        float d[V];
        load_vec<V>(dy + o, d);
#pragma unroll
        for (int j = 0; j < V; ++j)
          if (a[j] == mine) acc[j] += d[j];
      }
    T* out = dx + ((int64_t(n) * g.H + h) * g.W + w) * g.C + c0;
    if (accumulate) {
      float prev[V];
      load_vec<V>(out, prev);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = prev[j] + to_f(from_f<T>(acc[j]));
    }
    store_vec<V>(out, acc);
  }
}

__device__ inline int avg_divisor(const PoolGeom& g, int oh, int ow) {
  int h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
  int h1 = min(h0 + g.kh, g.H + g.ph), w1 = min(w0 + g.kw, g.W + g.pw);
  return (h1 - h0) * (w1 - w0);
}

template <typename T>
__global__ void avgpool_fwd_k(const T* x, T* y, PoolGeom g) {
  int64_t total = int64_t(g.N) * g.OH * g.OW * g.C;
  DTRAIN_GRID_STRIDE(i, total) {
    const auto [n, oh, ow, c] = nhwc_index(i, g.OH, g.OW, g.C);
    int h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
    float acc = 0.f;
    for (int a = max(h0, 0); a < min(h0 + g.kh, g.H); ++a)
      for (int b = max(w0, 0); b < min(w0 + g.kw, g.W); ++b)
        acc += to_f(x[((int64_t(n) * g.H + a) * g.W + b) * g.C + c]);
    y[i] = from_f<T>(acc / float(avg_divisor(g, oh, ow)));
  }
}

template <typename T>
__global__ void avgpool_bwd_k(const T* dy, T* dx, PoolGeom g) {
  int64_t total = int64_t(g.N) * g.H * g.W * g.C;
  DTRAIN_GRID_STRIDE(i, total) {
    const auto [n, h, w, c] = nhwc_index(i, g.H, g.W, g.C);
    int ohl, ohh, owl, owh;
    covering(h, g.kh, g.sh, g.ph, g.OH, &ohl, &ohh);
    covering(w, g.kw, g.sw, g.pw, g.OW, &owl, &owh);
    float acc = 0.f;
    for (int oh = ohl; oh <= ohh; ++oh)
      for (int ow = owl; ow <= owh; ++ow)
        acc += to_f(dy[((int64_t(n) * g.OH + oh) * g.OW + ow) * g.C + c]) /
               float(avg_divisor(g, oh, ow));
    dx[i] = from_f<T>(acc);
  }
}

// x [N,HW,C] -> y [N,C]: one thread per (n, c), fixed-order sum (coalesced over c)
template <typename T>
__global__ void gap_fwd_k(const T* x, T* y, int N, int HW, int C) {
  DTRAIN_GRID_STRIDE(i, int64_t(N) * C) {
    int64_t n = i / C, c = i % C;
    const T* p = x + n * HW * C + c;
    float acc = 0.f;
    for (int k = 0; k < HW; ++k) acc += to_f(p[int64_t(k) * C]);
    y[i] = from_f<T>(acc / float(HW));
  }
}
template <typename T>
__global__ void gap_bwd_k(const T* dy, T* dx, int N, int HW, int C) {
  float inv = 1.f / float(HW);
  DTRAIN_GRID_STRIDE(i, int64_t(N) * HW * C) {
    int64_t c = i % C, n = i / (int64_t(HW) * C);
    dx[i] = from_f<T>(to_f(dy[n * C + c]) * inv);
  }
}

}  // namespace

// Calls f(T, V, I, grid) for a max pooling kernel over `rows` NHWC rows: T the element type
// (a tag value), V = kVec<T> when C allows and every pointer is 16-byte aligned, else 1;
// I = uint32_t when the thread count fits in 31 bits; grid the blocks for rows * C / V.
template <typename F>
void pool_dispatch(DType t, const PoolGeom& g, int64_t rows,
                   std::initializer_list<const void*> ptrs, F&& f) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    bool vec = g.C % kVec<T> == 0;
    for (const void* p : ptrs) vec = vec && is_aligned(p, 16);
    const int V = vec ? kVec<T> : 1;
    const bool small = rows * (g.C / V) < (int64_t(1) << 31);
    auto with_i = [&](auto vtag) {
      const unsigned grid = grid_waves(rows * (g.C / decltype(vtag)::value));
      if (small)
        f(tag, vtag, uint32_t{}, grid);
      else
        f(tag, vtag, int64_t{}, grid);
    };
    if (vec)
      with_i(std::integral_constant<int, kVec<T>>{});
    else
      with_i(std::integral_constant<int, 1>{});
  });
}

void maxpool_fwd(const void* x, void* y, uint8_t* argmax, DType t, const PoolGeom& g,
                 cudaStream_t s) {
  pool_dispatch(t, g, int64_t(g.N) * g.OH * g.OW, {x, y, argmax},
                [&](auto tag, auto vtag, auto itag, unsigned grid) {
                  using T = decltype(tag);
                  maxpool_fwd_k<T, decltype(vtag)::value, decltype(itag)><<<grid, kThreads, 0, s>>>(
                      static_cast<const T*>(x), static_cast<T*>(y), argmax, g);
                });
}
void maxpool_bwd(const uint8_t* argmax, const void* dy, void* dx, DType t, const PoolGeom& g,
                 bool accumulate, cudaStream_t s) {
  pool_dispatch(t, g, int64_t(g.N) * g.H * g.W, {argmax, dy, dx},
                [&](auto tag, auto vtag, auto itag, unsigned grid) {
                  using T = decltype(tag);
                  maxpool_bwd_k<T, decltype(vtag)::value, decltype(itag)><<<grid, kThreads, 0, s>>>(
                      argmax, static_cast<const T*>(dy), static_cast<T*>(dx), g, accumulate);
                });
}
void avgpool_fwd(const void* x, void* y, DType t, const PoolGeom& g, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    avgpool_fwd_k<T><<<grid_for(int64_t(g.N) * g.OH * g.OW * g.C), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<T*>(y), g);
  });
}
void avgpool_bwd(const void* dy, void* dx, DType t, const PoolGeom& g, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    avgpool_bwd_k<T><<<grid_for(int64_t(g.N) * g.H * g.W * g.C), kThreads, 0, s>>>(
        static_cast<const T*>(dy), static_cast<T*>(dx), g);
  });
}
void global_avgpool_fwd(const void* x, void* y, DType t, int N, int HW, int C, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    gap_fwd_k<T><<<grid_for(int64_t(N) * C), kThreads, 0, s>>>(static_cast<const T*>(x),
                                                              static_cast<T*>(y), N, HW, C);
  });
}
void global_avgpool_bwd(const void* dy, void* dx, DType t, int N, int HW, int C, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    gap_bwd_k<T><<<grid_for(int64_t(N) * HW * C), kThreads, 0, s>>>(static_cast<const T*>(dy),
                                                                   static_cast<T*>(dx), N, HW, C);
  });
}

}  // namespace dtrain::cuda_kernels

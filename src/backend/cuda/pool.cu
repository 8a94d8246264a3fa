// Pooling in NHWC. Backward passes are gathers (each input element collects from the
// output windows that cover it), so they are deterministic and need no atomics.
//   max: PyTorch semantics (padding is never the max, NaN wins, first max in scan order
//        receives the gradient)
//   avg: count_include_pad = true; divisor = window clipped to the padded input
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"

namespace dtrain::cuda_kernels {
namespace {

// Index (h*W+w) of the max of window (oh, ow) at (n, c); -1 if the window has no valid cell.
template <typename T>
__device__ int window_argmax(const T* x, const PoolGeom& g, int n, int oh, int ow, int c,
                             float* best_out) {
  int h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
  float best = -INFINITY;
  int arg = -1;
  for (int i = 0; i < g.kh; ++i) {
    int h = h0 + i;
    if (h < 0 || h >= g.H) continue;
    for (int j = 0; j < g.kw; ++j) {
      int w = w0 + j;
      if (w < 0 || w >= g.W) continue;
      float v = to_f(x[((int64_t(n) * g.H + h) * g.W + w) * g.C + c]);
      if (arg < 0 || v > best || (v != v && best == best)) {
        best = v;
        arg = h * g.W + w;
      }
    }
  }
  *best_out = best;
  return arg;
}

// Output windows covering input row h: oh in [lo, hi]
__device__ inline void covering(int h, int k, int s, int p, int O, int* lo, int* hi) {
  int a = h + p - k + 1;  // smallest window start (in padded coords) covering h is >= a
  *lo = a <= 0 ? 0 : (a + s - 1) / s;
  int b = (h + p) / s;
  *hi = b < O - 1 ? b : O - 1;
}

template <typename T>
__global__ void maxpool_fwd_k(const T* x, T* y, PoolGeom g) {
  int64_t total = int64_t(g.N) * g.OH * g.OW * g.C;
  DTRAIN_GRID_STRIDE(i, total) {
    int c = int(i % g.C);
    int64_t r = i / g.C;
    int ow = int(r % g.OW);
    r /= g.OW;
    int oh = int(r % g.OH);
    int n = int(r / g.OH);
    float best;
    window_argmax(x, g, n, oh, ow, c, &best);
    y[i] = from_f<T>(best);
  }
}

template <typename T>
__global__ void maxpool_bwd_k(const T* x, const T* dy, T* dx, PoolGeom g) {
  int64_t total = int64_t(g.N) * g.H * g.W * g.C;
  DTRAIN_GRID_STRIDE(i, total) {
    int c = int(i % g.C);
    int64_t r = i / g.C;
    int w = int(r % g.W);
    r /= g.W;
    int h = int(r % g.H);
    int n = int(r / g.H);
    int ohl, ohh, owl, owh;
    covering(h, g.kh, g.sh, g.ph, g.OH, &ohl, &ohh);
    covering(w, g.kw, g.sw, g.pw, g.OW, &owl, &owh);
    float acc = 0.f;
    int self = h * g.W + w;
    for (int oh = ohl; oh <= ohh; ++oh)
      for (int ow = owl; ow <= owh; ++ow) {
        float best;
        if (window_argmax(x, g, n, oh, ow, c, &best) == self)
          acc += to_f(dy[((int64_t(n) * g.OH + oh) * g.OW + ow) * g.C + c]);
      }
    dx[i] = from_f<T>(acc);
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
    int c = int(i % g.C);
    int64_t r = i / g.C;
    int ow = int(r % g.OW);
    r /= g.OW;
    int oh = int(r % g.OH);
    int n = int(r / g.OH);
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
    int c = int(i % g.C);
    int64_t r = i / g.C;
    int w = int(r % g.W);
    r /= g.W;
    int h = int(r % g.H);
    int n = int(r / g.H);
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

void maxpool_fwd(const void* x, void* y, DType t, const PoolGeom& g, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    maxpool_fwd_k<T><<<grid_for(int64_t(g.N) * g.OH * g.OW * g.C), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<T*>(y), g);
  });
}
void maxpool_bwd(const void* x, const void* dy, void* dx, DType t, const PoolGeom& g,
                 cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    maxpool_bwd_k<T><<<grid_for(int64_t(g.N) * g.H * g.W * g.C), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), g);
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

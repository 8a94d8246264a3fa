// The mixture-of-experts kernels (moe_kernels.h): the router's softmax and top-k (a thread per
// token), its dispatch plan (a thread per expert scanning the slots in order, so the groups and
// the column sums come out in the CPU's order), its backward (a thread per token), and the
// gathers and weighted sums around the experts (a thread per element, the slots of a token summed
// in order).
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/moe_kernels.h"

namespace dtrain::cuda_kernels {
namespace {

template <typename T>
__global__ void route_rows_k(const T* logits, int64_t N, int64_t E, int k, bool norm_topk, float* probs, float* lse,
                             int32_t* sel, float* weights) {
  DTRAIN_GRID_STRIDE(n, N) {
    const T* z = logits + n * E;
    float* p = probs + n * E;
    float mx = to_f(z[0]);
    for (int64_t e = 1; e < E; ++e) mx = fmaxf(mx, to_f(z[e]));
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = expf(to_f(z[e]) - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    lse[n] = mx + logf(sum);
    int32_t* s = sel + n * k;
    float* w = weights + n * k;
    float wsum = 0.f;
    for (int j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken = taken || s[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      s[j] = int32_t(best);
      w[j] = p[best];
      wsum += w[j];
    }
    if (norm_topk)
      for (int j = 0; j < k; ++j) w[j] /= wsum;
  }
}

// one thread per expert: its count, its column sum of probs (double, in token order)
__global__ void route_count_k(const float* probs, const int32_t* sel, int64_t N, int64_t E, int k, int32_t* counts,
                              float* stats, const float* lse) {
  DTRAIN_GRID_STRIDE(e, E + 1) {
    if (e == E) {  // the z-loss' sum
      double zz = 0;
      for (int64_t n = 0; n < N; ++n) zz += double(lse[n]) * double(lse[n]);
      stats[E] = float(zz);
      continue;
    }
    int32_t c = 0;
    for (int64_t s = 0; s < N * k; ++s) c += sel[s] == e;
    counts[e] = c;
    double ps = 0;
    for (int64_t n = 0; n < N; ++n) ps += double(probs[n * E + e]);
    stats[e] = float(ps);
  }
}

// one thread per expert: its group of `order` (after the groups before it) and the slots' pos
__global__ void route_order_k(const int32_t* sel, const int32_t* counts, int64_t N, int64_t E, int k, int64_t capacity,
                              int32_t* order, int32_t* pos) {
  DTRAIN_GRID_STRIDE(e, E) {
    int64_t at = 0;
    for (int64_t i = 0; i < e; ++i) at += counts[i];
    const int64_t start = at;
    for (int64_t s = 0; s < N * k; ++s) {
      if (sel[s] != e) continue;
      order[at] = int32_t(s);
      const bool kept = capacity <= 0 || at - start < capacity;
      pos[s] = kept ? int32_t(at) : int32_t(-(at + 1));
      ++at;
    }
  }
}

template <typename T>
__global__ void route_bwd_k(const float* probs, const float* lse, const int32_t* sel, const float* weights,
                            const float* dweights, const float* paux, float zscale, bool norm_topk, int64_t N,
                            int64_t E, int k, float* scratch, T* dlogits) {
  DTRAIN_GRID_STRIDE(n, N) {
    const float* p = probs + n * E;
    const int32_t* s = sel + n * k;
    const float* w = weights + n * k;
    const float* dw = dweights + n * k;
    float* d = scratch + n * E;
    for (int64_t e = 0; e < E; ++e) d[e] = paux ? paux[e] : 0.f;
    if (norm_topk) {
      float S = 0.f, dot = 0.f;
      for (int j = 0; j < k; ++j) S += p[s[j]];
      for (int j = 0; j < k; ++j) dot += dw[j] * w[j];
      for (int j = 0; j < k; ++j) d[s[j]] += (dw[j] - dot) / S;
    } else {
      for (int j = 0; j < k; ++j) d[s[j]] += dw[j];
    }
    const float zl = zscale * 2.f * lse[n];
    float dot = 0.f;
    for (int64_t e = 0; e < E; ++e) dot += p[e] * d[e];
    for (int64_t e = 0; e < E; ++e) dlogits[n * E + e] = from_f<T>(p[e] * (d[e] - dot) + zl * p[e]);
  }
}

template <typename T>
__global__ void gather_k(const T* x, const int32_t* order, int k, int64_t M, int64_t C, T* y) {
  DTRAIN_GRID_STRIDE(i, M * C) {
    const int64_t r = i / C, c = i % C;
    y[i] = x[int64_t(order[r] / k) * C + c];
  }
}

template <typename T>
__global__ void combine_k(const T* ye, const int32_t* pos, const float* weights, int k, int64_t N, int64_t C, T* y,
                          bool accumulate) {
  DTRAIN_GRID_STRIDE(i, N * C) {
    const int64_t n = i / C, c = i % C;
    float v = 0.f;
    for (int j = 0; j < k; ++j) {
      const int32_t p = pos[n * k + j];
      if (p < 0) continue;
      v += (weights ? weights[n * k + j] : 1.f) * to_f(ye[int64_t(p) * C + c]);
    }
    y[i] = accumulate ? from_f<T>(to_f(from_f<T>(v)) + to_f(y[i])) : from_f<T>(v);
  }
}

template <typename T>
__global__ void combine_bwd_dye_k(const T* dy, const int32_t* pos, const float* weights, int k, int64_t N, int64_t C,
                                  T* dye) {
  DTRAIN_GRID_STRIDE(i, N * k * C) {
    const int64_t s = i / C, c = i % C;
    const int32_t p = pos[s];
    dye[int64_t(p >= 0 ? p : -p - 1) * C + c] = from_f<T>(p >= 0 ? weights[s] * to_f(dy[(s / k) * C + c]) : 0.f);
  }
}

// a warp per slot: dweights = dot(dy row, ye row)
template <typename T>
__global__ void combine_bwd_dw_k(const T* dy, const T* ye, const int32_t* pos, int k, int64_t N, int64_t C,
                                 float* dweights) {
  const int lane = threadIdx.x & 31;
  const int64_t s = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (s >= N * k) return;
  const int32_t p = pos[s];
  float v = 0.f;
  if (p >= 0)
    for (int64_t c = lane; c < C; c += 32) v += to_f(dy[(s / k) * C + c]) * to_f(ye[int64_t(p) * C + c]);
  v = warp_sum(v);
  if (lane == 0) dweights[s] = v;
}

}  // namespace

void moe_route_fwd(const void* logits, DType t, int64_t N, int64_t E, int k, bool norm_topk, int64_t capacity,
                   float* probs, float* lse, int32_t* sel, float* weights, int32_t* counts, int32_t* order,
                   int32_t* pos, float* stats, cudaStream_t s) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    if (N > 0)
      route_rows_k<T><<<grid_for(N), kThreads, 0, s>>>(static_cast<const T*>(logits), N, E, k, norm_topk, probs, lse,
                                                       sel, weights);
  });
  route_count_k<<<grid_for(E + 1, 64), 64, 0, s>>>(probs, sel, N, E, k, counts, stats, lse);
  route_order_k<<<grid_for(E, 64), 64, 0, s>>>(sel, counts, N, E, k, capacity, order, pos);
}

void moe_route_bwd(const float* probs, const float* lse, const int32_t* sel, const float* weights,
                   const float* dweights, const float* paux, float zscale, bool norm_topk, int64_t N, int64_t E, int k,
                   void* dlogits, DType t, cudaStream_t s, float* scratch) {
  if (N == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    route_bwd_k<T><<<grid_for(N), kThreads, 0, s>>>(probs, lse, sel, weights, dweights, paux, zscale, norm_topk, N, E,
                                                    k, scratch, static_cast<T*>(dlogits));
  });
}

void moe_gather(const void* x, const int32_t* order, int k, int64_t M, int64_t C, void* y, DType t, cudaStream_t s) {
  if (M * C == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    gather_k<T><<<grid_for(M * C), kThreads, 0, s>>>(static_cast<const T*>(x), order, k, M, C, static_cast<T*>(y));
  });
}

void moe_combine(const void* ye, const int32_t* pos, const float* weights, int k, int64_t N, int64_t C, void* y,
                 bool accumulate, DType t, cudaStream_t s) {
  if (N * C == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    combine_k<T><<<grid_for(N * C), kThreads, 0, s>>>(static_cast<const T*>(ye), pos, weights, k, N, C,
                                                      static_cast<T*>(y), accumulate);
  });
}

void moe_combine_bwd(const void* dy, const void* ye, const int32_t* pos, const float* weights, int k, int64_t N,
                     int64_t C, void* dye, float* dweights, DType t, cudaStream_t s) {
  if (N * k == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    combine_bwd_dye_k<T><<<grid_for(N * k * C), kThreads, 0, s>>>(static_cast<const T*>(dy), pos, weights, k, N, C,
                                                                  static_cast<T*>(dye));
    const unsigned blocks = unsigned((N * k + kThreads / 32 - 1) / (kThreads / 32));
    combine_bwd_dw_k<T><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(dy), static_cast<const T*>(ye), pos, k, N, C,
                                                    dweights);
  });
}

}  // namespace dtrain::cuda_kernels

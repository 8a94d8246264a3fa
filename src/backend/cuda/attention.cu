// Attention's kernels besides flash attention (flash_attn.cu): the causal softmax, forward and
// backward, around the cuBLASLt GEMMs of attention.cpp's probabilities path, and one decoding
// step against a K/V cache (multi-head or grouped-query). Deterministic: block reductions in a
// fixed tree order (device_common.cuh).
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/gpt_kernels.h"

namespace dtrain::cuda_kernels {
namespace {

// ---- causal softmax over rows of [R, T] = [B, H, T, T]; row r is query position t = r % T of
// sample b = r / (H T); with docpos (i32 [B,T], packed documents) its keys start at t - docpos[b,t]
__device__ __forceinline__ int64_t softmax_first(const int32_t* docpos, int64_t r, int64_t T_, int64_t H) {
  return docpos ? r % T_ - docpos[r / (H * T_) * T_ + r % T_] : 0;
}

template <typename T>
__global__ void causal_softmax_k(T* p, const int32_t* docpos, int64_t T_, int64_t H, float scale) {
  __shared__ float sh[kThreads];
  const int64_t r = blockIdx.x, t = r % T_, lo = softmax_first(docpos, r, T_, H);
  T* row = p + r * T_;
  float mx = -INFINITY;
  for (int64_t j = lo + threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, scale * to_f(row[j]));
  mx = block_max(mx, sh);
  float se = 0.f;
  for (int64_t j = lo + threadIdx.x; j <= t; j += blockDim.x) se += expf(scale * to_f(row[j]) - mx);
  const float inv = 1.f / block_sum(se, sh);
  for (int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    row[j] = from_f<T>(j >= lo && j <= t ? expf(scale * to_f(row[j]) - mx) * inv : 0.f);
}

template <typename T>
__global__ void causal_softmax_bwd_k(const T* p, T* dp, const int32_t* docpos, int64_t T_, int64_t H, float scale) {
  __shared__ float sh[kThreads];
  const int64_t r = blockIdx.x, t = r % T_, lo = softmax_first(docpos, r, T_, H);
  const T* pr = p + r * T_;
  T* dr = dp + r * T_;
  float s = 0.f;
  for (int64_t j = lo + threadIdx.x; j <= t; j += blockDim.x) s += to_f(pr[j]) * to_f(dr[j]);
  const float dot = block_sum(s, sh);
  for (int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    dr[j] = from_f<T>(j >= lo && j <= t ? to_f(pr[j]) * (to_f(dr[j]) - dot) * scale : 0.f);
}

// ---- one decoding step of attention against a K/V cache: one block per (b, query head h) ----
// qkv rows [q (H heads) | k (Hkv) | v (Hkv)] of hs values; query head h reads key/value head
// kv = h / (H / Hkv). The new position's key and value are read from qkv (every block of the
// group needs them) and stored into the caches by the group's first block only.
template <typename T>
__global__ void attn_decode_k(const T* qkv, T* kc, T* vc, T* out, int64_t H, int64_t Hkv,
                              int64_t hs, int64_t Tmax, int64_t pos, float scale) {
  extern __shared__ float sp[];  // pos + 1 scores
  __shared__ float sh[kThreads];
  const int64_t b = blockIdx.x / H, h = blockIdx.x % H, kv = h / (H / Hkv);
  const int64_t C = H * hs, W = (H + 2 * Hkv) * hs;
  const T* q = qkv + b * W + h * hs;
  const T* knew = qkv + b * W + C + kv * hs;
  const T* vnew = knew + Hkv * hs;
  T* K = kc + (b * Hkv + kv) * Tmax * hs;
  T* V = vc + (b * Hkv + kv) * Tmax * hs;
  if (h % (H / Hkv) == 0)
    for (int64_t j = threadIdx.x; j < hs; j += blockDim.x) {
      K[pos * hs + j] = knew[j];
      V[pos * hs + j] = vnew[j];
    }
  float mx = -INFINITY;
  for (int64_t t = threadIdx.x; t <= pos; t += blockDim.x) {
    const T* kr = t == pos ? knew : K + t * hs;
    float d = 0.f;
    for (int64_t j = 0; j < hs; ++j) d += to_f(q[j]) * to_f(kr[j]);
    sp[t] = d * scale;
    mx = fmaxf(mx, sp[t]);
  }
  mx = block_max(mx, sh);
  float se = 0.f;
  for (int64_t t = threadIdx.x; t <= pos; t += blockDim.x) {
    sp[t] = expf(sp[t] - mx);
    se += sp[t];
  }
  const float inv = 1.f / block_sum(se, sh);
  for (int64_t j = threadIdx.x; j < hs; j += blockDim.x) {
    float acc = 0.f;
    for (int64_t t = 0; t <= pos; ++t) acc += sp[t] * inv * to_f(t == pos ? vnew[j] : V[t * hs + j]);
    out[b * C + h * hs + j] = from_f<T>(acc);
  }
}

}  // namespace

void causal_softmax(void* p, const int32_t* docpos, DType t, int64_t R, int64_t T_, int64_t H, float scale,
                    cudaStream_t s) {
  if (R == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    causal_softmax_k<T><<<unsigned(R), kThreads, 0, s>>>(static_cast<T*>(p), docpos, T_, H, scale);
  });
}
void causal_softmax_bwd(const void* p, void* dp, const int32_t* docpos, DType t, int64_t R, int64_t T_, int64_t H,
                        float scale, cudaStream_t s) {
  if (R == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    causal_softmax_bwd_k<T><<<unsigned(R), kThreads, 0, s>>>(static_cast<const T*>(p),
                                                             static_cast<T*>(dp), docpos, T_, H, scale);
  });
}

void attention_decode(const void* qkv, void* kcache, void* vcache, void* out, DType t, int64_t B,
                      int64_t H, int64_t Hkv, int64_t hs, int64_t Tmax, int64_t pos, cudaStream_t s) {
  if (B == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    attn_decode_k<T><<<unsigned(B * H), kThreads, size_t(pos + 1) * sizeof(float), s>>>(
        static_cast<const T*>(qkv), static_cast<T*>(kcache), static_cast<T*>(vcache),
        static_cast<T*>(out), H, Hkv, hs, Tmax, pos, 1.f / sqrtf(float(hs)));
  });
}

}  // namespace dtrain::cuda_kernels

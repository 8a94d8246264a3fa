// GPT kernels: layer norm, GELU (tanh), token+position embedding, causal softmax (forward
// and backward, for the cuBLASLt-based attention in gpt_ops.cpp), masked cross-entropy.
// Deterministic: block reductions in a fixed tree order (device_common.cuh), column sums in
// two passes (per-chunk partials, then chunks summed in order), the embedding scatter as
// one block per vocabulary row scanning the positions in order. No float atomics.
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/gpt_kernels.h"

namespace dtrain::cuda_kernels {
namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)
constexpr int kColTile = 32, kRowLanes = 8, kLnRowsPerChunk = 64;

// ---- layer norm ----
// x, y [M,C]: one block per row.
template <typename T>
__global__ void ln_fwd_k(const T* x, int64_t C, const void* g, const void* b, DType tp, T* y,
                         float* mean, float* rstd, float eps) {
  __shared__ float sh[kThreads];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * C;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += to_f(xr[j]);
  const float mu = block_sum(s, sh) / float(C);
  float v = 0.f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    const float d = to_f(xr[j]) - mu;
    v += d * d;
  }
  const float rs = rsqrtf(block_sum(v, sh) / float(C) + eps);
  T* yr = y + row * C;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
    yr[j] = from_f<T>((to_f(xr[j]) - mu) * rs * load_any(g, tp, j) + load_any(b, tp, j));
  if (threadIdx.x == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}

// dx [M,C]: one block per row.
template <typename T>
__global__ void ln_bwd_dx_k(const T* dy, const T* x, int64_t C, const void* g, DType tp,
                            const float* mean, const float* rstd, T* dx) {
  __shared__ float sh[kThreads];
  const int64_t row = blockIdx.x;
  const T* gr = dy + row * C;
  const T* xr = x + row * C;
  const float mu = mean[row], rs = rstd[row];
  float s1 = 0.f, s2 = 0.f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    const float dn = to_f(gr[j]) * load_any(g, tp, j);
    s1 += dn;
    s2 += dn * (to_f(xr[j]) - mu) * rs;
  }
  const float a = block_sum(s1, sh) / float(C);
  const float b = block_sum(s2, sh) / float(C);
  T* o = dx + row * C;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    const float xh = (to_f(xr[j]) - mu) * rs;
    o[j] = from_f<T>(rs * (to_f(gr[j]) * load_any(g, tp, j) - a - xh * b));
  }
}

// partials[chunk*C + c] = (sum dy*xhat, sum dy) over the chunk's rows.
template <typename T>
__global__ void ln_bwd_partial_k(const T* dy, const T* x, int64_t M, int64_t C,
                                 const float* mean, const float* rstd, float2* partials) {
  __shared__ float sa[kRowLanes][kColTile];
  __shared__ float sb[kRowLanes][kColTile];
  const int64_t c = int64_t(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kLnRowsPerChunk;
  const int64_t r1 = min(M, r0 + kLnRowsPerChunk);
  float a = 0.f, b = 0.f;
  if (c < C) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      const float gv = to_f(dy[r * C + c]);
      a += gv * (to_f(x[r * C + c]) - mean[r]) * rstd[r];
      b += gv;
    }
  }
  sa[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float ta = 0.f, tb = 0.f;
    for (int k = 0; k < kRowLanes; ++k) {
      ta += sa[k][threadIdx.x];
      tb += sb[k][threadIdx.x];
    }
    partials[int64_t(blockIdx.y) * C + c] = make_float2(ta, tb);
  }
}

__global__ void ln_bwd_final_k(const float2* partials, int chunks, int64_t C, void* dgamma,
                               void* dbeta, DType tg, bool accumulate) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double a = 0, b = 0;
  for (int k = 0; k < chunks; ++k) {
    const float2 p = partials[int64_t(k) * C + c];
    a += p.x;
    b += p.y;
  }
  if (dgamma) store_any(dgamma, tg, c, float((accumulate ? load_any(dgamma, tg, c) : 0.f) + a));
  if (dbeta) store_any(dbeta, tg, c, float((accumulate ? load_any(dbeta, tg, c) : 0.f) + b));
}

// ---- GELU ----
template <typename T>
__global__ void gelu_fwd_k(const T* x, T* y, int64_t n) {
  DTRAIN_GRID_STRIDE(i, n) {
    const float v = to_f(x[i]);
    y[i] = from_f<T>(0.5f * v * (1.f + tanhf(kGeluC * (v + 0.044715f * v * v * v))));
  }
}
template <typename T>
__global__ void gelu_bwd_k(const T* x, const T* dy, T* dx, int64_t n) {
  DTRAIN_GRID_STRIDE(i, n) {
    const float v = to_f(x[i]);
    const float t = tanhf(kGeluC * (v + 0.044715f * v * v * v));
    const float du = kGeluC * (1.f + 3.f * 0.044715f * v * v);
    const float g = 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du;
    dx[i] = from_f<T>(to_f(dy[i]) * g);
  }
}

// ---- embedding ----
template <typename T>
__global__ void emb_fwd_k(const int32_t* ids, int64_t N, int64_t T_, const void* wte, int64_t V,
                          const void* wpe, DType tp, int64_t C, T* y) {
  DTRAIN_GRID_STRIDE(idx, N * C) {
    const int64_t i = idx / C, c = idx % C;
    const int32_t id = ids[i];
    const float a = (id >= 0 && id < V) ? load_any(wte, tp, int64_t(id) * C + c) : 0.f;
    y[idx] = from_f<T>(a + load_any(wpe, tp, (i % T_) * C + c));
  }
}

template <typename T>
__global__ void emb_bwd_wpe_k(const T* dy, int64_t B, int64_t T_, int64_t Tmax, int64_t C,
                              void* dwpe, DType tg, bool accumulate) {
  DTRAIN_GRID_STRIDE(idx, Tmax * C) {
    const int64_t t = idx / C, c = idx % C;
    float s = 0.f;
    if (t < T_)
      for (int64_t b = 0; b < B; ++b) s += to_f(dy[(b * T_ + t) * C + c]);
    store_any(dwpe, tg, idx, (accumulate ? load_any(dwpe, tg, idx) : 0.f) + s);
  }
}

__global__ void emb_mark_k(const int32_t* ids, int64_t N, int64_t V, int* flags) {
  DTRAIN_GRID_STRIDE(i, N) {
    const int32_t id = ids[i];
    if (id >= 0 && id < V) flags[id] = 1;  // plain stores of the same value: race-free result
  }
}

// One block per vocabulary row v; the row accumulates in shared memory (C floats), the
// positions are scanned in order in tiles of blockDim ids.
template <typename T>
__global__ void emb_bwd_wte_k(const T* dy, const int32_t* ids, int64_t N, int64_t C, void* dwte,
                              DType tg, bool accumulate, const int* flags) {
  extern __shared__ float acc[];
  __shared__ int tile[kThreads];
  const int64_t v = blockIdx.x;
  const int64_t base_out = v * C;
  if (!flags[v]) {  // uniform per block
    if (!accumulate)
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) store_any(dwte, tg, base_out + c, 0.f);
    return;
  }
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    acc[c] = accumulate ? load_any(dwte, tg, base_out + c) : 0.f;
  for (int64_t base = 0; base < N; base += blockDim.x) {
    __syncthreads();
    tile[threadIdx.x] = base + threadIdx.x < N ? ids[base + threadIdx.x] : -1;
    __syncthreads();
    const int64_t n = min(int64_t(blockDim.x), N - base);
    for (int64_t k = 0; k < n; ++k) {
      if (tile[k] != v) continue;
      const T* g = dy + (base + k) * C;
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) acc[c] += to_f(g[c]);
    }
  }
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) store_any(dwte, tg, base_out + c, acc[c]);
}

// ---- causal softmax over rows of [R, T]; row r is query position t = r % T ----
template <typename T>
__global__ void causal_softmax_k(T* p, int64_t T_, float scale) {
  __shared__ float sh[kThreads];
  const int64_t r = blockIdx.x, t = r % T_;
  T* row = p + r * T_;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, scale * to_f(row[j]));
  mx = block_max(mx, sh);
  float se = 0.f;
  for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) se += expf(scale * to_f(row[j]) - mx);
  const float inv = 1.f / block_sum(se, sh);
  for (int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    row[j] = from_f<T>(j <= t ? expf(scale * to_f(row[j]) - mx) * inv : 0.f);
}

template <typename T>
__global__ void causal_softmax_bwd_k(const T* p, T* dp, int64_t T_, float scale) {
  __shared__ float sh[kThreads];
  const int64_t r = blockIdx.x, t = r % T_;
  const T* pr = p + r * T_;
  T* dr = dp + r * T_;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) s += to_f(pr[j]) * to_f(dr[j]);
  const float dot = block_sum(s, sh);
  for (int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    dr[j] = from_f<T>(j <= t ? to_f(pr[j]) * (to_f(dr[j]) - dot) * scale : 0.f);
}

// ---- masked cross-entropy ----
template <typename T>
__global__ void xent_masked_k(const T* logits, int64_t Cp, int64_t V, const int32_t* labels,
                              float grad_scale, float* losses, T* dlogits) {
  __shared__ float sh[kThreads];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * Cp;
  const int32_t y = labels[row];
  const bool bad = y < 0 || y >= V;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, to_f(x[j]));
  mx = block_max(mx, sh);
  float se = 0.f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) se += expf(to_f(x[j]) - mx);
  se = block_sum(se, sh);
  if (threadIdx.x == 0 && losses) losses[row] = bad ? NAN : mx + logf(se) - to_f(x[y]);
  if (dlogits) {
    T* d = dlogits + row * Cp;
    const float inv = 1.f / se;
    for (int64_t j = threadIdx.x; j < Cp; j += blockDim.x) {
      float g = 0.f;
      if (j < V) g = bad ? NAN : grad_scale * (expf(to_f(x[j]) - mx) * inv - (j == y ? 1.f : 0.f));
      d[j] = from_f<T>(g);
    }
  }
}

int ln_chunks(int64_t M) { return int((M + kLnRowsPerChunk - 1) / kLnRowsPerChunk); }

// ---- one decoding step of attention against a K/V cache: one block per (b, h) ----
template <typename T>
__global__ void attn_decode_k(const T* qkv, T* kc, T* vc, T* out, int64_t C, int64_t H,
                              int64_t hs, int64_t Tmax, int64_t pos, float scale) {
  extern __shared__ float sp[];  // pos + 1 scores
  __shared__ float sh[kThreads];
  const int64_t b = blockIdx.x / H, h = blockIdx.x % H;
  const T* q = qkv + b * 3 * C + h * hs;
  T* K = kc + (b * H + h) * Tmax * hs;
  T* V = vc + (b * H + h) * Tmax * hs;
  for (int64_t j = threadIdx.x; j < hs; j += blockDim.x) {
    K[pos * hs + j] = q[C + j];
    V[pos * hs + j] = q[2 * C + j];
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t t = threadIdx.x; t <= pos; t += blockDim.x) {
    float d = 0.f;
    for (int64_t j = 0; j < hs; ++j) d += to_f(q[j]) * to_f(K[t * hs + j]);
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
    for (int64_t t = 0; t <= pos; ++t) acc += sp[t] * inv * to_f(V[t * hs + j]);
    out[b * C + h * hs + j] = from_f<T>(acc);
  }
}

}  // namespace

void layernorm_fwd(const void* x, DType t, int64_t M, int64_t C, const void* gamma,
                   const void* beta, DType tp, void* y, float* mean, float* rstd, float eps,
                   cudaStream_t s) {
  if (M == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    ln_fwd_k<T><<<unsigned(M), kThreads, 0, s>>>(static_cast<const T*>(x), C, gamma, beta, tp,
                                                static_cast<T*>(y), mean, rstd, eps);
  });
}

size_t layernorm_bwd_scratch_bytes(int64_t M, int64_t C) {
  return size_t(ln_chunks(M)) * size_t(C) * sizeof(float2);
}

void layernorm_bwd(const void* dy, const void* x, DType t, int64_t M, int64_t C,
                   const void* gamma, DType tp, const float* mean, const float* rstd, void* dx,
                   void* dgamma, void* dbeta, DType tg, bool accumulate, void* scratch,
                   cudaStream_t s) {
  if (M == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    if (dx)
      ln_bwd_dx_k<T><<<unsigned(M), kThreads, 0, s>>>(static_cast<const T*>(dy),
                                                     static_cast<const T*>(x), C, gamma, tp, mean,
                                                     rstd, static_cast<T*>(dx));
    if (dgamma || dbeta) {
      const int chunks = ln_chunks(M);
      dim3 grid(unsigned((C + kColTile - 1) / kColTile), unsigned(chunks));
      ln_bwd_partial_k<T><<<grid, dim3(kColTile, kRowLanes), 0, s>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), M, C, mean, rstd,
          static_cast<float2*>(scratch));
      ln_bwd_final_k<<<grid_for(C), kThreads, 0, s>>>(static_cast<const float2*>(scratch), chunks,
                                                      C, dgamma, dbeta, tg, accumulate);
    }
  });
}

void gelu_fwd(const void* x, void* y, DType t, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    gelu_fwd_k<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y), n);
  });
}
void gelu_bwd(const void* x, const void* dy, void* dx, DType t, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    gelu_bwd_k<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(x),
                                                   static_cast<const T*>(dy), static_cast<T*>(dx), n);
  });
}

void embedding_fwd(const int32_t* ids, int64_t B, int64_t T_, const void* wte, int64_t V,
                   const void* wpe, DType tp, int64_t C, void* y, DType t, cudaStream_t s) {
  const int64_t N = B * T_;
  if (N * C == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    emb_fwd_k<T><<<grid_for(N * C), kThreads, 0, s>>>(ids, N, T_, wte, V, wpe, tp, C,
                                                       static_cast<T*>(y));
  });
}

void embedding_bwd(const void* dy, DType t, const int32_t* ids, int64_t B, int64_t T_, int64_t C,
                   void* dwte, int64_t V, void* dwpe, int64_t Tmax, DType tg, bool accumulate,
                   int* flags, cudaStream_t s) {
  const int64_t N = B * T_;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    const T* g = static_cast<const T*>(dy);
    if (dwpe && Tmax * C > 0)
      emb_bwd_wpe_k<T><<<grid_for(Tmax * C), kThreads, 0, s>>>(g, B, T_, Tmax, C, dwpe, tg,
                                                               accumulate);
    if (dwte && V > 0 && C > 0) {
      cudaMemsetAsync(flags, 0, size_t(V) * sizeof(int), s);
      if (N > 0) emb_mark_k<<<grid_for(N), kThreads, 0, s>>>(ids, N, V, flags);
      emb_bwd_wte_k<T><<<unsigned(V), kThreads, size_t(C) * sizeof(float), s>>>(
          g, ids, N, C, dwte, tg, accumulate, flags);
    }
  });
}

void causal_softmax(void* p, DType t, int64_t R, int64_t T_, float scale, cudaStream_t s) {
  if (R == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    causal_softmax_k<T><<<unsigned(R), kThreads, 0, s>>>(static_cast<T*>(p), T_, scale);
  });
}
void causal_softmax_bwd(const void* p, void* dp, DType t, int64_t R, int64_t T_, float scale,
                        cudaStream_t s) {
  if (R == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    causal_softmax_bwd_k<T><<<unsigned(R), kThreads, 0, s>>>(static_cast<const T*>(p),
                                                             static_cast<T*>(dp), T_, scale);
  });
}

void attention_decode(const void* qkv, void* kcache, void* vcache, void* out, DType t, int64_t B,
                      int64_t H, int64_t C, int64_t Tmax, int64_t pos, cudaStream_t s) {
  if (B == 0) return;
  const int64_t hs = C / H;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    attn_decode_k<T><<<unsigned(B * H), kThreads, size_t(pos + 1) * sizeof(float), s>>>(
        static_cast<const T*>(qkv), static_cast<T*>(kcache), static_cast<T*>(vcache),
        static_cast<T*>(out), C, H, hs, Tmax, pos, 1.f / sqrtf(float(hs)));
  });
}

void softmax_xent_masked(const void* logits, DType t, int64_t N, int64_t Cp, int64_t V,
                         const int32_t* labels, float grad_scale, float* losses, void* dlogits,
                         cudaStream_t s) {
  if (N == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    xent_masked_k<T><<<unsigned(N), kThreads, 0, s>>>(static_cast<const T*>(logits), Cp, V,
                                                      labels, grad_scale, losses,
                                                      static_cast<T*>(dlogits));
  });
}

}  // namespace dtrain::cuda_kernels

// GPT kernels: layer norm, GELU (tanh), token+position embedding, masked cross-entropy (the
// attention helpers are attention.cu).
// Deterministic: block reductions in a fixed tree order (device_common.cuh), column sums in
// two passes (per-chunk partials, then chunks summed in order), the embedding scatter as
// a stable radix sort of the positions by token id, then one block per id adding its rows in
// position order. No float atomics.
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/gpt_kernels.h"
#include "core/targets.h"

#include <cub/device/device_radix_sort.cuh>

namespace dtrain::cuda_kernels {
namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)
inline size_t emb_round(size_t b) { return (b + 255) / 256 * 256; }
constexpr int kColTile = 32, kRowLanes = 8, kLnRowsPerChunk = 64;


// Warp-per-row layer norm for rows of 16-byte vectors (C a multiple of the vector width, at
// most 32 * NV vectors): the row stays in registers between the statistics and the output.
// Warp sums by xor butterfly (every lane gets the bitwise-same sum; fixed order: deterministic).
constexpr int kLnRowsPerBlock = kThreads / 32;
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// With res (and h): the row is h = x + res first (rounded to T, as add stores it), written
// to h, and normalised.
template <typename T, int NV>
__global__ void ln_fwd_warp_k(const T* x, const T* res, T* h, int64_t M, int64_t C, const void* g, const void* b,
                              DType tp, T* y, float* mean, float* rstd, float eps) {
  constexpr int E = kVec<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kLnRowsPerBlock + threadIdx.x / 32;
  if (row >= M) return;  // whole warps leave together
  const T* xr = x + row * C;
  float v[NV][E];
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = (int64_t(k) * 32 + lane) * E;
    if (j < C) {
      load_vec<E>(xr + j, v[k]);
      if (res) {
        float rv[E];
        load_vec<E>(res + row * C + j, rv);
#pragma unroll
        for (int e = 0; e < E; ++e) v[k][e] = to_f(from_f<T>(v[k][e] + rv[e]));
        store_vec<E>(h + row * C + j, v[k]);
      }
#pragma unroll
      for (int e = 0; e < E; ++e) s += v[k][e];
    }
  }
  const float mu = warp_sum(s) / float(C);
  float q = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k)
    if ((int64_t(k) * 32 + lane) * E < C)
#pragma unroll
      for (int e = 0; e < E; ++e) q += (v[k][e] - mu) * (v[k][e] - mu);
  const float rs = rsqrtf(warp_sum(q) / float(C) + eps);
  T* yr = y + row * C;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = (int64_t(k) * 32 + lane) * E;
    if (j < C) {
      float o[E];
#pragma unroll
      for (int e = 0; e < E; ++e) o[e] = (v[k][e] - mu) * rs * load_any(g, tp, j + e) + load_any(b, tp, j + e);
      store_vec<E>(yr + j, o);
    }
  }
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}
template <typename T, int NV>
__global__ void ln_bwd_dx_warp_k(const T* dy, const T* x, int64_t M, int64_t C, const void* g, DType tp,
                                 const float* mean, const float* rstd, T* dx, bool acc) {
  constexpr int E = kVec<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kLnRowsPerBlock + threadIdx.x / 32;
  if (row >= M) return;
  const float mu = mean[row], rs = rstd[row];
  float dn[NV][E], xh[NV][E];
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = (int64_t(k) * 32 + lane) * E;
    if (j < C) {
      load_vec<E>(dy + row * C + j, dn[k]);
      load_vec<E>(x + row * C + j, xh[k]);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        dn[k][e] *= load_any(g, tp, j + e);
        xh[k][e] = (xh[k][e] - mu) * rs;
        s1 += dn[k][e];
        s2 += dn[k][e] * xh[k][e];
      }
    }
  }
  const float a = warp_sum(s1) / float(C), bb = warp_sum(s2) / float(C);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = (int64_t(k) * 32 + lane) * E;
    if (j < C) {
      float o[E];
#pragma unroll
      for (int e = 0; e < E; ++e) o[e] = rs * (dn[k][e] - a - xh[k][e] * bb);
      if (acc) {  // dx += the gradient rounded to T (as a separate add would see it)
        float r[E];
        load_vec<E>(dx + row * C + j, r);
#pragma unroll
        for (int e = 0; e < E; ++e) o[e] = to_f(from_f<T>(o[e])) + r[e];
      }
      store_vec<E>(dx + row * C + j, o);
    }
  }
}

// ---- layer norm ----
// x, y [M,C]: one block per row.
// With res (and h): h = x + res (rounded to T) is written first, then normalised; each
// thread re-reads only the h elements it wrote itself.
template <typename T>
__global__ void ln_fwd_k(const T* x, const T* res, T* h, int64_t C, const void* g, const void* b, DType tp, T* y,
                         float* mean, float* rstd, float eps) {
  __shared__ float sh[kThreads];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * C;
  float s = 0.f;
  if (res) {
    T* hr = h + row * C;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      hr[j] = from_f<T>(to_f(xr[j]) + to_f(res[row * C + j]));
      s += to_f(hr[j]);
    }
    xr = hr;
  } else {
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += to_f(xr[j]);
  }
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
                            const float* mean, const float* rstd, T* dx, bool acc) {
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
    const float v = rs * (to_f(gr[j]) * load_any(g, tp, j) - a - xh * b);
    o[j] = acc ? from_f<T>(to_f(from_f<T>(v)) + to_f(o[j])) : from_f<T>(v);
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

// ---- GELU (tanh approximation) ----
__device__ __forceinline__ float gelu_f(float v) {
  return 0.5f * v * (1.f + tanhf(kGeluC * (v + 0.044715f * v * v * v)));
}
__device__ __forceinline__ float gelu_grad_f(float v) {
  const float t = tanhf(kGeluC * (v + 0.044715f * v * v * v));
  const float du = kGeluC * (1.f + 3.f * 0.044715f * v * v);
  return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du;
}
// VEC: every pointer 16-byte aligned; elements [0, n / E * E) in vectors, the tail scalar.
template <typename T, bool VEC>
__global__ void gelu_fwd_k(const T* x, T* y, int64_t n) {
  constexpr int E = kVec<T>;
  const int64_t nv = VEC ? n / E : 0;
  DTRAIN_GRID_STRIDE(i, nv) {
    float a[E];
    load_vec<E>(x + i * E, a);
#pragma unroll
    for (int e = 0; e < E; ++e) a[e] = gelu_f(a[e]);
    store_vec<E>(y + i * E, a);
  }
  DTRAIN_GRID_STRIDE(i, n - nv * E) y[nv * E + i] = from_f<T>(gelu_f(to_f(x[nv * E + i])));
}
template <typename T, bool VEC>
__global__ void gelu_bwd_k(const T* x, const T* dy, T* dx, int64_t n) {
  constexpr int E = kVec<T>;
  const int64_t nv = VEC ? n / E : 0;
  DTRAIN_GRID_STRIDE(i, nv) {
    float a[E], g[E];
    load_vec<E>(x + i * E, a);
    load_vec<E>(dy + i * E, g);
#pragma unroll
    for (int e = 0; e < E; ++e) g[e] *= gelu_grad_f(a[e]);
    store_vec<E>(dx + i * E, g);
  }
  DTRAIN_GRID_STRIDE(i, n - nv * E) {
    const int64_t j = nv * E + i;
    dx[j] = from_f<T>(to_f(dy[j]) * gelu_grad_f(to_f(x[j])));
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
    y[idx] = from_f<T>(wpe ? a + load_any(wpe, tp, (i % T_) * C + c) : a);  // no wpe: the Llama family
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

__global__ void iota_k(int32_t* v, int64_t n) {
  DTRAIN_GRID_STRIDE(i, n) v[i] = int32_t(i);
}

// dwte after the positions were sorted by token id (stable: ascending positions within an
// id). One block per sorted index i; the block at the start of a run of equal ids owns that
// vocabulary row and adds the run's dy rows into it in position order (deterministic, no
// atomics); the other blocks return at once. Rows of ids that do not occur are untouched
// (zeroed beforehand when not accumulating).
template <typename T>
__global__ void emb_bwd_wte_runs_k(const T* dy, const int32_t* ids_sorted, const int32_t* pos_sorted,
                                   int64_t N, int64_t C, int64_t V, void* dwte, DType tg,
                                   bool accumulate) {
  const int64_t i = blockIdx.x;
  const int32_t id = ids_sorted[i];
  if ((i > 0 && ids_sorted[i - 1] == id) || id < 0 || id >= V) return;
  int64_t end = i + 1;
  while (end < N && ids_sorted[end] == id) ++end;
  const int64_t base_out = int64_t(id) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = accumulate ? load_any(dwte, tg, base_out + c) : 0.f;
    for (int64_t j = i; j < end; ++j) acc += to_f(dy[int64_t(pos_sorted[j]) * C + c]);
    store_any(dwte, tg, base_out + c, acc);
  }
}

// ---- masked cross-entropy ----
// One block per row. Pass 1 keeps a running (max, sum of exp) per thread (online softmax, in
// base 2), combined over the block in a fixed tree order; pass 2 writes the gradient. VEC:
// rows of 16-byte vectors (Cp a multiple of the vector width, pointers aligned).
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
__device__ __forceinline__ void lse_add(float& m, float& s, float v) {  // v in log2 units
  if (v == -INFINITY) return;
  if (v > m) {
    s = s * exp2f(m - v) + 1.f;
    m = v;
  } else {
    s += exp2f(v - m);
  }
}
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  if (M == -INFINITY) return;
  s = s * exp2f(m - M) + s2 * exp2f(m2 - M);
  m = M;
}
template <typename T, bool VEC>
__global__ void xent_masked_k(const T* logits, int64_t Cp, int64_t V, const int32_t* labels,
                              float grad_scale, float* losses, T* dlogits) {
  __shared__ float shm[kThreads], shs[kThreads];
  constexpr int E = VEC ? kVec<T> : 1;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * Cp;
  const int32_t y = labels[row];
  const bool ignored = y == kIgnoreTarget;  // not a target: no loss, no gradient
  const bool bad = (y < 0 || y >= V) && !ignored;
  float m = -INFINITY, sm = 0.f;
  for (int64_t j = int64_t(threadIdx.x) * E; j < V; j += int64_t(blockDim.x) * E) {
    if constexpr (VEC) {
      float a[E];
      load_vec<E>(x + j, a);
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (j + e < V) lse_add(m, sm, a[e] * kLog2e);
    } else {
      lse_add(m, sm, to_f(x[j]) * kLog2e);
    }
  }
  shm[threadIdx.x] = m;
  shs[threadIdx.x] = sm;
  __syncthreads();
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st) {
      float a = shm[threadIdx.x], b = shs[threadIdx.x];
      lse_merge(a, b, shm[threadIdx.x + st], shs[threadIdx.x + st]);
      shm[threadIdx.x] = a;
      shs[threadIdx.x] = b;
    }
    __syncthreads();
  }
  const float mx = shm[0], se = shs[0];  // log2 units: lse = (mx + log2(se)) * ln 2
  if (threadIdx.x == 0 && losses) losses[row] = bad ? NAN : ignored ? 0.f : (mx + log2f(se)) * kLn2 - to_f(x[y]);
  if (!dlogits) return;
  T* d = dlogits + row * Cp;
  const float inv = 1.f / se;
  auto grad = [&](int64_t j, float v) {
    if (j >= V || ignored) return 0.f;
    if (bad) return NAN;
    return grad_scale * (exp2f(v * kLog2e - mx) * inv - (j == y ? 1.f : 0.f));
  };
  for (int64_t j = int64_t(threadIdx.x) * E; j < Cp; j += int64_t(blockDim.x) * E) {
    if constexpr (VEC) {
      float a[E];
      load_vec<E>(x + j, a);
#pragma unroll
      for (int e = 0; e < E; ++e) a[e] = grad(j + e, a[e]);
      store_vec<E>(d + j, a);
    } else {
      d[j] = from_f<T>(grad(j, to_f(x[j])));
    }
  }
}

// Vectors per lane for the warp-per-row kernels (1, 2, 4 or 8), or 0: use the block kernels.
template <typename T>
int ln_warp_vectors(int64_t C, const void* a, const void* b) {
  constexpr int E = kVec<T>;
  if (C % E != 0 || !is_aligned(a, 16) || !is_aligned(b, 16)) return 0;
  const int64_t per_lane = (C / E + 31) / 32;
  for (int nv : {1, 2, 4, 8})
    if (per_lane <= nv) return nv;
  return 0;
}

int ln_chunks(int64_t M) { return int((M + kLnRowsPerChunk - 1) / kLnRowsPerChunk); }

}  // namespace

void layernorm_fwd(const void* x, const void* res, void* h, DType t, int64_t M, int64_t C, const void* gamma,
                   const void* beta, DType tp, void* y, float* mean, float* rstd, float eps,
                   cudaStream_t s) {
  if (M == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    const T* rp = static_cast<const T*>(res);
    T* hp = static_cast<T*>(h);
    T* yp = static_cast<T*>(y);
    const unsigned blocks = unsigned((M + kLnRowsPerBlock - 1) / kLnRowsPerBlock);
    const bool res_ok = !res || (is_aligned(res, 16) && is_aligned(h, 16));
    switch (res_ok ? ln_warp_vectors<T>(C, x, y) : 0) {
      case 1: ln_fwd_warp_k<T, 1><<<blocks, kThreads, 0, s>>>(xp, rp, hp, M, C, gamma, beta, tp, yp, mean, rstd, eps); break;
      case 2: ln_fwd_warp_k<T, 2><<<blocks, kThreads, 0, s>>>(xp, rp, hp, M, C, gamma, beta, tp, yp, mean, rstd, eps); break;
      case 4: ln_fwd_warp_k<T, 4><<<blocks, kThreads, 0, s>>>(xp, rp, hp, M, C, gamma, beta, tp, yp, mean, rstd, eps); break;
      case 8: ln_fwd_warp_k<T, 8><<<blocks, kThreads, 0, s>>>(xp, rp, hp, M, C, gamma, beta, tp, yp, mean, rstd, eps); break;
      default: ln_fwd_k<T><<<unsigned(M), kThreads, 0, s>>>(xp, rp, hp, C, gamma, beta, tp, yp, mean, rstd, eps);
    }
  });
}

size_t layernorm_bwd_scratch_bytes(int64_t M, int64_t C) {
  return size_t(ln_chunks(M)) * size_t(C) * sizeof(float2);
}

void layernorm_bwd(const void* dy, const void* x, DType t, int64_t M, int64_t C,
                   const void* gamma, DType tp, const float* mean, const float* rstd, void* dx,
                   void* dgamma, void* dbeta, DType tg, bool accumulate, bool accumulate_dx,
                   void* scratch, cudaStream_t s) {
  if (M == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    if (dx) {
      const T* gp = static_cast<const T*>(dy);
      const T* xp = static_cast<const T*>(x);
      T* dp = static_cast<T*>(dx);
      const unsigned blocks = unsigned((M + kLnRowsPerBlock - 1) / kLnRowsPerBlock);
      switch (is_aligned(dy, 16) ? ln_warp_vectors<T>(C, x, dx) : 0) {
        case 1: ln_bwd_dx_warp_k<T, 1><<<blocks, kThreads, 0, s>>>(gp, xp, M, C, gamma, tp, mean, rstd, dp, accumulate_dx); break;
        case 2: ln_bwd_dx_warp_k<T, 2><<<blocks, kThreads, 0, s>>>(gp, xp, M, C, gamma, tp, mean, rstd, dp, accumulate_dx); break;
        case 4: ln_bwd_dx_warp_k<T, 4><<<blocks, kThreads, 0, s>>>(gp, xp, M, C, gamma, tp, mean, rstd, dp, accumulate_dx); break;
        case 8: ln_bwd_dx_warp_k<T, 8><<<blocks, kThreads, 0, s>>>(gp, xp, M, C, gamma, tp, mean, rstd, dp, accumulate_dx); break;
        default: ln_bwd_dx_k<T><<<unsigned(M), kThreads, 0, s>>>(gp, xp, C, gamma, tp, mean, rstd, dp, accumulate_dx);
      }
    }
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
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    if (is_aligned(x, 16) && is_aligned(y, 16))
      gelu_fwd_k<T, true><<<grid_for(n / kVec<T> + 1), kThreads, 0, s>>>(xp, yp, n);
    else
      gelu_fwd_k<T, false><<<grid_for(n), kThreads, 0, s>>>(xp, yp, n);
  });
}
void gelu_bwd(const void* x, const void* dy, void* dx, DType t, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    const T* gp = static_cast<const T*>(dy);
    T* dp = static_cast<T*>(dx);
    if (is_aligned(x, 16) && is_aligned(dy, 16) && is_aligned(dx, 16))
      gelu_bwd_k<T, true><<<grid_for(n / kVec<T> + 1), kThreads, 0, s>>>(xp, gp, dp, n);
    else
      gelu_bwd_k<T, false><<<grid_for(n), kThreads, 0, s>>>(xp, gp, dp, n);
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

size_t embedding_bwd_ws_bytes(int64_t N) {
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, temp, static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), int(N));
  return 3 * emb_round(size_t(N) * sizeof(int32_t)) + emb_round(temp);
}

void embedding_bwd(const void* dy, DType t, const int32_t* ids, int64_t B, int64_t T_, int64_t C,
                   void* dwte, int64_t V, void* dwpe, int64_t Tmax, DType tg, bool accumulate,
                   void* ws, size_t ws_bytes, cudaStream_t s) {
  const int64_t N = B * T_;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    const T* g = static_cast<const T*>(dy);
    if (dwpe && Tmax * C > 0)
      emb_bwd_wpe_k<T><<<grid_for(Tmax * C), kThreads, 0, s>>>(g, B, T_, Tmax, C, dwpe, tg,
                                                               accumulate);
    if (!dwte || V == 0 || C == 0) return;
    if (!accumulate) cudaMemsetAsync(dwte, 0, size_t(V * C) * dtype_size(tg), s);
    if (N == 0) return;
    // positions sorted by token id: [ids_sorted | pos | pos_sorted | radix sort temp]
    char* w = static_cast<char*>(ws);
    const size_t a = emb_round(size_t(N) * sizeof(int32_t));
    auto* ids_sorted = reinterpret_cast<int32_t*>(w);
    auto* pos = reinterpret_cast<int32_t*>(w + a);
    auto* pos_sorted = reinterpret_cast<int32_t*>(w + 2 * a);
    size_t temp = ws_bytes - 3 * a;
    iota_k<<<grid_for(N), kThreads, 0, s>>>(pos, N);
    cub::DeviceRadixSort::SortPairs(w + 3 * a, temp, ids, ids_sorted, pos, pos_sorted, int(N), 0,
                                    int(sizeof(int32_t) * 8), s);
    emb_bwd_wte_runs_k<T><<<unsigned(N), kThreads, 0, s>>>(g, ids_sorted, pos_sorted, N, C, V, dwte,
                                                           tg, accumulate);
  });
}

void softmax_xent_masked(const void* logits, DType t, int64_t N, int64_t Cp, int64_t V,
                         const int32_t* labels, float grad_scale, float* losses, void* dlogits,
                         cudaStream_t s) {
  if (N == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    const T* lp = static_cast<const T*>(logits);
    T* dp = static_cast<T*>(dlogits);
    if (Cp % kVec<T> == 0 && is_aligned(logits, 16) && (!dlogits || is_aligned(dlogits, 16)))
      xent_masked_k<T, true><<<unsigned(N), kThreads, 0, s>>>(lp, Cp, V, labels, grad_scale, losses, dp);
    else
      xent_masked_k<T, false><<<unsigned(N), kThreads, 0, s>>>(lp, Cp, V, labels, grad_scale, losses, dp);
  });
}

}  // namespace dtrain::cuda_kernels

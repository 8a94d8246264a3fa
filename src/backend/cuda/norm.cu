// Batch norm over the rows of x [M,C] (NHWC flattened), PyTorch semantics:
//   train: mean, biased var over M; save_invstd = 1/sqrt(var+eps);
//          running_mean = (1-m)*rm + m*mean; running_var = (1-m)*rv + m*var*M/(M-1)
//   bwd:   dbeta = sum dy; dgamma = sum dy*xhat;
//          dx = gamma*invstd*(dy - sum(dy)/M - (x-mean)*invstd^2*sum(dy*(x-mean))/M)
//
// Every [M,C] kernel uses one block shape: tw channel groups of V consecutive channels
// (V = 8 bf16/f16 or 4 f32 when C % V == 0 and the pointers are 16-byte aligned, else 1)
// by rl rows, tw * rl = 256 threads. Each thread keeps one channel group and walks rows,
// so a warp reads whole 16-byte vectors of consecutive rows (coalesced), and per-channel
// parameters are loaded once per thread.
//
// Reductions are deterministic (no atomics, fixed order everywhere):
//   pass 1  grid (channel tiles, row chunks): per thread f32 Welford (fwd) or plain sums
//           (bwd) over its rows of the chunk, then a fixed tree over the block's rows ->
//           partials[chunk][C] (float2: (mean, M2) or (sum dy, sum dy*(x-mean)));
//   pass 2  one warp per channel combines the chunks in double (lane-strided, then a
//           fixed xor butterfly) and writes the statistics plus the per-channel
//           coefficients the elementwise pass needs (scratch, f32 [3][C]).
// The forward reads x twice (statistics, normalisation) instead of three times.
#include <type_traits>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"

namespace dtrain::cuda_kernels {
namespace {

// Block shape of the [M,C] kernels for V channels per thread.
struct Tile {
  int64_t groups;  // C / V
  int tw, rl;      // channel groups x rows per block
  unsigned tiles;  // blocks across the channels
};
Tile make_tile(int64_t C, int V) {
  Tile t;
  t.groups = C / V;
  t.tw = 1;
  while (t.tw < 32 && t.tw < t.groups) t.tw <<= 1;
  t.rl = kThreads / t.tw;
  t.tiles = unsigned((t.groups + t.tw - 1) / t.tw);
  return t;
}
// Row blocks of an elementwise [M,C] pass: enough for a few waves, each thread then loops.
unsigned row_blocks(int64_t M, const Tile& t) {
  int64_t b = (M + t.rl - 1) / t.rl;
  int64_t cap = kMaxStreamBlocks / int64_t(t.tiles);
  if (cap > 65535) cap = 65535;
  if (cap < 1) cap = 1;
  return unsigned(b < 1 ? 1 : (b > cap ? cap : b));
}

// Row chunks of pass 1 (~1024 blocks of 256-channel tiles)
int bn_chunks(int64_t M, int64_t C) { return reduction_row_chunks(M, C, 256, 1024); }
size_t partial_bytes(int64_t M, int64_t C) {
  size_t b = size_t(bn_chunks(M, C)) * size_t(C) * sizeof(float2);
  return (b + 15) / 16 * 16;
}

// Pass 1 (forward): partials[chunk*C + c] = (mean, M2) of x[r, c] over the chunk's rows.
// x [M,C]; block (tw, rl); grid (tiles, chunks).
template <typename T, int V>
__global__ void bn_stats_partial_k(const T* x, int64_t M, int64_t C, int64_t rows_per_chunk,
                                   float2* partials) {
  __shared__ float s_mean[V][kThreads], s_m2[V][kThreads], s_n[kThreads];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * blockDim.x + tx;
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + tx;
  const bool active = g < C / V;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(M, r0 + rows_per_chunk);
  float mean[V], m2[V], n = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) mean[j] = m2[j] = 0.f;
  if (active && r0 + ty < r1) {
    // Welford on x - (the thread's first row): updates then see deviations, not |mean|.
    const T* p = x + g * V;
    float first[V];
    load_vec<V>(p + (r0 + ty) * C, first);
    n = 1.f;
    auto add = [&](const float(&v)[V]) {
      n += 1.f;
      const float inv = 1.f / n;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float u = v[j] - first[j], d = u - mean[j];
        mean[j] += d * inv;
        m2[j] += d * (u - mean[j]);
      }
    };
    // Two rows per iteration (in row order): two loads in flight per thread.
    const int64_t step = blockDim.y;
    for (int64_t r = r0 + ty + step; r < r1; r += 2 * step) {
      float v[V], w[V];
      const bool two = r + step < r1;
      load_vec<V>(p + r * C, v);
      if (two) load_vec<V>(p + (r + step) * C, w);
      add(v);
      if (two) add(w);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) mean[j] += first[j];
  }
#pragma unroll
  for (int j = 0; j < V; ++j) s_mean[j][tid] = mean[j], s_m2[j][tid] = m2[j];
  s_n[tid] = n;
  __syncthreads();
  // Chan's combine, row lane ty absorbs ty + h (h = rl/2, rl/4, ..., 1).
  for (int h = blockDim.y / 2; h > 0; h >>= 1) {
    if (ty < h) {
      const int o = tid + h * blockDim.x;
      const float na = s_n[tid], nb = s_n[o];
      if (nb > 0.f) {
        const float nn = na + nb, wb = nb / nn, w = na * wb;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float d = s_mean[j][o] - s_mean[j][tid];
          s_mean[j][tid] += d * wb;
          s_m2[j][tid] += s_m2[j][o] + d * d * w;
        }
        s_n[tid] = nn;
      }
    }
    __syncthreads();
  }
  if (ty == 0 && active) {
    float2* out = partials + int64_t(blockIdx.y) * C + g * V;
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = make_float2(s_mean[j][tx], s_m2[j][tx]);
  }
}

// The fused ReLU's mask in the backward kernels. Kind 0: none; 1: read the forward's output
// y (dy counts where y > 0); 2: recomputed from x as bn_apply_k made y, v = fma(x - mean,
// invstd*gamma, beta), y = round(max(v, 0)), so y > 0 exactly when v > 0 and v rounds to a
// nonzero T. Kind 2 reads nothing per element beyond x, which the kernels read anyway.
struct MaskArgs {
  const void* y = nullptr;
  const void* gamma = nullptr;
  const void* beta = nullptr;
  DType tp = DType::F32;
  const float* invstd = nullptr;
};
template <typename T, int V, int Kind>
struct ReluMask {
  const T* y = nullptr;
  float sc[V], sh[V];
  __device__ ReluMask(const MaskArgs& a, int64_t c0) {
    if constexpr (Kind == 1) y = static_cast<const T*>(a.y);
    if constexpr (Kind == 2) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        sc[j] = a.invstd[c0 + j] * load_any(a.gamma, a.tp, c0 + j);  // as bn_stats_final_k
        sh[j] = load_any(a.beta, a.tp, c0 + j);
      }
    }
  }
  // vg: dy at element offset off; vx, mu: x there and the channels' means
  __device__ __forceinline__ void apply(int64_t off, const float (&vx)[V], const float (&mu)[V],
                                        float (&vg)[V]) const {
    if constexpr (Kind == 1) {
      float m[V];
      load_vec<V>(y + off, m);
#pragma unroll
      for (int j = 0; j < V; ++j) vg[j] = m[j] > 0.f ? vg[j] : 0.f;
    } else if constexpr (Kind == 2) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float v = __fmaf_rn(vx[j] - mu[j], sc[j], sh[j]);
        vg[j] = v > 0.f && to_f(from_f<T>(v)) > 0.f ? vg[j] : 0.f;
      }
    }
  }
};

// Pass 1 (backward): partials[chunk*C + c] = (sum dy, sum dy*(x - mean[c])) over the chunk,
// dy masked by the fused ReLU (Kind); dmasked (may be null) receives the masked dy, which
// bn_dx_k then reads. dy, x [M,C]; mean [C]; block (tw, rl); grid (tiles, chunks).
template <typename T, int V, int Kind>
__global__ void bn_bwd_partial_k(const T* dy, const T* x, MaskArgs ma, T* dmasked,
                                 const float* mean, int64_t M, int64_t C, int64_t rows_per_chunk,
                                 float2* partials) {
  __shared__ float s_a[V][kThreads], s_b[V][kThreads];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * blockDim.x + tx;
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + tx;
  const bool active = g < C / V;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(M, r0 + rows_per_chunk);
  float a[V], b[V];
#pragma unroll
  for (int j = 0; j < V; ++j) a[j] = b[j] = 0.f;
  if (active) {
    float mu[V];
#pragma unroll
    for (int j = 0; j < V; ++j) mu[j] = mean[g * V + j];
    const ReluMask<T, V, Kind> mask(ma, g * V);
    for (int64_t r = r0 + ty; r < r1; r += blockDim.y) {
      float vg[V], vx[V];
      load_vec<V>(dy + r * C + g * V, vg);
      load_vec<V>(x + r * C + g * V, vx);
      mask.apply(r * C + g * V, vx, mu, vg);
      if (dmasked) store_vec<V>(dmasked + r * C + g * V, vg);  // exact: dy's values or 0
#pragma unroll
      for (int j = 0; j < V; ++j) {
        a[j] += vg[j];
        b[j] += vg[j] * (vx[j] - mu[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) s_a[j][tid] = a[j], s_b[j][tid] = b[j];
  __syncthreads();
  for (int h = blockDim.y / 2; h > 0; h >>= 1) {
    if (ty < h) {
      const int o = tid + h * blockDim.x;
#pragma unroll
      for (int j = 0; j < V; ++j) s_a[j][tid] += s_a[j][o], s_b[j][tid] += s_b[j][o];
    }
    __syncthreads();
  }
  if (ty == 0 && active) {
    float2* out = partials + int64_t(blockIdx.y) * C + g * V;
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = make_float2(s_a[j][tx], s_b[j][tx]);
  }
}

// Rows of pass-1 chunk k.
__device__ __forceinline__ double chunk_rows(int k, int64_t rows_per_chunk, int64_t M) {
  int64_t r0 = int64_t(k) * rows_per_chunk, r1 = min(M, r0 + rows_per_chunk);
  return r1 > r0 ? double(r1 - r0) : 0.0;
}

// Pass 2 (forward), one warp per channel c < C: mean and biased variance from the chunks'
// (mean, M2) in double; writes save_mean, save_invstd, the running statistics and the
// affine coefficients of bn_apply_k: scale = invstd*gamma, shift = beta (f32 [C] each).
__global__ void bn_stats_final_k(const float2* partials, int chunks, int64_t rows_per_chunk,
                                 int64_t M, int64_t C, const void* gamma, const void* beta,
                                 DType tp, float* mean_out, float* invstd_out, float* running_mean,
                                 float* running_var, float momentum, float eps, float* scale,
                                 float* shift) {
  const int lane = threadIdx.x & 31;
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (c >= C) return;  // whole warps only (c is per warp)
  double s = 0.0;
  for (int k = lane; k < chunks; k += 32) {
    const double n = chunk_rows(k, rows_per_chunk, M);
    if (n > 0) s += n * double(partials[int64_t(k) * C + c].x);
  }
  const double mean = warp_sum(s) / double(M);
  double q = 0.0;
  for (int k = lane; k < chunks; k += 32) {
    const double n = chunk_rows(k, rows_per_chunk, M);
    if (n > 0) {
      const float2 p = partials[int64_t(k) * C + c];
      const double d = double(p.x) - mean;
      q += double(p.y) + n * d * d;
    }
  }
  q = warp_sum(q);
  if (lane == 0) {
    const float var = float(q / double(M));
    const float is = 1.f / sqrtf(var + eps);
    const float unbiased = M > 1 ? float(q / double(M - 1)) : var;
    mean_out[c] = float(mean);
    invstd_out[c] = is;
    running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * float(mean);
    running_var[c] = (1.f - momentum) * running_var[c] + momentum * unbiased;
    scale[c] = is * load_any(gamma, tp, c);
    shift[c] = load_any(beta, tp, c);
  }
}

// Eval coefficients: scale = gamma / sqrt(running_var + eps), shift = beta (f32 [C]).
__global__ void bn_eval_coef_k(int64_t C, const void* gamma, const void* beta, DType tp,
                               const float* running_var, float eps, float* scale, float* shift) {
  DTRAIN_GRID_STRIDE(c, C) {
    scale[c] = 1.f / sqrtf(running_var[c] + eps) * load_any(gamma, tp, c);
    shift[c] = load_any(beta, tp, c);
  }
}

// y = relu?(round((x - mean[c]) * scale[c] + shift[c]) + res?);  x, y, res [M,C] (res may be
// null); block (tw, rl); grid (tiles, row blocks). The rounding to T before the add is what
// the separate batch norm and add ops did (and what the CPU reference does).
template <typename T, int V>
__global__ void bn_apply_k(const T* x, T* y, int64_t M, int64_t C, const float* mean,
                           const float* scale, const float* shift, const T* res, bool relu) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= C / V) return;
  float mu[V], sc[V], sh[V];
#pragma unroll
  for (int j = 0; j < V; ++j) mu[j] = mean[g * V + j], sc[j] = scale[g * V + j], sh[j] = shift[g * V + j];
  auto finish = [&](float(&v)[V], const float(&u)[V]) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      v[j] = __fmaf_rn(v[j] - mu[j], sc[j], sh[j]);  // explicit: ReluMask<2> redoes it exactly
      if (res) v[j] = to_f(from_f<T>(v[j])) + u[j];
      if (relu) v[j] = v[j] > 0.f ? v[j] : 0.f;
    }
  };
  // Rows r and r + step per iteration: two loads (of x, and of res) in flight per thread.
  const int64_t step = int64_t(gridDim.y) * blockDim.y;
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < M; r += 2 * step) {
    const bool two = r + step < M;
    float v0[V], v1[V], u0[V], u1[V];
    load_vec<V>(x + r * C + g * V, v0);
    if (two) load_vec<V>(x + (r + step) * C + g * V, v1);
    if (res) {
      load_vec<V>(res + r * C + g * V, u0);
      if (two) load_vec<V>(res + (r + step) * C + g * V, u1);
    }
    finish(v0, u0);
    store_vec<V>(y + r * C + g * V, v0);
    if (two) {
      finish(v1, u1);
      store_vec<V>(y + (r + step) * C + g * V, v1);
    }
  }
}

// Pass 2 (backward), one warp per channel c < C: sum dy and sum dy*(x-mean) in double;
// dgamma/dbeta (optionally accumulated) and the coefficients of bn_dx_k in coef [3][C]:
//   k1 = gamma*invstd, c1 = sum(dy)/M, c2 = invstd^2 * sum(dy*(x-mean))/M.
__global__ void bn_bwd_final_k(const float2* partials, int chunks, int64_t M, int64_t C,
                               const void* gamma, DType tp, const float* invstd, void* dgamma,
                               void* dbeta, DType tg, bool accumulate, float* coef) {
  const int lane = threadIdx.x & 31;
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (c >= C) return;  // whole warps only
  double a = 0.0, b = 0.0;
  for (int k = lane; k < chunks; k += 32) {
    const float2 p = partials[int64_t(k) * C + c];
    a += p.x;
    b += p.y;
  }
  a = warp_sum(a);
  b = warp_sum(b);
  if (lane == 0) {
    const float is = invstd[c], sdy = float(a), sdyx = float(b), inv_m = 1.f / float(M);
    const float dg = sdyx * is, db = sdy;
    if (dgamma) store_any(dgamma, tg, c, accumulate ? load_any(dgamma, tg, c) + dg : dg);
    if (dbeta) store_any(dbeta, tg, c, accumulate ? load_any(dbeta, tg, c) + db : db);
    coef[c] = load_any(gamma, tp, c) * is;
    coef[C + c] = sdy * inv_m;
    coef[2 * C + c] = is * is * sdyx * inv_m;
  }
}

// dx = k1 * (dy - c1 - (x - mean) * c2), dy masked by the fused ReLU (Kind);  dy, x, dx
// [M,C] (dx may alias dy); coef [3][C] from bn_bwd_final_k; block (tw, rl); grid (tiles,
// row blocks)
template <typename T, int V, int Kind>
__global__ void bn_dx_k(const T* dy, const T* x, MaskArgs ma, T* dx, int64_t M, int64_t C,
                        const float* mean, const float* coef) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= C / V) return;
  float mu[V], k1[V], c1[V], c2[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t c = g * V + j;
    mu[j] = mean[c], k1[j] = coef[c], c1[j] = coef[C + c], c2[j] = coef[2 * C + c];
  }
  const ReluMask<T, V, Kind> mask(ma, g * V);
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < M;
       r += int64_t(gridDim.y) * blockDim.y) {
    float vg[V], vx[V];
    load_vec<V>(dy + r * C + g * V, vg);
    load_vec<V>(x + r * C + g * V, vx);
    mask.apply(r * C + g * V, vx, mu, vg);
#pragma unroll
    for (int j = 0; j < V; ++j) vg[j] = k1[j] * (vg[j] - c1[j] - (vx[j] - mu[j]) * c2[j]);
    store_vec<V>(dx + r * C + g * V, vg);
  }
}

// V for [M,C] tensors of T at these pointers: 16-byte vectors when possible.
template <typename T>
bool use_vec(int64_t C, const void* a, const void* b = nullptr, const void* c = nullptr) {
  return C % kVec<T> == 0 && is_aligned(a, 16) && is_aligned(b, 16) && is_aligned(c, 16);
}

// Calls f(std::integral_constant<int, V>) with V = kVec<T> or 1.
template <typename T, typename F>
void with_vec(bool vec, F&& f) {
  if (vec)
    f(std::integral_constant<int, kVec<T>>{});
  else
    f(std::integral_constant<int, 1>{});
}

}  // namespace

size_t bn_scratch_bytes(int64_t M, int64_t C) {
  return partial_bytes(M, C) + size_t(3 * C) * sizeof(float);
}
size_t bn_eval_scratch_bytes(int64_t C) { return size_t(2 * C) * sizeof(float); }

void bn_fwd_train(const void* x, DType tx, int64_t M, int64_t C, const void* gamma,
                  const void* beta, DType tp, void* y, float* running_mean, float* running_var,
                  float* save_mean, float* save_invstd, float momentum, float eps, void* scratch,
                  const void* res, bool relu, cudaStream_t s) {
  const int chunks = bn_chunks(M, C);
  const int64_t rows = (M + chunks - 1) / chunks;
  float2* partials = static_cast<float2*>(scratch);
  float* scale = reinterpret_cast<float*>(static_cast<char*>(scratch) + partial_bytes(M, C));
  float* shift = scale + C;
  dispatch_float(tx, [&](auto tag) {
    using T = decltype(tag);
    const T* xt = static_cast<const T*>(x);
    T* yt = static_cast<T*>(y);
    const T* rt = static_cast<const T*>(res);
    with_vec<T>(use_vec<T>(C, x, y, res), [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      const Tile t = make_tile(C, V);
      const dim3 block(unsigned(t.tw), unsigned(t.rl));
      bn_stats_partial_k<T, V><<<dim3(t.tiles, unsigned(chunks)), block, 0, s>>>(xt, M, C, rows,
                                                                                partials);
      bn_stats_final_k<<<grid_for(C * 32), kThreads, 0, s>>>(
          partials, chunks, rows, M, C, gamma, beta, tp, save_mean, save_invstd, running_mean,
          running_var, momentum, eps, scale, shift);
      bn_apply_k<T, V><<<dim3(t.tiles, row_blocks(M, t)), block, 0, s>>>(xt, yt, M, C, save_mean,
                                                                        scale, shift, rt, relu);
    });
  });
}

void bn_fwd_eval(const void* x, DType tx, int64_t M, int64_t C, const void* gamma,
                 const void* beta, DType tp, const float* running_mean, const float* running_var,
                 void* y, float eps, void* scratch, const void* res, bool relu, cudaStream_t s) {
  if (M == 0 || C == 0) return;
  float* scale = static_cast<float*>(scratch);
  float* shift = scale + C;
  bn_eval_coef_k<<<grid_for(C), kThreads, 0, s>>>(C, gamma, beta, tp, running_var, eps, scale,
                                                  shift);
  dispatch_float(tx, [&](auto tag) {
    using T = decltype(tag);
    with_vec<T>(use_vec<T>(C, x, y, res), [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      const Tile t = make_tile(C, V);
      bn_apply_k<T, V><<<dim3(t.tiles, row_blocks(M, t)), dim3(unsigned(t.tw), unsigned(t.rl)), 0,
                         s>>>(static_cast<const T*>(x), static_cast<T*>(y), M, C, running_mean,
                              scale, shift, static_cast<const T*>(res), relu);
    });
  });
}

void bn_bwd(const void* dy, const void* x, DType tx, int64_t M, int64_t C, const void* gamma,
            DType tp, const float* save_mean, const float* save_invstd, void* dx, void* dgamma,
            void* dbeta, DType tg, bool accumulate, void* scratch, const BnMask& mask,
            cudaStream_t s) {
  const int chunks = bn_chunks(M, C);
  const int64_t rows = (M + chunks - 1) / chunks;
  float2* partials = static_cast<float2*>(scratch);
  float* coef = reinterpret_cast<float*>(static_cast<char*>(scratch) + partial_bytes(M, C));
  MaskArgs ma;
  ma.y = mask.y;
  ma.gamma = gamma;
  ma.beta = mask.beta;
  ma.tp = tp;
  ma.invstd = save_invstd;
  const int kind = mask.beta ? 2 : mask.y ? 1 : 0;
  dispatch_float(tx, [&](auto tag) {
    using T = decltype(tag);
    const T* dyt = static_cast<const T*>(dy);
    const T* xt = static_cast<const T*>(x);
    T* dmt = static_cast<T*>(mask.out);
    const bool vec = use_vec<T>(C, dy, x, dx) && is_aligned(mask.y, 16) && is_aligned(mask.out, 16);
    auto run = [&](auto vtag, auto ktag) {
      constexpr int V = decltype(vtag)::value;
      constexpr int K = decltype(ktag)::value;
      const Tile t = make_tile(C, V);
      const dim3 block(unsigned(t.tw), unsigned(t.rl));
      bn_bwd_partial_k<T, V, K><<<dim3(t.tiles, unsigned(chunks)), block, 0, s>>>(
          dyt, xt, ma, dmt, save_mean, M, C, rows, partials);
      bn_bwd_final_k<<<grid_for(C * 32), kThreads, 0, s>>>(partials, chunks, M, C, gamma, tp,
                                                           save_invstd, dgamma, dbeta, tg,
                                                           accumulate, coef);
      if (!dx) return;
      const dim3 grid(t.tiles, row_blocks(M, t));
      if (dmt)  // pass 3 reads the masked gradient instead of dy and the mask
        bn_dx_k<T, V, 0><<<grid, block, 0, s>>>(dmt, xt, ma, static_cast<T*>(dx), M, C, save_mean, coef);
      else
        bn_dx_k<T, V, K><<<grid, block, 0, s>>>(dyt, xt, ma, static_cast<T*>(dx), M, C, save_mean, coef);
    };
    with_vec<T>(vec, [&](auto vtag) {
      if (kind == 2)
        run(vtag, std::integral_constant<int, 2>{});
      else if (kind == 1)
        run(vtag, std::integral_constant<int, 1>{});
      else
        run(vtag, std::integral_constant<int, 0>{});
    });
  });
}

}  // namespace dtrain::cuda_kernels

// Batch norm over the rows of x [M,C] (NHWC flattened), PyTorch semantics:
//   train: mean, biased var over M; save_invstd = 1/sqrt(var+eps);
//          running_mean = (1-m)*rm + m*mean; running_var = (1-m)*rv + m*var*M/(M-1)
//   bwd:   dbeta = sum dy; dgamma = sum dy*xhat;
//          dx = gamma*invstd*(dy - sum(dy)/M - (x-mean)*invstd^2*sum(dy*(x-mean))/M)
// Reductions are deterministic: pass 1 gives per-(row chunk, channel) partials in fixed
// order, pass 2 sums the chunks in order (double). No float atomics.
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"

namespace dtrain::cuda_kernels {
namespace {

constexpr int kColTile = 32, kRowLanes = 8;

enum class Mode { Sum, SqDev, Bwd };

// partials[chunk*C + c] = (sum a, sum b) over the chunk's rows, where per element
//   Sum:   a = x
//   SqDev: a = (x - mean[c])^2
//   Bwd:   a = dy, b = dy * (x - mean[c])
template <typename T, Mode MODE>
__global__ void bn_partial_k(const T* x, const T* dy, const float* mean, int64_t M, int64_t C,
                             int64_t rows_per_chunk, float2* partials) {
  __shared__ float sa[kRowLanes][kColTile];
  __shared__ float sb[kRowLanes][kColTile];
  int64_t c = int64_t(blockIdx.x) * kColTile + threadIdx.x;
  int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  int64_t r1 = min(M, r0 + rows_per_chunk);
  float a = 0.f, b = 0.f;
  if (c < C) {
    float mu = MODE == Mode::Sum ? 0.f : mean[c];
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      float v = to_f(x[r * C + c]);
      if (MODE == Mode::Sum) {
        a += v;
      } else if (MODE == Mode::SqDev) {
        float d = v - mu;
        a += d * d;
      } else {
        float g = to_f(dy[r * C + c]);
        a += g;
        b += g * (v - mu);
      }
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

__device__ inline double2 sum_chunks(const float2* partials, int chunks, int64_t C, int64_t c) {
  double a = 0.0, b = 0.0;
  for (int k = 0; k < chunks; ++k) {
    float2 p = partials[int64_t(k) * C + c];
    a += p.x;
    b += p.y;
  }
  return make_double2(a, b);
}

__global__ void bn_mean_k(const float2* partials, int chunks, int64_t M, int64_t C, float* mean) {
  DTRAIN_GRID_STRIDE(c, C) mean[c] = float(sum_chunks(partials, chunks, C, c).x / double(M));
}

__global__ void bn_var_k(const float2* partials, int chunks, int64_t M, int64_t C,
                         const float* mean, float* invstd, float* running_mean,
                         float* running_var, float momentum, float eps) {
  DTRAIN_GRID_STRIDE(c, C) {
    double ss = sum_chunks(partials, chunks, C, c).x;
    float var = float(ss / double(M));
    invstd[c] = 1.f / sqrtf(var + eps);
    float unbiased = M > 1 ? float(ss / double(M - 1)) : var;
    running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * mean[c];
    running_var[c] = (1.f - momentum) * running_var[c] + momentum * unbiased;
  }
}

// y = (x - mean) * invstd * gamma + beta;   x, y [M,C]
template <typename T>
__global__ void bn_apply_k(const T* x, T* y, int64_t M, int64_t C, const float* mean,
                           const float* invstd, bool var_is_raw, float eps, const void* gamma,
                           const void* beta, DType tp) {
  DTRAIN_GRID_STRIDE(i, M * C) {
    int64_t c = i % C;
    float is = var_is_raw ? 1.f / sqrtf(invstd[c] + eps) : invstd[c];
    float v = (to_f(x[i]) - mean[c]) * is * load_any(gamma, tp, c) + load_any(beta, tp, c);
    y[i] = from_f<T>(v);
  }
}

// dgamma/dbeta (optionally accumulated) and the per-channel sums dx needs.
__global__ void bn_bwd_sums_k(const float2* partials, int chunks, int64_t C,
                              const float* invstd, void* dgamma, void* dbeta, DType tg,
                              bool accumulate, float* sum_dy, float* sum_dy_xmu) {
  DTRAIN_GRID_STRIDE(c, C) {
    double2 s = sum_chunks(partials, chunks, C, c);
    sum_dy[c] = float(s.x);
    sum_dy_xmu[c] = float(s.y);
    float dg = float(s.y) * invstd[c];
    float db = float(s.x);
    if (dgamma) store_any(dgamma, tg, c, accumulate ? load_any(dgamma, tg, c) + dg : dg);
    if (dbeta) store_any(dbeta, tg, c, accumulate ? load_any(dbeta, tg, c) + db : db);
  }
}

template <typename T>
__global__ void bn_dx_k(const T* dy, const T* x, T* dx, int64_t M, int64_t C, const void* gamma,
                        DType tp, const float* mean, const float* invstd, const float* sum_dy,
                        const float* sum_dy_xmu) {
  float inv_m = 1.f / float(M);
  DTRAIN_GRID_STRIDE(i, M * C) {
    int64_t c = i % C;
    float is = invstd[c];
    float xmu = to_f(x[i]) - mean[c];
    float g = to_f(dy[i]) - sum_dy[c] * inv_m - xmu * is * is * sum_dy_xmu[c] * inv_m;
    dx[i] = from_f<T>(load_any(gamma, tp, c) * is * g);
  }
}

}  // namespace

size_t bn_scratch_bytes(int64_t M, int64_t C) {
  return colsum_scratch_bytes(M, C) + size_t(2 * C) * sizeof(float);
}

void bn_fwd_train(const void* x, DType tx, int64_t M, int64_t C, const void* gamma,
                  const void* beta, DType tp, void* y, float* running_mean, float* running_var,
                  float* save_mean, float* save_invstd, float momentum, float eps, void* scratch,
                  cudaStream_t s) {
  int chunks = colsum_chunks(M, C);
  int64_t rows = (M + chunks - 1) / chunks;
  float2* partials = static_cast<float2*>(scratch);
  dim3 grid(unsigned((C + kColTile - 1) / kColTile), unsigned(chunks)), block(kColTile, kRowLanes);
  dispatch_float(tx, [&](auto tag) {
    using T = decltype(tag);
    const T* xt = static_cast<const T*>(x);
    bn_partial_k<T, Mode::Sum><<<grid, block, 0, s>>>(xt, nullptr, nullptr, M, C, rows, partials);
    bn_mean_k<<<grid_for(C), kThreads, 0, s>>>(partials, chunks, M, C, save_mean);
    bn_partial_k<T, Mode::SqDev><<<grid, block, 0, s>>>(xt, nullptr, save_mean, M, C, rows, partials);
    bn_var_k<<<grid_for(C), kThreads, 0, s>>>(partials, chunks, M, C, save_mean, save_invstd,
                                              running_mean, running_var, momentum, eps);
    bn_apply_k<T><<<grid_for(M * C), kThreads, 0, s>>>(xt, static_cast<T*>(y), M, C, save_mean,
                                                      save_invstd, false, eps, gamma, beta, tp);
  });
}

void bn_fwd_eval(const void* x, DType tx, int64_t M, int64_t C, const void* gamma,
                 const void* beta, DType tp, const float* running_mean, const float* running_var,
                 void* y, float eps, cudaStream_t s) {
  dispatch_float(tx, [&](auto tag) {
    using T = decltype(tag);
    bn_apply_k<T><<<grid_for(M * C), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y),
                                                      M, C, running_mean, running_var, true, eps,
                                                      gamma, beta, tp);
  });
}

void bn_bwd(const void* dy, const void* x, DType tx, int64_t M, int64_t C, const void* gamma,
            DType tp, const float* save_mean, const float* save_invstd, void* dx, void* dgamma,
            void* dbeta, DType tg, bool accumulate, void* scratch, cudaStream_t s) {
  int chunks = colsum_chunks(M, C);
  int64_t rows = (M + chunks - 1) / chunks;
  float2* partials = static_cast<float2*>(scratch);
  float* sums = reinterpret_cast<float*>(static_cast<char*>(scratch) + colsum_scratch_bytes(M, C));
  dim3 grid(unsigned((C + kColTile - 1) / kColTile), unsigned(chunks)), block(kColTile, kRowLanes);
  dispatch_float(tx, [&](auto tag) {
    using T = decltype(tag);
    bn_partial_k<T, Mode::Bwd><<<grid, block, 0, s>>>(static_cast<const T*>(x),
                                                      static_cast<const T*>(dy), save_mean, M, C,
                                                      rows, partials);
    bn_bwd_sums_k<<<grid_for(C), kThreads, 0, s>>>(partials, chunks, C, save_invstd, dgamma, dbeta,
                                                   tg, accumulate, sums, sums + C);
    if (dx)
      bn_dx_k<T><<<grid_for(M * C), kThreads, 0, s>>>(static_cast<const T*>(dy),
                                                     static_cast<const T*>(x), static_cast<T*>(dx),
                                                     M, C, gamma, tp, save_mean, save_invstd, sums,
                                                     sums + C);
  });
}

}  // namespace dtrain::cuda_kernels

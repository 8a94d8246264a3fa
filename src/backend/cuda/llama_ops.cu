// The Llama family's kernels: RMS norm (forward with the residual add fused, backward with the
// residual sum and the weight gradient), rotary position embedding, SwiGLU. Plain kernels after
// the CPU reference (cpu_llama.cpp): one warp per row for the norms, one thread per element
// (pair, for RoPE) elsewhere.
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/llama_kernels.h"

namespace dtrain::cuda_kernels {
namespace {

constexpr int kRowsPerBlock = kThreads / 32;  // one warp per row
constexpr int kColTile = 32, kRowLanes = 8, kRowsPerChunk = 64;

int rms_chunks(int64_t M) { return int((M + kRowsPerChunk - 1) / kRowsPerChunk); }

template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_f(from_f<T>(v)); }

// y = x * rstd * w per row (with res: the row is h = x + res rounded to T, written to h first).
template <typename T>
__global__ void rms_fwd_k(const T* x, const T* res, T* h, int64_t M, int64_t C, const void* w, DType tw, T* y,
                          float* rstd, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= M) return;  // whole warps leave together
  const T* xr = x + row * C;
  float ss = 0.f;
  for (int64_t j = lane; j < C; j += 32) {
    float v = to_f(xr[j]);
    if (res) {
      v = round_to<T>(v + to_f(res[row * C + j]));
      h[row * C + j] = from_f<T>(v);  // read back below by this lane only
    }
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float q = rsqrtf(ss / float(C) + eps);
  const T* src = res ? h + row * C : xr;
  for (int64_t j = lane; j < C; j += 32) y[row * C + j] = from_f<T>((to_f(src[j]) * q) * load_any(w, tw, j));
  if (lane == 0) rstd[row] = q;
}

// dx = rstd * (dy w - xhat * mean(dy w xhat)) per row; acc: dx += that rounded to T.
template <typename T>
__global__ void rms_bwd_dx_k(const T* dy, const T* x, int64_t M, int64_t C, const void* w, DType tw,
                             const float* rstd, T* dx, bool acc) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= M) return;
  const T* gr = dy + row * C;
  const T* xr = x + row * C;
  const float q = rstd[row];
  float s = 0.f;
  for (int64_t j = lane; j < C; j += 32) s += to_f(gr[j]) * load_any(w, tw, j) * (to_f(xr[j]) * q);
  const float b = warp_sum(s) / float(C);
  T* o = dx + row * C;
  for (int64_t j = lane; j < C; j += 32) {
    const float v = q * (to_f(gr[j]) * load_any(w, tw, j) - (to_f(xr[j]) * q) * b);
    o[j] = acc ? from_f<T>(round_to<T>(v) + to_f(o[j])) : from_f<T>(v);
  }
}

// partials[chunk*C + c] = sum of dy * xhat over the chunk's rows.
template <typename T>
__global__ void rms_bwd_partial_k(const T* dy, const T* x, int64_t M, int64_t C, const float* rstd, float* partials) {
  __shared__ float sa[kRowLanes][kColTile];
  const int64_t c = int64_t(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kRowsPerChunk;
  const int64_t r1 = min(M, r0 + kRowsPerChunk);
  float a = 0.f;
  if (c < C)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) a += to_f(dy[r * C + c]) * (to_f(x[r * C + c]) * rstd[r]);
  sa[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.f;
    for (int k = 0; k < kRowLanes; ++k) t += sa[k][threadIdx.x];
    partials[int64_t(blockIdx.y) * C + c] = t;
  }
}

__global__ void rms_bwd_final_k(const float* partials, int chunks, int64_t C, void* dw, DType tg, bool accumulate) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double a = 0;
  for (int k = 0; k < chunks; ++k) a += partials[int64_t(k) * C + c];
  store_any(dw, tg, c, float((accumulate ? load_any(dw, tg, c) : 0.f) + a));
}

// One thread per rotated pair or copied value of each row.
template <typename T>
__global__ void rope_k(const T* x, T* y, int64_t rows, int64_t T_, int64_t W, int rot, int64_t half, const float* cs,
                       const float* sn, int64_t P, const int32_t* pos, float sign) {
  const int64_t pairs = int64_t(rot) * half, per_row = pairs + (W - 2 * pairs);
  DTRAIN_GRID_STRIDE(idx, rows * per_row) {
    const int64_t row = idx / per_row, k = idx % per_row;
    const T* xr = x + row * W;
    T* yr = y + row * W;
    if (k >= pairs) {  // the values' columns
      const int64_t col = 2 * pairs + (k - pairs);
      yr[col] = xr[col];
      continue;
    }
    const int64_t hd = k / half, j = k % half, a_col = hd * 2 * half + j, b_col = a_col + half;
    const int64_t p = pos ? pos[row] : row % T_;
    const float a = to_f(xr[a_col]), b = to_f(xr[b_col]);
    if (p < 0 || p >= P) {
      yr[a_col] = yr[b_col] = from_f<T>(NAN);
      continue;
    }
    const float c = cs[p * half + j], s = sign * sn[p * half + j];
    yr[a_col] = from_f<T>(a * c - b * s);
    yr[b_col] = from_f<T>(b * c + a * s);
  }
}

template <typename T>
__global__ void swiglu_fwd_k(const T* gu, T* y, int64_t M, int64_t I) {
  DTRAIN_GRID_STRIDE(idx, M * I) {
    const int64_t i = idx / I, j = idx % I;
    const float g = to_f(gu[i * 2 * I + j]), u = to_f(gu[i * 2 * I + I + j]);
    y[idx] = from_f<T>(g / (1.f + expf(-g)) * u);
  }
}

template <typename T>
__global__ void swiglu_bwd_k(const T* gu, const T* dy, T* dgu, int64_t M, int64_t I) {
  DTRAIN_GRID_STRIDE(idx, M * I) {
    const int64_t i = idx / I, j = idx % I;
    const float g = to_f(gu[i * 2 * I + j]), u = to_f(gu[i * 2 * I + I + j]), d = to_f(dy[idx]);
    const float sg = 1.f / (1.f + expf(-g));
    dgu[i * 2 * I + j] = from_f<T>(d * u * (sg * (1.f + g * (1.f - sg))));
    dgu[i * 2 * I + I + j] = from_f<T>(d * (g * sg));
  }
}

}  // namespace

void rmsnorm_fwd(const void* x, const void* res, void* h, DType t, int64_t M, int64_t C, const void* w, DType tw,
                 void* y, float* rstd, float eps, cudaStream_t s) {
  if (M == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    const unsigned blocks = unsigned((M + kRowsPerBlock - 1) / kRowsPerBlock);
    rms_fwd_k<T><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<const T*>(res), static_cast<T*>(h),
                                             M, C, w, tw, static_cast<T*>(y), rstd, eps);
  });
}

size_t rmsnorm_bwd_scratch_bytes(int64_t M, int64_t C) { return size_t(rms_chunks(M)) * size_t(C) * sizeof(float); }

void rmsnorm_bwd(const void* dy, const void* x, DType t, int64_t M, int64_t C, const void* w, DType tw,
                 const float* rstd, void* dx, bool accumulate_dx, void* dw, DType tg, bool accumulate, void* scratch,
                 cudaStream_t s) {
  if (M == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    const T* gp = static_cast<const T*>(dy);
    const T* xp = static_cast<const T*>(x);
    if (dx) {
      const unsigned blocks = unsigned((M + kRowsPerBlock - 1) / kRowsPerBlock);
      rms_bwd_dx_k<T><<<blocks, kThreads, 0, s>>>(gp, xp, M, C, w, tw, rstd, static_cast<T*>(dx), accumulate_dx);
    }
    if (dw) {
      const int chunks = rms_chunks(M);
      dim3 grid(unsigned((C + kColTile - 1) / kColTile), unsigned(chunks));
      rms_bwd_partial_k<T><<<grid, dim3(kColTile, kRowLanes), 0, s>>>(gp, xp, M, C, rstd, static_cast<float*>(scratch));
      rms_bwd_final_k<<<grid_for(C), kThreads, 0, s>>>(static_cast<const float*>(scratch), chunks, C, dw, tg, accumulate);
    }
  });
}

void rope(const void* x, void* y, DType t, int64_t B, int64_t T, int64_t W, int rot, int64_t half, const float* cos,
          const float* sin, int64_t P, const int32_t* pos, float sign, cudaStream_t s) {
  const int64_t rows = B * T, per_row = W - int64_t(rot) * half;
  if (rows * per_row == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T_ = decltype(tag);
    rope_k<T_><<<grid_for(rows * per_row), kThreads, 0, s>>>(static_cast<const T_*>(x), static_cast<T_*>(y), rows, T,
                                                              W, rot, half, cos, sin, P, pos, sign);
  });
}

void swiglu_fwd(const void* gu, void* y, DType t, int64_t M, int64_t I, cudaStream_t s) {
  if (M * I == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    swiglu_fwd_k<T><<<grid_for(M * I), kThreads, 0, s>>>(static_cast<const T*>(gu), static_cast<T*>(y), M, I);
  });
}

void swiglu_bwd(const void* gu, const void* dy, void* dgu, DType t, int64_t M, int64_t I, cudaStream_t s) {
  if (M * I == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    swiglu_bwd_k<T><<<grid_for(M * I), kThreads, 0, s>>>(static_cast<const T*>(gu), static_cast<const T*>(dy),
                                                          static_cast<T*>(dgu), M, I);
  });
}

}  // namespace dtrain::cuda_kernels

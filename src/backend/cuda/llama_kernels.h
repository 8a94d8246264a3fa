#pragma once
// Launchers for the Llama family's kernels (llama_ops.cu); host/nvcc-shared header like
// gpt_kernels.h. Float tensors may be F32, BF16 or F16 (`t` for activations, `tw` for the norm
// weight, `tg` for its gradient); math in f32. Deterministic: warp sums in a fixed butterfly
// order, column sums in two passes (per-chunk partials, then the chunks in order). No atomics.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace dtrain::cuda_kernels {

// ---- RMS norm over rows of x [M,C]; rstd f32 [M] ----
// res, h: null, or the rows are h = x + res (rounded to t, written to h) before normalising.
void rmsnorm_fwd(const void* x, const void* res, void* h, DType t, int64_t M, int64_t C, const void* w, DType tw,
                 void* y, float* rstd, float eps, cudaStream_t s);
size_t rmsnorm_bwd_scratch_bytes(int64_t M, int64_t C);
// dx may be null (accumulate_dx: dx += the gradient rounded to t); dw may be null (accumulate:
// into dw). scratch: rmsnorm_bwd_scratch_bytes when dw is given.
void rmsnorm_bwd(const void* dy, const void* x, DType t, int64_t M, int64_t C, const void* w, DType tw,
                 const float* rstd, void* dx, bool accumulate_dx, void* dw, DType tg, bool accumulate, void* scratch,
                 cudaStream_t s);

// ---- RoPE over rows of x [B*T, W]: the first `rot` heads of 2*half columns rotated by the
// angle of position pos[row] (null: row % T) with cos/sin f32 [P, half] (sign -1: the inverse
// rotation), the other columns copied; y may alias x. A position outside [0, P) makes the
// row's rotated values NaN.
void rope(const void* x, void* y, DType t, int64_t B, int64_t T, int64_t W, int rot, int64_t half, const float* cos,
          const float* sin, int64_t P, const int32_t* pos, float sign, cudaStream_t s);

// ---- SwiGLU: gu [M, 2I] = gate | up per row; y [M, I]; dgu [M, 2I] ----
void swiglu_fwd(const void* gu, void* y, DType t, int64_t M, int64_t I, cudaStream_t s);
void swiglu_bwd(const void* gu, const void* dy, void* dgu, DType t, int64_t M, int64_t I, cudaStream_t s);

}  // namespace dtrain::cuda_kernels

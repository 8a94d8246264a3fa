#pragma once
// Launchers for the U-Net kernels (unet_ops.cu); raw pointers only (shared by nvcc and
// the host compiler). Validation happens in unet_ops.cpp.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace dtrain::cuda_kernels {

// x [N,H,W,C] -> y [N,2H,2W,C] and back (gather backward).
void upsample2x_fwd(const void* x, void* y, DType t, int N, int H, int W, int C, cudaStream_t s);
void upsample2x_bwd(const void* dy, void* dx, DType t, int N, int H, int W, int C, cudaStream_t s);
// rows x (Ca + Cb) <-> rows x Ca, rows x Cb; elem_size bytes per element.
void concat_rows(const void* a, const void* b, void* y, int64_t rows, int64_t Ca, int64_t Cb,
                 size_t elem_size, cudaStream_t s);
void split_rows(const void* y, void* a, void* b, int64_t rows, int64_t Ca, int64_t Cb,
                size_t elem_size, cudaStream_t s);
// Soft Dice. `partials` holds dice_partial_count(P, K) doubles; `coef` 2K+1 floats
// (A_k, B_k, loss). K <= kDiceMaxClasses.
constexpr int kDiceMaxClasses = 64;
int64_t dice_partial_count(int64_t P, int K);
void softmax_dice(const void* logits, DType t, int64_t P, int K, const int32_t* labels,
                  float smooth, float grad_scale, double* partials, float* coef, void* dlogits,
                  cudaStream_t s);

}  // namespace dtrain::cuda_kernels

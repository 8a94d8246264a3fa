#pragma once
// Launchers for the mixture-of-experts kernels (moe_ops.cu); host/nvcc-shared header like
// llama_kernels.h. Activations F32, BF16 or F16 (`t`); router statistics f32; math in f32.
// Deterministic: every sum in a fixed order, no atomics. Plain kernels after the CPU reference
// (cpu_moe.cpp); the dispatch plan runs one thread per expert (E is small), not tuned.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace dtrain::cuda_kernels {

// Backend::moe_route_fwd's arrays for logits [N,E] of dtype t.
void moe_route_fwd(const void* logits, DType t, int64_t N, int64_t E, int k, bool norm_topk, int64_t capacity,
                   float* probs, float* lse, int32_t* sel, float* weights, int32_t* counts, int32_t* order,
                   int32_t* pos, float* stats, cudaStream_t s);
// Backend::moe_route_bwd; paux may be null; dlogits of dtype t; scratch f32 [N,E].
void moe_route_bwd(const float* probs, const float* lse, const int32_t* sel, const float* weights,
                   const float* dweights, const float* paux, float zscale, bool norm_topk, int64_t N, int64_t E, int k,
                   void* dlogits, DType t, cudaStream_t s, float* scratch);
void moe_gather(const void* x, const int32_t* order, int k, int64_t M, int64_t C, void* y, DType t, cudaStream_t s);
// weights may be null (1)
void moe_combine(const void* ye, const int32_t* pos, const float* weights, int k, int64_t N, int64_t C, void* y,
                 bool accumulate, DType t, cudaStream_t s);
void moe_combine_bwd(const void* dy, const void* ye, const int32_t* pos, const float* weights, int k, int64_t N,
                     int64_t C, void* dye, float* dweights, DType t, cudaStream_t s);

}  // namespace dtrain::cuda_kernels

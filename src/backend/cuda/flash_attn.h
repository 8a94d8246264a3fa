#pragma once
// Launchers of the flash attention kernels (flash_attn.cu): fused causal self-attention
// forward and backward for bf16/f16 on tensor cores (mma.sync m16n8k16, f32 accumulation),
// scale 1/sqrt(hs), multi-head or grouped-query (H query heads, Hkv key/value heads; query
// head h reads key/value head h / (H / Hkv)). Layouts as Backend::attention_fwd:
// qkv [B,T,(H + 2 Hkv) hs] (q | k | v, head i at columns i*hs of its part), out/dout [B,T,H hs],
// dqkv like qkv; lse and dsum [B,H,T] f32.
// Every pointer must be 16-byte aligned (the CUDA allocator gives 256). Deterministic: no
// atomics; every sum has a fixed order. Host/nvcc-shared header like kernels.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace dtrain::cuda_kernels {

// Query/key tile sizes (rows) of every flash kernel; one warp owns 16 rows of a tile.
constexpr int kFlashTile = 64;

// True when the flash kernels handle dtype t (bf16, f16) and head size hs (16/32/64/128).
bool flash_attn_supported(DType t, int64_t hs);

// out = softmax(q k^T / sqrt(hs), causal) v; lse[b,h,t] = log sum_{s<=t} exp(q_t.k_s/sqrt(hs)).
// docpos (i32 [B,T] or null): packed documents, query t seeing keys t - docpos[b,t] .. t only
// (variable-length attention; the sums above start there), in every kernel below.
void flash_attn_fwd(const void* qkv, void* out, float* lse, const int32_t* docpos, DType t, int64_t B,
                    int64_t T, int64_t H, int64_t Hkv, int64_t hs, cudaStream_t s);

// Backward, three launches in stream order:
//   dsum[b,h,t] = sum_j dout[b,t,h*hs+j] * out[b,t,h*hs+j]
//   dk, dv of dqkv (one block per key tile and key/value head; loops over the group's query
//   heads and, for each, the query tiles at and after it)
//   dq of dqkv (one block per query tile; loops over the key tiles up to the diagonal)
void flash_attn_bwd_dsum(const void* dout, const void* out, float* dsum, DType t, int64_t B,
                         int64_t T, int64_t H, int64_t hs, cudaStream_t s);
void flash_attn_bwd_dkdv(const void* dout, const void* qkv, const float* lse, const float* dsum,
                         const int32_t* docpos, void* dqkv, DType t, int64_t B, int64_t T, int64_t H,
                         int64_t Hkv, int64_t hs, cudaStream_t s);
void flash_attn_bwd_dq(const void* dout, const void* qkv, const float* lse, const float* dsum,
                       const int32_t* docpos, void* dqkv, DType t, int64_t B, int64_t T, int64_t H,
                       int64_t Hkv, int64_t hs, cudaStream_t s);

}  // namespace dtrain::cuda_kernels

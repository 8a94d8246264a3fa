#pragma once
// Launchers for the GPT kernels (gpt_ops.cu); host/nvcc-shared header like kernels.h. The
// Llama family's own kernels are llama_kernels.h.
// Float tensors may be F32, BF16 or F16 (`t` for activations, `tp` for parameter-like
// vectors and embedding tables, `tg` for their gradients); math and accumulation are f32
// (row statistics of layer norm and column sums in double). No float atomics anywhere.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace dtrain::cuda_kernels {

// ---- layer norm over rows of x [M,C]; mean/rstd f32 [M] ----
// res, h: null, or the rows are h = x + res (rounded to t, written to h) before normalising.
void layernorm_fwd(const void* x, const void* res, void* h, DType t, int64_t M, int64_t C, const void* gamma,
                   const void* beta, DType tp, void* y, float* mean, float* rstd, float eps,
                   cudaStream_t s);
size_t layernorm_bwd_scratch_bytes(int64_t M, int64_t C);
// dx may be null; dgamma/dbeta may be null (then their partials are skipped). accumulate:
// into dgamma/dbeta; accumulate_dx: dx += the gradient rounded to t.
void layernorm_bwd(const void* dy, const void* x, DType t, int64_t M, int64_t C,
                   const void* gamma, DType tp, const float* mean, const float* rstd, void* dx,
                   void* dgamma, void* dbeta, DType tg, bool accumulate, bool accumulate_dx,
                   void* scratch, cudaStream_t s);

// ---- GELU (tanh approximation) ----
void gelu_fwd(const void* x, void* y, DType t, int64_t n, cudaStream_t s);
void gelu_bwd(const void* x, const void* dy, void* dx, DType t, int64_t n, cudaStream_t s);

// ---- embedding: ids i32 [B*T]; ids outside [0,V) give zero rows (fwd) / are skipped; wpe
// null: no position embedding ----
void embedding_fwd(const int32_t* ids, int64_t B, int64_t T, const void* wte, int64_t V,
                   const void* wpe, DType tp, int64_t C, void* y, DType t, cudaStream_t s);
// flags: V ints of scratch. dwte or dwpe may be null.
// Scratch embedding_bwd needs for N = B*T positions (sorted ids and positions, sort temp).
size_t embedding_bwd_ws_bytes(int64_t N);
void embedding_bwd(const void* dy, DType t, const int32_t* ids, int64_t B, int64_t T, int64_t C,
                   void* dwte, int64_t V, void* dwpe, int64_t Tmax, DType tg, bool accumulate,
                   void* ws, size_t ws_bytes, cudaStream_t s);

// ---- attention helpers over rows of [R = B*H*T, T] matrices (row r has t = r % T); these and
// attention_decode are attention.cu. docpos (i32 [B,T] or null): packed documents, row r's
// keys start at t - docpos[b,t] (zeros before) ----
// p = causal softmax(scale * p) in place (zeros above the diagonal).
void causal_softmax(void* p, const int32_t* docpos, DType t, int64_t R, int64_t T, int64_t H, float scale,
                    cudaStream_t s);
// dp <- p * (dp - sum_j p*dp) * scale in place.
void causal_softmax_bwd(const void* p, void* dp, const int32_t* docpos, DType t, int64_t R, int64_t T, int64_t H,
                        float scale, cudaStream_t s);

// ---- one decoding step against a K/V cache [B,Hkv,Tmax,hs]; qkv [B,(H + 2 Hkv) hs], out
// [B,H hs] (query head h reads key/value head h / (H / Hkv)) ----
// Needs (pos + 1) * 4 bytes of shared memory (pos < 12288).
void attention_decode(const void* qkv, void* kcache, void* vcache, void* out, DType t, int64_t B,
                      int64_t H, int64_t Hkv, int64_t hs, int64_t Tmax, int64_t pos, cudaStream_t s);

// ---- masked cross-entropy: one block per row, columns >= V get dlogits 0 ----
void softmax_xent_masked(const void* logits, DType t, int64_t N, int64_t Cp, int64_t V,
                         const int32_t* labels, float grad_scale, float* losses, void* dlogits,
                         cudaStream_t s);

// ---- vocabulary-parallel cross-entropy (vocab_xent.cu): one block per row of logits [N,Vl] ----
void vocab_xent_max(const void* logits, DType t, int64_t N, int64_t Vl, int64_t valid, float* mx, cudaStream_t s);
// labels outside [0, classes): the row's parts[,1] is NaN (its loss and gradient follow)
void vocab_xent_parts(const void* logits, DType t, int64_t N, int64_t Vl, int64_t valid, const int32_t* labels,
                      int64_t offset, int64_t classes, const float* gmax, float* parts, cudaStream_t s);
void vocab_xent_finish(const void* logits, DType t, int64_t N, int64_t Vl, int64_t valid, const int32_t* labels,
                       int64_t offset, const float* gmax, const float* sums, float grad_scale, float* losses,
                       void* dlogits, cudaStream_t s);

}  // namespace dtrain::cuda_kernels

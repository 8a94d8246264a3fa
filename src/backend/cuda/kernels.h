#pragma once
// Launchers for dtrain's own CUDA kernels (implemented in the .cu files of this folder).
// This header is shared by nvcc and the host compiler, so it uses raw pointers and plain
// types only (no fmt, no Tensor). The CudaBackend member functions (.cpp) validate shapes
// and dtypes, call these, then check the launch with DTRAIN_KERNEL_CHECK.
// Float tensors may be F32, BF16 or F16 unless a comment says otherwise; math is f32.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace dtrain::cuda_kernels {

// ---- elementwise.cu ----
void fill(void* y, DType t, int64_t n, float v, cudaStream_t s);
void cast(const void* x, DType tx, void* y, DType ty, int64_t n, cudaStream_t s);
void add(const void* a, const void* b, void* y, DType t, int64_t n, cudaStream_t s);
void axpby(float alpha, const void* x, float beta, void* y, DType t, int64_t n, cudaStream_t s);
void scale(void* y, DType t, int64_t n, float v, cudaStream_t s);
void relu_fwd(const void* x, void* y, DType t, int64_t n, cudaStream_t s);
void relu_bwd(const void* y, const void* dy, void* dx, DType t, int64_t n, cudaStream_t s);
// y [M,N] (dtype ty) += bias [N] (dtype tb)
void add_bias(void* y, DType ty, const void* bias, DType tb, int64_t M, int64_t N, cudaStream_t s);

// ---- reductions (elementwise.cu) ----
// Deterministic: a fixed number of blocks (a function of n only) write per-block double
// partials to `partials` (>= kReduceBlocks entries), then one block sums them in order.
constexpr int kReduceBlocks = 1024;
// *out = (accumulate ? *out : 0) + scale * sum of x (or of x^2 when square); partials:
// kReduceBlocks doubles. Deterministic: fixed grid, fixed-order final sum.
void sum_squares(const void* x, DType t, int64_t n, double* partials, double* out, cudaStream_t s,
                 bool square, double scale = 1.0, bool accumulate = false);
// *flag (device int, zeroed by this call) becomes 1 when x holds a NaN or Inf.
void all_finite(const void* x, DType t, int64_t n, int* flag, cudaStream_t s);

// Column sums of a row-major [M,N] matrix, deterministic (fixed-order two-pass). The first
// pass writes colsum_rows(M,N) x N float2 partials into `partials`.
int colsum_chunks(int64_t M, int64_t N);
size_t colsum_scratch_bytes(int64_t M, int64_t N);
// y [N] (dtype ty) = (accumulate ? y : 0) + sum over rows of x [M,N] (dtype tx)
void sum_rows(const void* x, DType tx, int64_t M, int64_t N, void* y, DType ty, bool accumulate,
              void* scratch, cudaStream_t s);

// ---- norm.cu: batch norm over rows of x [M,C] (NHWC flattened), stats f32 [C] ----
// gamma/beta and dgamma/dbeta may be f32 or a 16-bit float dtype (tp / tg). `scratch`:
// bn_scratch_bytes (train, backward) or bn_eval_scratch_bytes (eval) of device memory.
// Forward epilogue: y = relu?(bn(x) + res?) (res null: none); backward: relu_y non-null masks
// dy by relu_y > 0 (the fused ReLU's backward).
size_t bn_scratch_bytes(int64_t M, int64_t C);
size_t bn_eval_scratch_bytes(int64_t C);
void bn_fwd_train(const void* x, DType tx, int64_t M, int64_t C, const void* gamma,
                  const void* beta, DType tp, void* y, float* running_mean, float* running_var,
                  float* save_mean, float* save_invstd, float momentum, float eps, void* scratch,
                  const void* res, bool relu, cudaStream_t s);
void bn_fwd_eval(const void* x, DType tx, int64_t M, int64_t C, const void* gamma,
                 const void* beta, DType tp, const float* running_mean, const float* running_var,
                 void* y, float eps, void* scratch, const void* res, bool relu, cudaStream_t s);
// The fused ReLU's mask for bn_bwd (all null: no ReLU): read from the forward's output y,
// or recomputed from x with beta (gamma's dtype) exactly as bn_apply_k made y; out (may be
// null) receives the masked dy.
struct BnMask {
  const void* y = nullptr;
  const void* beta = nullptr;
  void* out = nullptr;
};
void bn_bwd(const void* dy, const void* x, DType tx, int64_t M, int64_t C, const void* gamma,
            DType tp, const float* save_mean, const float* save_invstd, void* dx, void* dgamma,
            void* dbeta, DType tg, bool accumulate, void* scratch, const BnMask& mask,
            cudaStream_t s);

// ---- pool.cu (NHWC) ----
struct PoolGeom {
  int N, H, W, C, OH, OW;
  int kh, kw, sh, sw, ph, pw;
};
// argmax (u8 like y, may be null): each window's winner as an offset in the window
void maxpool_fwd(const void* x, void* y, uint8_t* argmax, DType t, const PoolGeom& g,
                 cudaStream_t s);
void maxpool_bwd(const uint8_t* argmax, const void* dy, void* dx, DType t, const PoolGeom& g,
                 bool accumulate, cudaStream_t s);
void avgpool_fwd(const void* x, void* y, DType t, const PoolGeom& g, cudaStream_t s);
void avgpool_bwd(const void* dy, void* dx, DType t, const PoolGeom& g, cudaStream_t s);
// x [N,HW,C] -> y [N,C] and back
void global_avgpool_fwd(const void* x, void* y, DType t, int N, int HW, int C, cudaStream_t s);
void global_avgpool_bwd(const void* dy, void* dx, DType t, int N, int HW, int C, cudaStream_t s);

// ---- loss.cu: one block per row; losses f32 [N]; dlogits may be null ----
// A label outside [0,C) yields a NaN loss (and NaN dlogits row): all_finite catches it.
void softmax_xent(const void* logits, DType t, int N, int C, const int32_t* labels,
                  float label_smoothing, float grad_scale, float* losses, void* dlogits,
                  cudaStream_t s);

// ---- optim.cu: flat f32 buffers, one launch over all segments ----
struct DevSegment {
  int64_t offset;  // into params/grads/state
  int64_t count;
  int64_t start;   // prefix sum of counts (position in the virtual concatenation)
  int32_t decay;
  int32_t pad_;
};
struct SgdHyper {
  float lr, momentum, dampening, weight_decay, grad_scale;
  int nesterov, first_step;
};
struct AdamWHyper {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float step_size;    // lr / (1 - beta1^step)
  float bc2_sqrt;     // sqrt(1 - beta2^step)
};
void sgd_step(float* p, const float* g, float* buf, const DevSegment* segs, int nseg,
              int64_t total, const SgdHyper& h, cudaStream_t s);
void adamw_step(float* p, const float* g, float* m, float* v, const DevSegment* segs, int nseg,
                int64_t total, const AdamWHyper& h, cudaStream_t s);

}  // namespace dtrain::cuda_kernels

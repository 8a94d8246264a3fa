// CudaBackend GPT ops: validation + launches of gpt_ops.cu (layer norm, GELU, embedding,
// masked cross-entropy). Attention is attention.cpp.
#include <cstdint>

#include <fmt/format.h>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/expect.h"
#include "backend/cuda/gpt_kernels.h"

namespace dtrain {
namespace k = cuda_kernels;
using namespace cuda_expect;

// ---- layer norm ----
void CudaBackend::layernorm_fwd(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                Tensor& y, Tensor& mean, Tensor& rstd, float eps) {
  Tensor none;
  layernorm_fwd_impl(x, none, none, gamma, beta, y, mean, rstd, eps);
}

void CudaBackend::add_layernorm_fwd(const Tensor& a, const Tensor& b, Tensor& h, const Tensor& gamma,
                                    const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd, float eps) {
  expect_like(b, a.dtype, a.numel(), "add_layernorm_fwd", "b");
  expect_like(h, a.dtype, a.numel(), "add_layernorm_fwd", "h");
  layernorm_fwd_impl(a, b, h, gamma, beta, y, mean, rstd, eps);
}

void CudaBackend::layernorm_fwd_impl(const Tensor& x, const Tensor& res, Tensor& h, const Tensor& gamma,
                                     const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd, float eps) {
  const char* op = res.defined() ? "add_layernorm_fwd" : "layernorm_fwd";
  expect_float(x, op, "x");
  const int64_t C = x.dim(-1), M = C ? x.numel() / C : 0;
  expect_like(y, x.dtype, x.numel(), op, "y");
  expect_param(gamma, C, x.dtype, op, "gamma");
  expect_param(beta, C, x.dtype, op, "beta");
  DTRAIN_CHECK(gamma.dtype == beta.dtype, "{}: gamma {} beta {}", op, gamma.str(), beta.str());
  expect_like(mean, DType::F32, M, op, "mean");
  expect_like(rstd, DType::F32, M, op, "rstd");
  k::layernorm_fwd(x.data, res.data, h.data, x.dtype, M, C, gamma.data, beta.data, gamma.dtype, y.data,
                   mean.f32(), rstd.f32(), eps, stream_);
  DTRAIN_KERNEL_CHECK(what(op, x));
}

void CudaBackend::layernorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dgamma,
                                Tensor& dbeta, bool accumulate, bool accumulate_dx) {
  const char* op = "layernorm_bwd";
  expect_float(x, op, "x");
  const int64_t C = x.dim(-1), M = C ? x.numel() / C : 0;
  expect_like(dy, x.dtype, x.numel(), op, "dy");
  if (dx.defined()) expect_like(dx, x.dtype, x.numel(), op, "dx");
  expect_param(gamma, C, x.dtype, op, "gamma");
  expect_like(mean, DType::F32, M, op, "mean");
  expect_like(rstd, DType::F32, M, op, "rstd");
  DType tg = DType::F32;
  if (dgamma.defined()) expect_param(dgamma, C, x.dtype, op, "dgamma"), tg = dgamma.dtype;
  if (dbeta.defined()) {
    expect_param(dbeta, C, x.dtype, op, "dbeta");
    DTRAIN_CHECK(!dgamma.defined() || dgamma.dtype == dbeta.dtype, "{}: dgamma {} dbeta {}", op,
                 dgamma.str(), dbeta.str());
    tg = dbeta.dtype;
  }
  void* scratch = (dgamma.defined() || dbeta.defined())
                      ? scratch_.get(k::layernorm_bwd_scratch_bytes(M, C))
                      : nullptr;
  k::layernorm_bwd(dy.data, x.data, x.dtype, M, C, gamma.data, gamma.dtype, mean.f32(), rstd.f32(),
                   dx.data, dgamma.data, dbeta.data, tg, accumulate, accumulate_dx, scratch, stream_);
  DTRAIN_KERNEL_CHECK(what(op, x));
}

// ---- GELU ----
void CudaBackend::gelu_fwd(const Tensor& x, Tensor& y) {
  expect_float(x, "gelu_fwd", "x");
  expect_like(y, x.dtype, x.numel(), "gelu_fwd", "y");
  k::gelu_fwd(x.data, y.data, x.dtype, x.numel(), stream_);
  DTRAIN_KERNEL_CHECK(what("gelu_fwd", x));
}
void CudaBackend::gelu_bwd(const Tensor& x, const Tensor& dy, Tensor& dx) {
  expect_float(x, "gelu_bwd", "x");
  expect_like(dy, x.dtype, x.numel(), "gelu_bwd", "dy");
  expect_like(dx, x.dtype, x.numel(), "gelu_bwd", "dx");
  k::gelu_bwd(x.data, dy.data, dx.data, x.dtype, x.numel(), stream_);
  DTRAIN_KERNEL_CHECK(what("gelu_bwd", x));
}

// ---- embedding ----
void CudaBackend::embedding_fwd(const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                                Tensor& y) {
  const char* op = "embedding_fwd";
  DTRAIN_CHECK(ids.dtype == DType::I32 && ids.ndim() == 2, "{}: ids {} must be i32 [B,T]", op,
               ids.str());
  DTRAIN_CHECK(wte.ndim() == 2 && (!wpe.defined() || (wpe.ndim() == 2 && wte.dim(1) == wpe.dim(1) &&
                                                       wte.dtype == wpe.dtype)),
               "{}: wte {} wpe {}", op, wte.str(), wpe.str());
  expect_float(y, op, "y");
  const int64_t B = ids.dim(0), T = ids.dim(1), C = wte.dim(1);
  if (wpe.defined() && T > wpe.dim(0))
    user_error("embedding: sequence length {} exceeds block_size {}", T, wpe.dim(0));
  DTRAIN_CHECK(y.numel() == B * T * C, "{}: y {} for ids {} and C={}", op, y.str(), ids.str(), C);
  expect_param(wte, wte.numel(), y.dtype, op, "wte");
  k::embedding_fwd(ids.i32(), B, T, wte.data, wte.dim(0), wpe.data, wte.dtype, C, y.data, y.dtype,
                   stream_);
  DTRAIN_KERNEL_CHECK(what(op, y));
}

void CudaBackend::embedding_bwd(const Tensor& dy, const Tensor& ids, Tensor& dwte, Tensor& dwpe,
                                bool accumulate) {
  const char* op = "embedding_bwd";
  DTRAIN_CHECK(ids.dtype == DType::I32 && ids.ndim() == 2, "{}: ids {} must be i32 [B,T]", op,
               ids.str());
  expect_float(dy, op, "dy");
  const int64_t B = ids.dim(0), T = ids.dim(1), C = dy.dim(-1);
  DTRAIN_CHECK(dy.numel() == B * T * C, "{}: dy {} for ids {}", op, dy.str(), ids.str());
  DType tg = DType::F32;
  if (dwte.defined()) {
    DTRAIN_CHECK(dwte.ndim() == 2 && dwte.dim(1) == C, "{}: dwte {}", op, dwte.str());
    expect_param(dwte, dwte.numel(), dy.dtype, op, "dwte");
    tg = dwte.dtype;
  }
  if (dwpe.defined()) {
    DTRAIN_CHECK(dwpe.ndim() == 2 && dwpe.dim(1) == C && dwpe.dim(0) >= T, "{}: dwpe {}", op,
                 dwpe.str());
    expect_param(dwpe, dwpe.numel(), dy.dtype, op, "dwpe");
    DTRAIN_CHECK(!dwte.defined() || dwte.dtype == dwpe.dtype, "{}: dwte {} dwpe {}", op,
                 dwte.str(), dwpe.str());
    tg = dwpe.dtype;
  }
  const int64_t V = dwte.defined() ? dwte.dim(0) : 0;
  const size_t ws_bytes = V ? k::embedding_bwd_ws_bytes(B * T) : 0;
  void* ws = ws_bytes ? scratch_.get(ws_bytes) : nullptr;
  k::embedding_bwd(dy.data, dy.dtype, ids.i32(), B, T, C, dwte.data, V, dwpe.data,
                   dwpe.defined() ? dwpe.dim(0) : 0, tg, accumulate, ws, ws_bytes, stream_);
  DTRAIN_KERNEL_CHECK(what(op, dy));
}

// ---- masked cross-entropy ----
void CudaBackend::softmax_xent_masked(const Tensor& logits, const Tensor& labels,
                                      int64_t valid_classes, float grad_scale, Tensor& losses,
                                      Tensor& dlogits) {
  const char* op = "softmax_xent_masked";
  expect_float(logits, op, "logits");
  DTRAIN_CHECK(logits.ndim() == 2, "{}: logits {} must be [N,C]", op, logits.str());
  const int64_t N = logits.dim(0), Cp = logits.dim(1);
  DTRAIN_CHECK(valid_classes >= 1 && valid_classes <= Cp, "{}: valid_classes {} for logits {}", op,
               valid_classes, logits.str());
  DTRAIN_CHECK(labels.dtype == DType::I32 && labels.numel() == N, "{}: labels {}", op, labels.str());
  if (losses.defined()) expect_like(losses, DType::F32, N, op, "losses");
  if (dlogits.defined()) expect_like(dlogits, logits.dtype, logits.numel(), op, "dlogits");
  k::softmax_xent_masked(logits.data, logits.dtype, N, Cp, valid_classes, labels.i32(), grad_scale,
                         losses.defined() ? losses.f32() : nullptr, dlogits.data, stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
}

namespace {
// The vocabulary-parallel cross-entropy's logits: float [N, V] of which the first `valid` columns
// are real.
void expect_vocab_logits(const Tensor& logits, int64_t valid, const char* op) {
  expect_float(logits, op, "logits");
  DTRAIN_CHECK(logits.ndim() == 2 && valid >= 0 && valid <= logits.dim(1), "{}: {} real columns of logits {}", op,
               valid, logits.str());
}
// ... with labels i32 [N] and the rows' global maxima gmax f32 [N]; returns N.
int64_t expect_vocab_rows(const Tensor& logits, int64_t valid, const Tensor& labels, const Tensor& gmax,
                          const char* op) {
  expect_vocab_logits(logits, valid, op);
  const int64_t N = logits.dim(0);
  DTRAIN_CHECK(labels.dtype == DType::I32 && labels.numel() == N, "{}: labels {}", op, labels.str());
  expect_like(gmax, DType::F32, N, op, "gmax");
  return N;
}
}  // namespace

void CudaBackend::vocab_xent_max(const Tensor& logits, int64_t valid, Tensor& mx) {
  const char* op = "vocab_xent_max";
  expect_vocab_logits(logits, valid, op);
  expect_like(mx, DType::F32, logits.dim(0), op, "mx");
  k::vocab_xent_max(logits.data, logits.dtype, logits.dim(0), logits.dim(1), valid, mx.f32(), stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
}

void CudaBackend::vocab_xent_parts(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                   int64_t classes, const Tensor& gmax, Tensor& parts) {
  const char* op = "vocab_xent_parts";
  const int64_t N = expect_vocab_rows(logits, valid, labels, gmax, op);
  expect_like(parts, DType::F32, 2 * N, op, "parts");
  k::vocab_xent_parts(logits.data, logits.dtype, N, logits.dim(1), valid, labels.i32(), offset, classes, gmax.f32(),
                      parts.f32(), stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
}

void CudaBackend::vocab_xent_finish(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                    const Tensor& gmax, const Tensor& sums, float grad_scale, Tensor& losses,
                                    Tensor& dlogits) {
  const char* op = "vocab_xent_finish";
  const int64_t N = expect_vocab_rows(logits, valid, labels, gmax, op);
  expect_like(sums, DType::F32, 2 * N, op, "sums");
  if (losses.defined()) expect_like(losses, DType::F32, N, op, "losses");
  if (dlogits.defined()) expect_like(dlogits, logits.dtype, logits.numel(), op, "dlogits");
  k::vocab_xent_finish(logits.data, logits.dtype, N, logits.dim(1), valid, labels.i32(), offset, gmax.f32(),
                       sums.f32(), grad_scale, losses.defined() ? losses.f32() : nullptr, dlogits.data, stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
}

}  // namespace dtrain

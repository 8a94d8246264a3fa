// CudaBackend GPT ops: validation + launches of gpt_ops.cu, and causal attention. In bf16/f16
// with a head size of 16/32/64/128 (sm_80+) attention is the flash kernels of flash_attn.cu
// (saved: LSE [B,H,T] f32). Otherwise (f32, other head sizes) it is cuBLASLt strided-batched
// GEMMs (one call per sample b, batched over the H heads: a head's Q/K/V are [T, hs]
// submatrices of qkv with leading dimension 3C at column offset h*hs) around the fused
// causal softmax kernels, with the probabilities [B,H,T,T] materialised and saved.
#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include <fmt/format.h>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/flash_attn.h"
#include "backend/cuda/gpt_kernels.h"
#include "backend/cuda/plans.h"

namespace dtrain {
namespace k = cuda_kernels;
namespace {

cudaDataType_t lt_dtype(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}
void expect_float(const Tensor& t, const char* op, const char* name) {
  DTRAIN_CHECK(t.defined() && is_float(t.dtype) && t.device.is_cuda(),
               "{}: {} must be a float CUDA tensor, got {}", op, name, t.str());
}
void expect_like(const Tensor& t, DType dt, int64_t n, const char* op, const char* name) {
  DTRAIN_CHECK(t.defined() && t.dtype == dt && t.numel() == n && t.device.is_cuda(),
               "{}: {} must be {} with {} elements, got {}", op, name, dtype_name(dt), n, t.str());
}
void expect_param(const Tensor& t, int64_t n, DType act, const char* op, const char* name) {
  DTRAIN_CHECK(t.defined() && (t.dtype == DType::F32 || t.dtype == act) && t.numel() == n,
               "{}: {} must be [{}] elements in f32 or {}, got {}", op, name, n, dtype_name(act),
               t.str());
}
std::string what(const char* op, const Tensor& t) { return fmt::format("{} {}", op, t.str()); }

struct AttnDims {
  int64_t B, T, C, H, hs;
};
AttnDims attn_dims(const char* op, const Tensor& qkv, int n_head) {
  expect_float(qkv, op, "qkv");
  DTRAIN_CHECK(qkv.ndim() == 3 && qkv.dim(2) % 3 == 0 && n_head > 0 &&
                   (qkv.dim(2) / 3) % n_head == 0,
               "{}: qkv {} with n_head {}", op, qkv.str(), n_head);
  const int64_t C = qkv.dim(2) / 3;
  return {qkv.dim(0), qkv.dim(1), C, n_head, C / n_head};
}
// The flash kernels read and write 16-byte chunks and index with int rows/tiles.
void expect_flash_args(const AttnDims& a, std::initializer_list<const Tensor*> ts,
                       const char* op) {
  for (const Tensor* t : ts)
    DTRAIN_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
                 "{}: flash attention needs 16-byte aligned tensors, got {} at {}", op, t->str(),
                 t->data);
  DTRAIN_CHECK(a.T <= 65535LL * k::kFlashTile && a.B <= 65535 && a.H <= INT_MAX,
               "{}: B={} T={} H={} outside the flash attention launch grid", op, a.B, a.T, a.H);
}

}  // namespace

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
  DTRAIN_CHECK(wte.ndim() == 2 && wpe.ndim() == 2 && wte.dim(1) == wpe.dim(1) &&
                   wte.dtype == wpe.dtype,
               "{}: wte {} wpe {}", op, wte.str(), wpe.str());
  expect_float(y, op, "y");
  const int64_t B = ids.dim(0), T = ids.dim(1), C = wte.dim(1);
  if (T > wpe.dim(0))
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

// ---- attention ----
// Row-major strided-batched C[i] = alpha * op(A[i]) op(B[i]) + beta * C[i], i < batch, with
// explicit leading dimensions (row strides) and batch strides, all in dtype t (f32 compute).
// Column-major trick as in gemm.cpp: C^T = op(B)^T op(A)^T.
static void bgemm(CudaBackend& be, cublasLtHandle_t lt, GemmPlan& plan, const void* A,
                  const void* B, void* C, float alpha, float beta, void* ws, cudaStream_t s,
                  const std::string& what) {
  DTRAIN_CUBLAS_CHECK(cublasLtMatmul(lt, plan.desc, &alpha, B, plan.la, A, plan.lb, &beta, C,
                                     plan.lc, C, plan.lc, &plan.algo, ws, plan.workspace, s),
                      what);
}

namespace {
struct BgemmShape {
  bool ta, tb;
  int64_t M, N, K, lda, ldb, ldc, sa, sb, sc;
  int batch;
};
}  // namespace

static GemmPlan& bgemm_plan(std::unordered_map<std::string, std::unique_ptr<GemmPlan>>& cache,
                            cublasLtHandle_t lt, const BgemmShape& g, DType t, size_t ws_bytes) {
  std::string key = fmt::format("bgemm {}{} {} {} {} {} {} {} {} {} {} {} {}", int(g.ta),
                                int(g.tb), g.M, g.N, g.K, g.lda, g.ldb, g.ldc, g.sa, g.sb, g.sc,
                                g.batch, dtype_name(t));
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  auto plan = std::make_unique<GemmPlan>();
  const std::string& w = key;
  DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), w);
  cublasOperation_t op1 = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, op2 = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op1,
                                                     sizeof(op1)), w);
  DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op2,
                                                     sizeof(op2)), w);
  const cudaDataType_t dt = lt_dtype(t);
  const uint64_t r1 = g.tb ? g.K : g.N, c1 = g.tb ? g.N : g.K;  // operand b, col-major
  const uint64_t r2 = g.ta ? g.M : g.K, c2 = g.ta ? g.K : g.M;  // operand a, col-major
  DTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->la, dt, r1, c1, g.ldb), w);
  DTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, dt, r2, c2, g.lda), w);
  DTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lc, dt, g.N, g.M, g.ldc), w);
  const std::pair<cublasLtMatrixLayout_t, int64_t> strides[] = {
      {plan->la, g.sb}, {plan->lb, g.sa}, {plan->lc, g.sc}};
  for (auto& [l, st] : strides) {
    int32_t n = g.batch;
    int64_t stv = st;
    DTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n,
                                                         sizeof(n)), w);
    DTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
                            l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stv, sizeof(stv)), w);
  }
  // Sub-matrix pointers (column offsets h*hs) are only element-aligned in general.
  const uint32_t align = uint32_t(dtype_size(t));
  const LtPreference pref(ws_bytes, align, align, align, w);
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  DTRAIN_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, plan->desc, plan->la, plan->lb, plan->lc,
                                                     plan->lc, pref.h.p, 1, &res, &found), w);
  if (found < 1) fault("cuBLASLt found no algorithm for {}", w);
  plan->algo = res.algo;
  plan->workspace = res.workspaceSize;
  auto& slot = cache[key];
  slot = std::move(plan);
  return *slot;
}

bool CudaBackend::use_flash(DType t, int64_t hs) const {
  return cc_major_ >= 8 && k::flash_attn_supported(t, hs);
}

AttentionSaved CudaBackend::attention_saved(int64_t B, int64_t H, int64_t T, int64_t hs,
                                            DType qkv_dtype) const {
  if (use_flash(qkv_dtype, hs)) return {DType::F32, Shape{B, H, T}};  // LSE
  return {qkv_dtype, Shape{B, H, T, T}};                              // probabilities
}

void CudaBackend::attention_fwd(const Tensor& qkv, Tensor& out, Tensor& saved, int n_head) {
  const char* op = "attention_fwd";
  const AttnDims a = attn_dims(op, qkv, n_head);
  const int64_t B = a.B, T = a.T, C = a.C, H = a.H, hs = a.hs;
  expect_like(out, qkv.dtype, B * T * C, op, "out");
  if (use_flash(qkv.dtype, hs)) {
    expect_like(saved, DType::F32, B * H * T, op, "saved (LSE [B,H,T])");
    expect_flash_args(a, {&qkv, &out, &saved}, op);
    if (B * T == 0) return;
    k::flash_attn_fwd(qkv.data, out.data, saved.f32(), qkv.dtype, B, T, H, hs, stream_);
    DTRAIN_KERNEL_CHECK(fmt::format("{} (flash) qkv {} n_head {}", op, qkv.str(), n_head));
    return;
  }
  const Tensor& probs = saved;
  expect_like(probs, qkv.dtype, B * H * T * T, op, "saved (probabilities [B,H,T,T])");
  if (B * T == 0) return;
  const size_t es = dtype_size(qkv.dtype);
  const std::string w = fmt::format("{} qkv {} n_head {}", op, qkv.str(), n_head);
  // S[h] = Q[h] K[h]^T : [T,hs] x [hs,T]
  GemmPlan& p1 = bgemm_plan(gemm_plans_, lt_,
                            {false, true, T, T, hs, 3 * C, 3 * C, T, hs, hs, T * T, int(H)},
                            qkv.dtype, gemm_ws_bytes_);
  // O[h] = P[h] V[h] : [T,T] x [T,hs]
  GemmPlan& p2 = bgemm_plan(gemm_plans_, lt_,
                            {false, false, T, hs, T, T, 3 * C, C, T * T, hs, hs, int(H)},
                            qkv.dtype, gemm_ws_bytes_);
  void* ws = gemm_ws_.get(gemm_ws_bytes_);
  const char* q = static_cast<const char*>(qkv.data);
  char* pp = static_cast<char*>(probs.data);
  char* po = static_cast<char*>(out.data);
  for (int64_t b = 0; b < B; ++b) {
    const char* qb = q + size_t(b * T * 3 * C) * es;
    bgemm(*this, lt_, p1, qb, qb + size_t(C) * es, pp + size_t(b * H * T * T) * es, 1.f, 0.f, ws,
          stream_, w);
  }
  k::causal_softmax(probs.data, qkv.dtype, B * H * T, T, 1.f / std::sqrt(float(hs)), stream_);
  DTRAIN_KERNEL_CHECK(w);
  for (int64_t b = 0; b < B; ++b) {
    const char* qb = q + size_t(b * T * 3 * C) * es;
    bgemm(*this, lt_, p2, pp + size_t(b * H * T * T) * es, qb + size_t(2 * C) * es,
          po + size_t(b * T * C) * es, 1.f, 0.f, ws, stream_, w);
  }
}

void CudaBackend::attention_decode(const Tensor& qkv, Tensor& kcache, Tensor& vcache,
                                   int64_t pos, Tensor& out, int n_head) {
  const char* op = "attention_decode";
  expect_float(qkv, op, "qkv");
  DTRAIN_CHECK(qkv.ndim() >= 2 && qkv.shape[qkv.ndim() - 1] % 3 == 0 && n_head > 0 &&
                   (qkv.shape[qkv.ndim() - 1] / 3) % n_head == 0,
               "{}: qkv {} with n_head {}", op, qkv.str(), n_head);
  const int64_t C = qkv.shape[qkv.ndim() - 1] / 3, B = qkv.numel() / (3 * C), H = n_head;
  DTRAIN_CHECK(kcache.ndim() == 4 && kcache.dim(0) == B && kcache.dim(1) == H &&
                   kcache.dim(3) == C / H && kcache.shape == vcache.shape,
               "{}: caches {} / {} do not match qkv {} with n_head {}", op, kcache.str(),
               vcache.str(), qkv.str(), n_head);
  expect_like(kcache, qkv.dtype, kcache.numel(), op, "kcache");
  expect_like(vcache, qkv.dtype, vcache.numel(), op, "vcache");
  expect_like(out, qkv.dtype, B * C, op, "out");
  const int64_t Tmax = kcache.dim(2);
  DTRAIN_CHECK(pos >= 0 && pos < Tmax && pos < 12288, "{}: position {} outside the cache [0, {})",
               op, pos, Tmax);
  k::attention_decode(qkv.data, kcache.data, vcache.data, out.data, qkv.dtype, B, H, C, Tmax, pos,
                      stream_);
  DTRAIN_KERNEL_CHECK(op);
}

void CudaBackend::attention_bwd(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                const Tensor& saved, Tensor& dqkv, int n_head) {
  const char* op = "attention_bwd";
  const AttnDims a = attn_dims(op, qkv, n_head);
  const int64_t B = a.B, T = a.T, C = a.C, H = a.H, hs = a.hs;
  expect_like(dout, qkv.dtype, B * T * C, op, "dout");
  expect_like(dqkv, qkv.dtype, qkv.numel(), op, "dqkv");
  if (use_flash(qkv.dtype, hs)) {
    expect_like(out, qkv.dtype, B * T * C, op, "out");
    expect_like(saved, DType::F32, B * H * T, op, "saved (LSE [B,H,T])");
    expect_flash_args(a, {&dout, &qkv, &out, &saved, &dqkv}, op);
    if (B * T == 0) return;
    // D = rowsum(dout * out) [B,H,T] f32 in scratch, then dK/dV and dQ (no atomics).
    float* dsum = static_cast<float*>(scratch_.get(size_t(B * H * T) * sizeof(float)));
    k::flash_attn_bwd_dsum(dout.data, out.data, dsum, qkv.dtype, B, T, H, hs, stream_);
    DTRAIN_KERNEL_CHECK(fmt::format("{} (flash rowsum dout*out) dout {} n_head {}", op,
                                    dout.str(), n_head));
    k::flash_attn_bwd_dkdv(dout.data, qkv.data, saved.f32(), dsum, dqkv.data, qkv.dtype, B, T, H,
                           hs, stream_);
    DTRAIN_KERNEL_CHECK(fmt::format("{} (flash dk/dv) qkv {} n_head {}", op, qkv.str(), n_head));
    k::flash_attn_bwd_dq(dout.data, qkv.data, saved.f32(), dsum, dqkv.data, qkv.dtype, B, T, H, hs,
                         stream_);
    DTRAIN_KERNEL_CHECK(fmt::format("{} (flash dq) qkv {} n_head {}", op, qkv.str(), n_head));
    return;
  }
  const Tensor& probs = saved;  // `out` is not needed with the probabilities
  expect_like(probs, qkv.dtype, B * H * T * T, op, "saved (probabilities [B,H,T,T])");
  if (B * T == 0) return;
  const size_t es = dtype_size(qkv.dtype);
  const std::string w = fmt::format("{} qkv {} n_head {}", op, qkv.str(), n_head);
  const DType t = qkv.dtype;
  const size_t ws_b = gemm_ws_bytes_;
  // dP[h] = dO[h] V[h]^T : [T,hs] x [hs,T]      (dO: ld C, batch stride hs)
  GemmPlan& pdp = bgemm_plan(gemm_plans_, lt_, {false, true, T, T, hs, C, 3 * C, T, hs, hs, T * T, int(H)}, t, ws_b);
  // dV[h] = P[h]^T dO[h] : [T,T]^T x [T,hs]
  GemmPlan& pdv = bgemm_plan(gemm_plans_, lt_, {true, false, T, hs, T, T, C, 3 * C, T * T, hs, hs, int(H)}, t, ws_b);
  // dQ[h] = dS[h] K[h] : [T,T] x [T,hs]
  GemmPlan& pdq = bgemm_plan(gemm_plans_, lt_, {false, false, T, hs, T, T, 3 * C, 3 * C, T * T, hs, hs, int(H)}, t, ws_b);
  // dK[h] = dS[h]^T Q[h] : [T,T]^T x [T,hs]
  GemmPlan& pdk = bgemm_plan(gemm_plans_, lt_, {true, false, T, hs, T, T, 3 * C, 3 * C, T * T, hs, hs, int(H)}, t, ws_b);
  void* ws = gemm_ws_.get(gemm_ws_bytes_);
  char* ds = static_cast<char*>(scratch_.get(size_t(B * H * T * T) * es));
  const char* q = static_cast<const char*>(qkv.data);
  const char* g = static_cast<const char*>(dout.data);
  const char* pp = static_cast<const char*>(probs.data);
  char* d = static_cast<char*>(dqkv.data);
  for (int64_t b = 0; b < B; ++b) {
    const size_t oq = size_t(b * T * 3 * C) * es, og = size_t(b * T * C) * es,
                 op_ = size_t(b * H * T * T) * es;
    bgemm(*this, lt_, pdp, g + og, q + oq + size_t(2 * C) * es, ds + op_, 1.f, 0.f, ws, stream_, w);
    bgemm(*this, lt_, pdv, pp + op_, g + og, d + oq + size_t(2 * C) * es, 1.f, 0.f, ws, stream_, w);
  }
  k::causal_softmax_bwd(probs.data, ds, t, B * H * T, T, 1.f / std::sqrt(float(hs)), stream_);
  DTRAIN_KERNEL_CHECK(w);
  for (int64_t b = 0; b < B; ++b) {
    const size_t oq = size_t(b * T * 3 * C) * es, op_ = size_t(b * H * T * T) * es;
    bgemm(*this, lt_, pdq, ds + op_, q + oq + size_t(C) * es, d + oq, 1.f, 0.f, ws, stream_, w);
    bgemm(*this, lt_, pdk, ds + op_, q + oq, d + oq + size_t(C) * es, 1.f, 0.f, ws, stream_, w);
  }
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

void CudaBackend::vocab_xent_max(const Tensor& logits, int64_t valid, Tensor& mx) {
  const char* op = "vocab_xent_max";
  expect_float(logits, op, "logits");
  DTRAIN_CHECK(logits.ndim() == 2 && valid >= 0 && valid <= logits.dim(1), "{}: {} real columns of logits {}", op,
               valid, logits.str());
  expect_like(mx, DType::F32, logits.dim(0), op, "mx");
  k::vocab_xent_max(logits.data, logits.dtype, logits.dim(0), logits.dim(1), valid, mx.f32(), stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
}

void CudaBackend::vocab_xent_parts(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                   int64_t classes, const Tensor& gmax, Tensor& parts) {
  const char* op = "vocab_xent_parts";
  expect_float(logits, op, "logits");
  DTRAIN_CHECK(logits.ndim() == 2 && valid >= 0 && valid <= logits.dim(1), "{}: {} real columns of logits {}", op,
               valid, logits.str());
  const int64_t N = logits.dim(0);
  DTRAIN_CHECK(labels.dtype == DType::I32 && labels.numel() == N, "{}: labels {}", op, labels.str());
  expect_like(gmax, DType::F32, N, op, "gmax");
  expect_like(parts, DType::F32, 2 * N, op, "parts");
  k::vocab_xent_parts(logits.data, logits.dtype, N, logits.dim(1), valid, labels.i32(), offset, classes, gmax.f32(),
                      parts.f32(), stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
}

void CudaBackend::vocab_xent_finish(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                    const Tensor& gmax, const Tensor& sums, float grad_scale, Tensor& losses,
                                    Tensor& dlogits) {
  const char* op = "vocab_xent_finish";
  expect_float(logits, op, "logits");
  DTRAIN_CHECK(logits.ndim() == 2 && valid >= 0 && valid <= logits.dim(1), "{}: {} real columns of logits {}", op,
               valid, logits.str());
  const int64_t N = logits.dim(0);
  DTRAIN_CHECK(labels.dtype == DType::I32 && labels.numel() == N, "{}: labels {}", op, labels.str());
  expect_like(gmax, DType::F32, N, op, "gmax");
  expect_like(sums, DType::F32, 2 * N, op, "sums");
  if (losses.defined()) expect_like(losses, DType::F32, N, op, "losses");
  if (dlogits.defined()) expect_like(dlogits, logits.dtype, logits.numel(), op, "dlogits");
  k::vocab_xent_finish(logits.data, logits.dtype, N, logits.dim(1), valid, labels.i32(), offset, gmax.f32(),
                       sums.f32(), grad_scale, losses.defined() ? losses.f32() : nullptr, dlogits.data, stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
}

}  // namespace dtrain

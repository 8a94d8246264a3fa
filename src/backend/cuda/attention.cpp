// CudaBackend causal attention, multi-head or grouped-query (n_kv_head key/value heads shared by
// groups of g = n_head / n_kv_head query heads; qkv rows are [q (H heads) | k (Hkv) | v (Hkv)],
// W = (H + 2 Hkv) hs wide). In bf16/f16 with a head size of 16/32/64/128 (sm_80+) it is the
// flash kernels of flash_attn.cu (saved: LSE [B,H,T] f32). Otherwise (f32, other head sizes) it
// is cuBLASLt strided-batched GEMMs around the fused causal softmax kernels, with the
// probabilities [B,H,T,T] materialised and saved: one call per sample b and group member r,
// batched over the Hkv key/value heads (query head h = kv g + r: its Q is the [T, hs] submatrix
// of qkv at column h hs with leading dimension W, the batch stride over kv g hs; its K and V
// are at kv hs after the query part). A key/value head's gradient sums its g query heads' in
// order r = 0..g-1 (beta = 1 after the first). With g = 1 these are the plans and calls of
// plain multi-head attention.
#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include <fmt/format.h>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/expect.h"
#include "backend/cuda/flash_attn.h"
#include "backend/cuda/gpt_kernels.h"
#include "backend/cuda/plans.h"

namespace dtrain {
namespace k = cuda_kernels;
using namespace cuda_expect;
namespace {

cudaDataType_t lt_dtype(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// H query heads, Hkv key/value heads of hs values; rows W wide, keys at koff, values at voff;
// g query heads per key/value head; C = H hs is the output's width.
struct AttnDims {
  int64_t B, T, C, H, hs, Hkv, W, koff, voff, g;
};
AttnDims attn_shape(const char* op, const Tensor& qkv, int n_head, int n_kv_head) {
  expect_float(qkv, op, "qkv");
  const int64_t H = n_head, Hkv = n_kv_head == 0 ? n_head : n_kv_head;
  const int64_t W = qkv.ndim() >= 1 ? qkv.dim(-1) : 0;
  DTRAIN_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && W > 0 && W % (H + 2 * Hkv) == 0,
               "{}: qkv {} with n_head {} and n_kv_head {}", op, qkv.str(), n_head, n_kv_head);
  const int64_t hs = W / (H + 2 * Hkv);
  return {0, 0, H * hs, H, hs, Hkv, W, H * hs, (H + Hkv) * hs, H / Hkv};
}
AttnDims attn_dims(const char* op, const Tensor& qkv, int n_head, int n_kv_head) {
  DTRAIN_CHECK(qkv.ndim() == 3, "{}: qkv {} must be [B,T,(H + 2 Hkv) hs]", op, qkv.str());
  AttnDims a = attn_shape(op, qkv, n_head, n_kv_head);
  a.B = qkv.dim(0), a.T = qkv.dim(1);
  return a;
}
// The flash kernels read and write 16-byte chunks and index with int rows/tiles.
void expect_flash_args(const AttnDims& a, std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts)
    DTRAIN_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
                 "{}: flash attention needs 16-byte aligned tensors, got {} at {}", op, t->str(), t->data);
  DTRAIN_CHECK(a.T <= 65535LL * k::kFlashTile && a.B <= 65535 && a.H <= INT_MAX,
               "{}: B={} T={} H={} outside the flash attention launch grid", op, a.B, a.T, a.H);
}
// Packed documents' positions (Backend::attention_fwd's doc_pos) on the device, or null.
const int32_t* doc_positions(const Tensor& doc_pos, int64_t B, int64_t T, const char* op) {
  if (!doc_pos.defined()) return nullptr;
  expect_like(doc_pos, DType::I32, B * T, op, "doc_pos");
  return doc_pos.i32();
}

}  // namespace

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

void CudaBackend::attention_fwd(const Tensor& qkv, Tensor& out, Tensor& saved, int n_head, int n_kv_head,
                                const Tensor& doc_pos) {
  const char* op = "attention_fwd";
  const AttnDims a = attn_dims(op, qkv, n_head, n_kv_head);
  const int64_t B = a.B, T = a.T, C = a.C, H = a.H, hs = a.hs, Hkv = a.Hkv, W = a.W, g = a.g;
  expect_like(out, qkv.dtype, B * T * C, op, "out");
  const int32_t* dp = doc_positions(doc_pos, B, T, op);
  if (use_flash(qkv.dtype, hs)) {
    expect_like(saved, DType::F32, B * H * T, op, "saved (LSE [B,H,T])");
    expect_flash_args(a, {&qkv, &out, &saved}, op);
    if (B * T == 0) return;
    k::flash_attn_fwd(qkv.data, out.data, saved.f32(), dp, qkv.dtype, B, T, H, Hkv, hs, stream_);
    DTRAIN_KERNEL_CHECK(fmt::format("{} (flash) qkv {} n_head {} n_kv_head {}", op, qkv.str(), n_head, Hkv));
    return;
  }
  const Tensor& probs = saved;
  expect_like(probs, qkv.dtype, B * H * T * T, op, "saved (probabilities [B,H,T,T])");
  if (B * T == 0) return;
  const size_t es = dtype_size(qkv.dtype);
  const std::string w = fmt::format("{} qkv {} n_head {} n_kv_head {}", op, qkv.str(), n_head, Hkv);
  // S[h] = Q[h] K[kv]^T : [T,hs] x [hs,T]
  GemmPlan& p1 = bgemm_plan(gemm_plans_, lt_, {false, true, T, T, hs, W, W, T, g * hs, hs, g * T * T, int(Hkv)},
                            qkv.dtype, gemm_ws_bytes_);
  // O[h] = P[h] V[kv] : [T,T] x [T,hs]
  GemmPlan& p2 = bgemm_plan(gemm_plans_, lt_, {false, false, T, hs, T, T, W, C, g * T * T, hs, g * hs, int(Hkv)},
                            qkv.dtype, gemm_ws_bytes_);
  void* ws = gemm_ws_.get(gemm_ws_bytes_);
  const char* q = static_cast<const char*>(qkv.data);
  char* pp = static_cast<char*>(probs.data);
  char* po = static_cast<char*>(out.data);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < g; ++r) {
      const char* qb = q + size_t(b * T * W) * es;
      bgemm(*this, lt_, p1, qb + size_t(r * hs) * es, qb + size_t(a.koff) * es,
            pp + size_t((b * H + r) * T * T) * es, 1.f, 0.f, ws, stream_, w);
    }
  k::causal_softmax(probs.data, dp, qkv.dtype, B * H * T, T, H, 1.f / std::sqrt(float(hs)), stream_);
  DTRAIN_KERNEL_CHECK(w);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < g; ++r) {
      const char* qb = q + size_t(b * T * W) * es;
      bgemm(*this, lt_, p2, pp + size_t((b * H + r) * T * T) * es, qb + size_t(a.voff) * es,
            po + size_t(b * T * C + r * hs) * es, 1.f, 0.f, ws, stream_, w);
    }
}

void CudaBackend::attention_decode(const Tensor& qkv, Tensor& kcache, Tensor& vcache, int64_t pos, Tensor& out,
                                   int n_head, int n_kv_head) {
  const char* op = "attention_decode";
  DTRAIN_CHECK(qkv.ndim() >= 2, "{}: qkv {} must be [B,(H + 2 Hkv) hs]", op, qkv.str());
  const AttnDims a = attn_shape(op, qkv, n_head, n_kv_head);
  const int64_t B = qkv.numel() / a.W, H = a.H, Hkv = a.Hkv, hs = a.hs;
  DTRAIN_CHECK(kcache.ndim() == 4 && kcache.dim(0) == B && kcache.dim(1) == Hkv && kcache.dim(3) == hs &&
                   kcache.shape == vcache.shape,
               "{}: caches {} / {} do not match qkv {} with n_head {} n_kv_head {}", op, kcache.str(), vcache.str(),
               qkv.str(), n_head, n_kv_head);
  expect_like(kcache, qkv.dtype, kcache.numel(), op, "kcache");
  expect_like(vcache, qkv.dtype, vcache.numel(), op, "vcache");
  expect_like(out, qkv.dtype, B * a.C, op, "out");
  const int64_t Tmax = kcache.dim(2);
  DTRAIN_CHECK(pos >= 0 && pos < Tmax && pos < 12288, "{}: position {} outside the cache [0, {})", op, pos, Tmax);
  k::attention_decode(qkv.data, kcache.data, vcache.data, out.data, qkv.dtype, B, H, Hkv, hs, Tmax, pos, stream_);
  DTRAIN_KERNEL_CHECK(op);
}

void CudaBackend::attention_bwd(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& saved,
                                Tensor& dqkv, int n_head, int n_kv_head, const Tensor& doc_pos) {
  const char* op = "attention_bwd";
  const AttnDims a = attn_dims(op, qkv, n_head, n_kv_head);
  const int64_t B = a.B, T = a.T, C = a.C, H = a.H, hs = a.hs, Hkv = a.Hkv, W = a.W, g = a.g;
  const int32_t* dp = doc_positions(doc_pos, B, T, op);
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
    DTRAIN_KERNEL_CHECK(fmt::format("{} (flash rowsum dout*out) dout {} n_head {}", op, dout.str(), n_head));
    k::flash_attn_bwd_dkdv(dout.data, qkv.data, saved.f32(), dsum, dp, dqkv.data, qkv.dtype, B, T, H, Hkv, hs,
                           stream_);
    DTRAIN_KERNEL_CHECK(fmt::format("{} (flash dk/dv) qkv {} n_head {} n_kv_head {}", op, qkv.str(), n_head, Hkv));
    k::flash_attn_bwd_dq(dout.data, qkv.data, saved.f32(), dsum, dp, dqkv.data, qkv.dtype, B, T, H, Hkv, hs,
                         stream_);
    DTRAIN_KERNEL_CHECK(fmt::format("{} (flash dq) qkv {} n_head {} n_kv_head {}", op, qkv.str(), n_head, Hkv));
    return;
  }
  const Tensor& probs = saved;  // `out` is not needed with the probabilities
  expect_like(probs, qkv.dtype, B * H * T * T, op, "saved (probabilities [B,H,T,T])");
  if (B * T == 0) return;
  const size_t es = dtype_size(qkv.dtype);
  const std::string w = fmt::format("{} qkv {} n_head {} n_kv_head {}", op, qkv.str(), n_head, Hkv);
  const DType t = qkv.dtype;
  const size_t ws_b = gemm_ws_bytes_;
  const int nb = int(Hkv);
  // dP[h] = dO[h] V[kv]^T : [T,hs] x [hs,T]      (dO: ld C)
  GemmPlan& pdp = bgemm_plan(gemm_plans_, lt_, {false, true, T, T, hs, C, W, T, g * hs, hs, g * T * T, nb}, t, ws_b);
  // dV[kv] (+)= P[h]^T dO[h] : [T,T]^T x [T,hs]
  GemmPlan& pdv = bgemm_plan(gemm_plans_, lt_, {true, false, T, hs, T, T, C, W, g * T * T, g * hs, hs, nb}, t, ws_b);
  // dQ[h] = dS[h] K[kv] : [T,T] x [T,hs]
  GemmPlan& pdq = bgemm_plan(gemm_plans_, lt_, {false, false, T, hs, T, T, W, W, g * T * T, hs, g * hs, nb}, t, ws_b);
  // dK[kv] (+)= dS[h]^T Q[h] : [T,T]^T x [T,hs]
  GemmPlan& pdk = bgemm_plan(gemm_plans_, lt_, {true, false, T, hs, T, T, W, W, g * T * T, g * hs, hs, nb}, t, ws_b);
  void* ws = gemm_ws_.get(gemm_ws_bytes_);
  char* ds = static_cast<char*>(scratch_.get(size_t(B * H * T * T) * es));
  const char* q = static_cast<const char*>(qkv.data);
  const char* gd = static_cast<const char*>(dout.data);
  const char* pp = static_cast<const char*>(probs.data);
  char* d = static_cast<char*>(dqkv.data);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < g; ++r) {
      const size_t oq = size_t(b * T * W) * es, og = size_t(b * T * C + r * hs) * es,
                   op_ = size_t((b * H + r) * T * T) * es;
      const float beta = r == 0 ? 0.f : 1.f;  // the group's later query heads add into dV
      bgemm(*this, lt_, pdp, gd + og, q + oq + size_t(a.voff) * es, ds + op_, 1.f, 0.f, ws, stream_, w);
      bgemm(*this, lt_, pdv, pp + op_, gd + og, d + oq + size_t(a.voff) * es, 1.f, beta, ws, stream_, w);
    }
  k::causal_softmax_bwd(probs.data, ds, dp, t, B * H * T, T, H, 1.f / std::sqrt(float(hs)), stream_);
  DTRAIN_KERNEL_CHECK(w);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < g; ++r) {
      const size_t oq = size_t(b * T * W) * es, op_ = size_t((b * H + r) * T * T) * es;
      const float beta = r == 0 ? 0.f : 1.f;
      bgemm(*this, lt_, pdq, ds + op_, q + oq + size_t(a.koff) * es, d + oq + size_t(r * hs) * es, 1.f, 0.f, ws,
            stream_, w);
      bgemm(*this, lt_, pdk, ds + op_, q + oq + size_t(r * hs) * es, d + oq + size_t(a.koff) * es, 1.f, beta, ws,
            stream_, w);
    }
}

}  // namespace dtrain

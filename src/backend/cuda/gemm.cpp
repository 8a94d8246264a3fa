// GEMM through cuBLASLt. dtrain's tensors are row-major; cuBLAS is column-major, and a
// row-major [R,C] matrix is a column-major [C,R] one. So C = op(A) op(B) (row-major,
// C [M,N]) is computed as the column-major C^T [N,M] = op(B)^T op(A)^T: the first cuBLAS
// operand is b, the second is a, with the same transpose flags.
// Plans (descriptors, layouts, chosen algorithm) are cached per (shape, dtype, TF32,
// pointer alignment); the 32 MiB workspace is allocated once.
#include <fmt/format.h>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/plans.h"
#include "core/log.h"

namespace dtrain {
namespace {

cudaDataType_t cuda_dtype(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

uint32_t ptr_alignment(const void* p) {
  uintptr_t u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (u % a) != 0) a >>= 1;
  return a;
}

const char* epilogue_name(int epi) {
  switch (epi) {
    case CUBLASLT_EPILOGUE_BIAS: return " bias";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return " gelu_aux_bias";
    case CUBLASLT_EPILOGUE_DGELU: return " dgelu";
    case CUBLASLT_EPILOGUE_BGRADA: return " bgrada";
    case CUBLASLT_EPILOGUE_BGRADB: return " bgradb";
    default: return "";
  }
}

}  // namespace

GemmPlan& CudaBackend::gemm_plan(bool ta, bool tb, int64_t M, int64_t N, int64_t K, DType t,
                                 DType tc, const void* a, const void* b, const void* c, int epilogue) {
  uint32_t al_a = ptr_alignment(b), al_b = ptr_alignment(a), al_c = ptr_alignment(c);
  std::string key = fmt::format("{}{} {} {} {} {} {} {} {} {} {}{}", int(ta), int(tb), M, N, K,
                                dtype_name(t), dtype_name(tc), int(allow_tf32_), al_a, al_b, al_c,
                                epilogue_name(epilogue));
  auto it = gemm_plans_.find(key);
  if (it != gemm_plans_.end()) return *it->second;

  std::string what = fmt::format("gemm trans_a={} trans_b={} M={} N={} K={} dtype={} c_dtype={}{}", ta,
                                 tb, M, N, K, dtype_name(t), dtype_name(tc), epilogue_name(epilogue));
  auto plan = std::make_unique<GemmPlan>();
  cublasComputeType_t ct = CUBLAS_COMPUTE_32F;
  if (t == DType::F32 && allow_tf32_) ct = CUBLAS_COMPUTE_32F_FAST_TF32;
  DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, ct, CUDA_R_32F), what);
  cublasOperation_t op_first = tb ? CUBLAS_OP_T : CUBLAS_OP_N;   // operand b
  cublasOperation_t op_second = ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // operand a
  DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                     &op_first, sizeof(op_first)), what);
  DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                     &op_second, sizeof(op_second)), what);
  if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    cublasLtEpilogue_t epi = cublasLtEpilogue_t(epilogue);
    DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                       &epi, sizeof(epi)), what);
  }
  if (epilogue == CUBLASLT_EPILOGUE_BIAS || epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
    // bias in D's dtype, one value per row of the column-major D [N,M] = per column of our
    // row-major c [M,N]
    cudaDataType_t bt = cuda_dtype(tc);
    DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                       &bt, sizeof(bt)), what);
  }
  if (epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || epilogue == CUBLASLT_EPILOGUE_DGELU) {
    // the GELU input ("aux", our pre [M,N]) is laid out as D: column-major [N,M], ld N
    const int64_t ld = N;
    DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld,
                                                       sizeof(ld)), what);
  }
  cudaDataType_t dt = cuda_dtype(t);
  // Stored (pre-op) column-major shapes: b is [N,K] col-major when !tb (row-major [K,N]).
  uint64_t r1 = tb ? K : N, c1 = tb ? N : K;
  uint64_t r2 = ta ? M : K, c2 = ta ? K : M;
  DTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->la, dt, r1, c1, int64_t(r1)), what);
  DTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, dt, r2, c2, int64_t(r2)), what);
  // 16-bit a/b with an f32 c (weight gradients accumulated into the f32 master grads) is one
  // of cuBLASLt's supported combinations: compute and scale f32, C = D = CUDA_R_32F.
  DTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lc, cuda_dtype(tc), N, M, N), what);

  const LtPreference pref(gemm_ws_bytes_, al_a, al_b, al_c, what);

  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt_, plan->desc, plan->la, plan->lb, plan->lc,
                                                           plan->lc, pref.h.p, 1, &res, &found);
  const bool fused = epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || epilogue == CUBLASLT_EPILOGUE_DGELU ||
                     epilogue == CUBLASLT_EPILOGUE_BGRADA || epilogue == CUBLASLT_EPILOGUE_BGRADB;
  if (fused && (hs != CUBLAS_STATUS_SUCCESS || found < 1)) {
    plan->usable = false;  // the caller falls back to the separate passes
    log::info("cuBLASLt has no algorithm for {} ({}): separate passes instead of the fused epilogue", what,
              cublasLtGetStatusName(hs));
  } else {
    DTRAIN_CUBLAS_CHECK(hs, what);
    if (found < 1) fault("cuBLASLt found no algorithm for {}", what);
    plan->algo = res.algo;
    plan->workspace = res.workspaceSize;
  }
  auto& slot = gemm_plans_[key];
  slot = std::move(plan);
  return *slot;
}

cublasStatus_t CudaBackend::gemm_run(GemmPlan& plan, float alpha, const Tensor& a, const Tensor& b, float beta,
                                     Tensor& c) {
  void* ws = plan.workspace ? gemm_ws_.get(gemm_ws_bytes_) : nullptr;
  return cublasLtMatmul(lt_, plan.desc, &alpha, b.data, plan.la, a.data, plan.lb, &beta, c.data, plan.lc, c.data,
                        plan.lc, &plan.algo, ws, plan.workspace, stream_);
}

void CudaBackend::gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b,
                       float beta, Tensor& c) {
  DTRAIN_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2, "gemm expects 2-D views: a {} b {} c {}",
               a.str(), b.str(), c.str());
  DTRAIN_CHECK(a.dtype == b.dtype && is_float(a.dtype) && (c.dtype == a.dtype || c.dtype == DType::F32),
               "gemm dtypes: a and b must match, c must match them or be f32: a {} b {} c {}", a.str(),
               b.str(), c.str());
  int64_t M = trans_a ? a.dim(1) : a.dim(0), K = trans_a ? a.dim(0) : a.dim(1);
  int64_t Kb = trans_b ? b.dim(1) : b.dim(0), N = trans_b ? b.dim(0) : b.dim(1);
  DTRAIN_CHECK(K == Kb && c.dim(0) == M && c.dim(1) == N,
               "gemm shapes: op(a) [{},{}] op(b) [{},{}] c {}", M, K, Kb, N, c.shape.str());
  if (M == 0 || N == 0) return;
  if (K == 0) {  // c = beta * c
    if (beta == 0.f) fill(c, 0.f); else scale(c, beta);
    return;
  }
  GemmPlan& plan = gemm_plan(trans_a, trans_b, M, N, K, a.dtype, c.dtype, a.data, b.data, c.data);
  DTRAIN_CUBLAS_CHECK(gemm_run(plan, alpha, a, b, beta, c),
                      fmt::format("gemm a {} b {} c {} trans_a={} trans_b={}", a.str(), b.str(), c.str(), trans_a,
                                  trans_b));
}

void CudaBackend::gemm_bias(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                            const Tensor& bias, Tensor& c) {
  const int64_t M = c.ndim() == 2 ? c.dim(0) : 0, N = c.ndim() == 2 ? c.dim(1) : 0;
  const int64_t K = a.ndim() == 2 ? (trans_a ? a.dim(0) : a.dim(1)) : 0;
  // The epilogue takes a bias in c's dtype at a 16-byte aligned address; anything else (and
  // the degenerate shapes gemm handles itself) is gemm then add_bias.
  if (M == 0 || N == 0 || K == 0 || bias.dtype != c.dtype || bias.numel() != N ||
      reinterpret_cast<uintptr_t>(bias.data) % 16 != 0 || a.dtype != b.dtype ||
      !(c.dtype == a.dtype)) {
    Backend::gemm_bias(trans_a, trans_b, a, b, bias, c);
    return;
  }
  DTRAIN_CHECK(a.ndim() == 2 && b.ndim() == 2, "gemm_bias expects 2-D views: a {} b {} c {}", a.str(),
               b.str(), c.str());
  const int64_t Kb = trans_b ? b.dim(1) : b.dim(0), Nb = trans_b ? b.dim(0) : b.dim(1);
  const int64_t Ma = trans_a ? a.dim(1) : a.dim(0);
  DTRAIN_CHECK(K == Kb && Ma == M && Nb == N, "gemm_bias shapes: op(a) [{},{}] op(b) [{},{}] c {}", Ma,
               K, Kb, Nb, c.shape.str());
  GemmPlan& plan = gemm_plan(trans_a, trans_b, M, N, K, a.dtype, c.dtype, a.data, b.data, c.data,
                             CUBLASLT_EPILOGUE_BIAS);
  set_plan_pointer(plan, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias.data, "gemm_bias");
  DTRAIN_CUBLAS_CHECK(gemm_run(plan, 1.f, a, b, 0.f, c),
                      fmt::format("gemm_bias a {} b {} bias {} c {} trans_a={} trans_b={}", a.str(), b.str(),
                                  bias.str(), c.str(), trans_a, trans_b));
}

namespace {

// [M,N,K] of c = op(a) op(b) when the shapes agree (else zeros).
struct GemmShape {
  int64_t M = 0, N = 0, K = 0;
};
GemmShape gemm_shape(bool ta, bool tb, const Tensor& a, const Tensor& b, const Tensor& c) {
  if (a.ndim() != 2 || b.ndim() != 2 || c.ndim() != 2) return {};
  const int64_t M = ta ? a.dim(1) : a.dim(0), K = ta ? a.dim(0) : a.dim(1);
  const int64_t Kb = tb ? b.dim(1) : b.dim(0), N = tb ? b.dim(0) : b.dim(1);
  if (K != Kb || c.dim(0) != M || c.dim(1) != N) return {};
  return {M, N, K};
}

// The fused GELU epilogues want one 16-bit or f32 dtype throughout, a non-empty product, an
// aux leading dimension (N) divisible by 8 and 16-byte aligned aux (pre) and c.
bool gelu_fusable(const GemmShape& g, const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& c) {
  return g.M > 0 && g.N > 0 && g.K > 0 && g.N % 8 == 0 && is_float(a.dtype) && a.dtype == b.dtype &&
         c.dtype == a.dtype && pre.dtype == a.dtype && pre.shape == c.shape && pre.data != c.data &&
         reinterpret_cast<uintptr_t>(pre.data) % 16 == 0 && reinterpret_cast<uintptr_t>(c.data) % 16 == 0;
}

}  // namespace

// A fused-epilogue plan (its pointers set by the caller) run once: false when cuBLASLt
// refuses it at run time, and the plan is then marked unusable (the caller falls back).
bool CudaBackend::gemm_fused(GemmPlan& plan, float beta, const Tensor& a, const Tensor& b, Tensor& c,
                             const char* op) {
  const cublasStatus_t st = gemm_run(plan, 1.f, a, b, beta, c);
  if (st == CUBLAS_STATUS_SUCCESS) return true;
  if (st != CUBLAS_STATUS_NOT_SUPPORTED)
    DTRAIN_CUBLAS_CHECK(st, fmt::format("{} a {} b {} c {}", op, a.str(), b.str(), c.str()));
  plan.usable = false;
  return false;
}

void CudaBackend::set_plan_pointer(GemmPlan& plan, int attr, const void* p, const char* op) {
  DTRAIN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, cublasLtMatmulDescAttributes_t(attr), &p, sizeof(p)),
                      op);
}

void CudaBackend::gemm_bias_gelu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& bias,
                                 Tensor& pre, Tensor& c) {
  const GemmShape g = gemm_shape(trans_a, trans_b, a, b, c);
  if (!unfused_.gelu_epilogue && gelu_fusable(g, a, b, pre, c) && bias.dtype == c.dtype && bias.numel() == g.N &&
      reinterpret_cast<uintptr_t>(bias.data) % 16 == 0) {
    GemmPlan& plan = gemm_plan(trans_a, trans_b, g.M, g.N, g.K, a.dtype, c.dtype, a.data, b.data, c.data,
                               CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
    if (plan.usable) {
      set_plan_pointer(plan, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias.data, "gemm_bias_gelu");
      set_plan_pointer(plan, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data, "gemm_bias_gelu");
      if (gemm_fused(plan, 0.f, a, b, c, "gemm_bias_gelu")) return;
    }
  }
  Backend::gemm_bias_gelu(trans_a, trans_b, a, b, bias, pre, c);
}

void CudaBackend::gemm_dgelu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& pre,
                             Tensor& c) {
  const GemmShape g = gemm_shape(trans_a, trans_b, a, b, c);
  if (!unfused_.gelu_epilogue && gelu_fusable(g, a, b, pre, c)) {
    GemmPlan& plan = gemm_plan(trans_a, trans_b, g.M, g.N, g.K, a.dtype, c.dtype, a.data, b.data, c.data,
                               CUBLASLT_EPILOGUE_DGELU);
    if (plan.usable) {
      set_plan_pointer(plan, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data, "gemm_dgelu");
      if (gemm_fused(plan, 0.f, a, b, c, "gemm_dgelu")) return;
    }
  }
  Backend::gemm_dgelu(trans_a, trans_b, a, b, pre, c);
}

// The bias gradient from the weight-gradient GEMM. Operand mapping (gemm.cpp's header):
//  * dw [out,in] += dy^T x: cuBLAS computes D = x2^T-view @ dy2, A = x, B = dy; the bias
//    gradient is per column of D (out), summed over k (the rows M) of B: BGRADB.
//  * in_out, dw [in,out] += x^T dy: A = dy, B = x, D [out,in] column-major; per row of D,
//    summed over k of A: BGRADA.
// The epilogue writes (not adds) the bias gradient, in D's dtype (f32): into scratch, then
// added to dbias, so gradient accumulation keeps working.
void CudaBackend::linear_wgrad(const Tensor& dy, const Tensor& x, bool in_out, Tensor& dw, Tensor& dbias) {
  const Tensor& a = in_out ? x : dy;
  const Tensor& b = in_out ? dy : x;
  const GemmShape g = gemm_shape(true, false, a, b, dw);
  const int64_t out = dy.ndim() == 2 ? dy.dim(1) : -1;
  if (!unfused_.bgrad_epilogue && dbias.defined() && g.M > 0 && g.N > 0 && g.K > 0 && is_float(dy.dtype) && x.dtype == dy.dtype &&
      dw.dtype == DType::F32 && dbias.dtype == DType::F32 && dbias.numel() == out) {
    const int epi = in_out ? CUBLASLT_EPILOGUE_BGRADA : CUBLASLT_EPILOGUE_BGRADB;
    GemmPlan& plan = gemm_plan(true, false, g.M, g.N, g.K, dy.dtype, DType::F32, a.data, b.data, dw.data, epi);
    if (plan.usable) {
      Tensor tmp(scratch_.get(size_t(out) * sizeof(float)), DType::F32, device(), Shape{out});
      set_plan_pointer(plan, CUBLASLT_MATMUL_DESC_BIAS_POINTER, tmp.data, "linear_wgrad");
      if (gemm_fused(plan, 1.f, a, b, dw, "linear_wgrad")) {
        add(dbias, tmp, dbias);
        return;
      }
    }
  }
  Backend::linear_wgrad(dy, x, in_out, dw, dbias);
}

}  // namespace dtrain

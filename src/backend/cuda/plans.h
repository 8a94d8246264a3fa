#pragma once
// Cached per-shape plans: cuBLASLt matmul descriptors + chosen algorithm (gemm.cpp) and
// cuDNN descriptors + chosen algorithm (conv.cpp). RAII: destructors free descriptors.
#include <cublasLt.h>
#include <cudnn.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "backend/cuda/check.h"

namespace dtrain {

// Owns handles: not copyable; destroy_each(f, h...) calls f(h) for each non-null handle.
struct PlanBase {
  PlanBase() = default;
  PlanBase(const PlanBase&) = delete;
  PlanBase& operator=(const PlanBase&) = delete;
  template <typename F, typename... H>
  static void destroy_each(F f, H... hs) {
    ((hs ? void(f(hs)) : void()), ...);
  }
};

struct GemmPlan : PlanBase {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;  // cuBLAS operand order
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool usable = true;  // false: cuBLASLt has no algorithm for this fused epilogue (fall back)
  ~GemmPlan() {
    destroy_each(cublasLtMatrixLayoutDestroy, la, lb, lc);
    destroy_each(cublasLtMatmulDescDestroy, desc);
  }
};

// A cuBLASLt matmul preference, destroyed with the object: the workspace limit and the
// minimum alignments (bytes) of A, B, C and D (D's = C's); `what` names the op in errors.
struct LtPreference {
  struct Owned {
    cublasLtMatmulPreference_t p = nullptr;
    ~Owned() { PlanBase::destroy_each(cublasLtMatmulPreferenceDestroy, p); }
  } h;  // a complete member: destroyed when the constructor throws
  LtPreference(size_t ws_bytes, uint32_t al_a, uint32_t al_b, uint32_t al_c,
               const std::string& what) {
    DTRAIN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&h.p), what);
    DTRAIN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
                            h.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                            sizeof(ws_bytes)), what);
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_c}};
    for (auto& [attr, v] : aligns)
      DTRAIN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(h.p, attr, &v, sizeof(v)), what);
  }
};

struct ConvPlan : PlanBase {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  int algo = 0;  // cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t, by kind
  size_t workspace = 0;
  ~ConvPlan() {
    destroy_each(cudnnDestroyTensorDescriptor, x, y);
    destroy_each(cudnnDestroyFilterDescriptor, w);
    destroy_each(cudnnDestroyConvolutionDescriptor, conv);
  }
};

}  // namespace dtrain

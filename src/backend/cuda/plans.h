#pragma once
// Cached per-shape plans: cuBLASLt matmul descriptors + chosen algorithm (gemm.cpp) and
// cuDNN descriptors + chosen algorithm (conv.cpp). RAII: destructors free descriptors.
#include <cublasLt.h>
#include <cudnn.h>

#include <cstddef>

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

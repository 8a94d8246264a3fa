#pragma once
// One check macro per CUDA library. Each names the failing call, the dtrain op it served
// and the shapes involved, so a device error reads e.g.
//   "cuDNN call cudnnConvolutionForward failed (CUDNN_STATUS_BAD_PARAM) in conv2d_fwd x=[8,32,32,16] ..."
// All throw RuntimeFault (exit 1). `what` is any expression convertible to std::string.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <string>

#include "core/error.h"

namespace dtrain::cuda_detail {

[[noreturn]] inline void raise(const char* lib, const char* call, const char* status,
                               const std::string& what, const char* file, int line) {
  throw RuntimeFault(fmt::format("{} call {} failed ({}) in {} [{}:{}]", lib, call, status, what,
                                 file, line));
}

}  // namespace dtrain::cuda_detail

#define DTRAIN_CUDA_CHECK(call, what)                                                  \
  do {                                                                                 \
    cudaError_t dtrain_err_ = (call);                                                  \
    if (dtrain_err_ != cudaSuccess) {                                                  \
      (void)cudaGetLastError();                                                        \
      ::dtrain::cuda_detail::raise("CUDA", #call, cudaGetErrorString(dtrain_err_), (what), \
                                   __FILE__, __LINE__);                                \
    }                                                                                  \
  } while (0)

// A library call returning status type S: raises with name(status) unless it returns ok
// (call_str: the call's text).
#define DTRAIN_STATUS_CHECK_(lib, S, ok, name, call, call_str, what)                      \
  do {                                                                                    \
    S dtrain_st_ = (call);                                                                \
    if (dtrain_st_ != (ok))                                                               \
      ::dtrain::cuda_detail::raise(lib, call_str, name(dtrain_st_), (what), __FILE__, __LINE__); \
  } while (0)

#define DTRAIN_CUBLAS_CHECK(call, what)                                                     \
  DTRAIN_STATUS_CHECK_("cuBLASLt", cublasStatus_t, CUBLAS_STATUS_SUCCESS, cublasLtGetStatusName, \
                       call, #call, what)

#define DTRAIN_CUDNN_CHECK(call, what)                                                     \
  DTRAIN_STATUS_CHECK_("cuDNN", cudnnStatus_t, CUDNN_STATUS_SUCCESS, cudnnGetErrorString, call, \
                       #call, what)

// After a kernel launch: catches launch-configuration errors (not asynchronous faults,
// which surface at the next synchronising call with that call's name).
#define DTRAIN_KERNEL_CHECK(what) DTRAIN_CUDA_CHECK(cudaGetLastError(), (what))

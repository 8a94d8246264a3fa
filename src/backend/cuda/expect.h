#pragma once
// Argument checks the CUDA ops' host code shares (a RuntimeFault naming the op and the tensor).
#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "core/tensor.h"

namespace dtrain::cuda_expect {

inline void expect_float(const Tensor& t, const char* op, const char* name) {
  DTRAIN_CHECK(t.defined() && is_float(t.dtype) && t.device.is_cuda(), "{}: {} must be a float CUDA tensor, got {}",
               op, name, t.str());
}
// dtype dt with n elements on the device
inline void expect_like(const Tensor& t, DType dt, int64_t n, const char* op, const char* name) {
  DTRAIN_CHECK(t.defined() && t.dtype == dt && t.numel() == n && t.device.is_cuda(),
               "{}: {} must be {} with {} elements, got {}", op, name, dtype_name(dt), n, t.str());
}
// a parameter-like vector: f32 or the activations' dtype
inline void expect_param(const Tensor& t, int64_t n, DType act, const char* op, const char* name) {
  DTRAIN_CHECK(t.defined() && (t.dtype == DType::F32 || t.dtype == act) && t.numel() == n,
               "{}: {} must be [{}] elements in f32 or {}, got {}", op, name, n, dtype_name(act), t.str());
}
inline std::string what(const char* op, const Tensor& t) { return fmt::format("{} {}", op, t.str()); }

}  // namespace dtrain::cuda_expect

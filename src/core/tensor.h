#pragma once
// Tensor: a contiguous, row-major, NON-OWNING view (pointer, dtype, device, shape).
// Memory is owned by a Buffer, an Arena, or a flat parameter buffer.
#include <cstddef>
#include <string>

#include "core/device.h"
#include "core/dtype.h"
#include "core/shape.h"

namespace dtrain {

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device{};
  Shape shape{};

  Tensor() = default;
  Tensor(void* d, DType t, Device dev, Shape s) : data(d), dtype(t), device(dev), shape(s) {}

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  int ndim() const { return shape.ndim(); }
  int64_t dim(int i) const { return shape[i]; }
  bool defined() const { return data != nullptr; }

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  float* f32() const {
    DTRAIN_CHECK(dtype == DType::F32, "tensor is {}, expected f32", dtype_name(dtype));
    return static_cast<float*>(data);
  }
  int32_t* i32() const {
    DTRAIN_CHECK(dtype == DType::I32, "tensor is {}, expected i32", dtype_name(dtype));
    return static_cast<int32_t*>(data);
  }

  // Same memory, new shape (numel must match).
  Tensor view(Shape s) const {
    DTRAIN_CHECK(s.numel() == numel(), "view {} of {}", s.str(), shape.str());
    return Tensor(data, dtype, device, s);
  }
  // Rows [begin, end) along dim 0.
  Tensor slice0(int64_t begin, int64_t end) const {
    DTRAIN_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= shape[0], "slice0 {}:{} of {}",
                 begin, end, shape.str());
    Shape s = shape;
    s[0] = end - begin;
    int64_t row = shape[0] ? numel() / shape[0] : 0;
    return Tensor(static_cast<char*>(data) + begin * row * int64_t(dtype_size(dtype)), dtype, device, s);
  }
  std::string str() const {
    return fmt::format("{}{}@{}", dtype_name(dtype), shape.str(), device.str());
  }
};

}  // namespace dtrain

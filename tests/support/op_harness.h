#pragma once
// Test harness for backend ops: host vectors <-> device tensors on any Backend (buffers are
// owned by the harness), a normalised error and bit-equality helpers.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"

namespace dtrain::testing {

using HostVec = std::vector<float>;

// Backend::softmax_dice with its loss read back to the host (the op leaves it on the device).
inline float softmax_dice_host(Backend& be, const Tensor& logits, const Tensor& labels, float smooth,
                               float grad_scale, Tensor& dlogits) {
  Buffer b(be, sizeof(float));
  Tensor loss = b.tensor(DType::F32, Shape{1});
  be.softmax_dice(logits, labels, smooth, grad_scale, loss, dlogits);
  float v = 0;
  be.copy_to_host(&v, loss.data, sizeof v);
  return v;
}

struct HostDev {
  Backend& be;
  std::vector<Buffer> bufs;
  explicit HostDev(Backend& b) : be(b) {}
  Tensor up(const HostVec& v, Shape s) {
    REQUIRE(int64_t(v.size()) == s.numel());
    bufs.emplace_back(be, v.size() * 4);
    Tensor t = bufs.back().tensor(DType::F32, s);
    be.copy_from_host(t.data, v.data(), t.nbytes());
    return t;
  }
  Tensor zeros(Shape s) { return up(HostVec(size_t(s.numel()), 0.f), s); }
  Tensor empty(DType t, Shape s) {
    bufs.emplace_back(be, size_t(s.numel()) * dtype_size(t));
    return bufs.back().tensor(t, s);
  }
  Tensor labels(const std::vector<int32_t>& v) {
    Tensor t = empty(DType::I32, Shape{int64_t(v.size())});
    be.copy_from_host(t.data, v.data(), t.nbytes());
    return t;
  }
  // v stored in dtype t (16-bit: rounded to nearest even)
  Tensor up(const HostVec& v, DType t, Shape s) {
    if (t == DType::F32) return up(v, s);
    REQUIRE(int64_t(v.size()) == s.numel());
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = t == DType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
    Tensor x = empty(t, s);
    be.copy_from_host(x.data, h.data(), x.nbytes());
    return x;
  }
  void set(Tensor& t, const HostVec& v) { be.copy_from_host(t.data, v.data(), t.nbytes()); }
  HostVec down(const Tensor& t) {  // any float dtype, widened to f32
    HostVec v(size_t(t.numel()));
    if (t.dtype == DType::BF16 || t.dtype == DType::F16) {
      std::vector<uint16_t> h(v.size());
      be.copy_to_host(h.data(), t.data, t.nbytes());
      for (size_t i = 0; i < v.size(); ++i) v[i] = t.dtype == DType::BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
      return v;
    }
    be.copy_to_host(v.data(), t.data, t.nbytes());
    return v;
  }
};

// v rounded to dtype t's precision (the values a 16-bit tensor of v holds)
inline HostVec rounded(HostVec v, DType t) {
  for (auto& x : v) {
    if (t == DType::BF16) x = bf16_to_f32(f32_to_bf16(x));
    if (t == DType::F16) x = f16_to_f32(f32_to_f16(x));
  }
  return v;
}

// ||got - want|| / ||want||
inline double nerr(const HostVec& got, const HostVec& want) {
  double se = 0, sw = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = double(got[i]) - want[i];
    se += d * d, sw += double(want[i]) * want[i];
  }
  return std::sqrt(se) / std::max(std::sqrt(sw), 1e-30);
}
inline bool all_zero(const HostVec& v) {
  return std::all_of(v.begin(), v.end(), [](float f) { return f == 0.f; });
}
inline bool bit_equal(const HostVec& a, const HostVec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}
inline double dot(const HostVec& a, const HostVec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

}  // namespace dtrain::testing

// normalised error within tol, and the result is not all zeros
#define EXPECT_CLOSE(got, want, tol)                                                        \
  do {                                                                                     \
    const ::dtrain::testing::HostVec g_ = (got), w_ = (want);                              \
    REQUIRE(g_.size() == w_.size());                                                       \
    CHECK_MESSAGE(::dtrain::testing::nerr(g_, w_) <= (tol),                                \
                  #got " nerr " << ::dtrain::testing::nerr(g_, w_));                       \
    CHECK_MESSAGE(!::dtrain::testing::all_zero(g_), #got " is all zero");                  \
  } while (0)

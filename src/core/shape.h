#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/error.h"

namespace dtrain {

// Up to 6 dimensions, row-major. Images are NHWC.
class Shape {
 public:
  static constexpr int kMaxDims = 6;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) {
    DTRAIN_CHECK(dims.size() <= kMaxDims, "too many dims: {}", dims.size());
    for (int64_t d : dims) d_[n_++] = d;
  }
  template <typename It>
  static Shape from(It begin, It end) {
    Shape s;
    for (; begin != end; ++begin) {
      DTRAIN_CHECK(s.n_ < kMaxDims, "too many dims");
      s.d_[s.n_++] = int64_t(*begin);
    }
    return s;
  }
  int ndim() const { return n_; }
  int64_t operator[](int i) const { return d_[i < 0 ? n_ + i : i]; }
  int64_t& operator[](int i) { return d_[i < 0 ? n_ + i : i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < n_; ++i) n *= d_[i];
    return n;
  }
  bool operator==(const Shape& o) const {
    if (n_ != o.n_) return false;
    for (int i = 0; i < n_; ++i)
      if (d_[i] != o.d_[i]) return false;
    return true;
  }
  bool operator!=(const Shape& o) const { return !(*this == o); }
  const int64_t* begin() const { return d_.data(); }
  const int64_t* end() const { return d_.data() + n_; }
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < n_; ++i) {
      if (i) s.append(",");
      s.append(std::to_string(d_[i]));
    }
    s.append("]");
    return s;
  }

 private:
  std::array<int64_t, kMaxDims> d_{};
  int n_ = 0;
};

}  // namespace dtrain

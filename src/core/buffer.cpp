#include "core/buffer.h"

#include <algorithm>

namespace dtrain {

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

Tensor Arena::alloc(DType t, Shape s) {
  size_t bytes = align_up(std::max<size_t>(size_t(s.numel()) * dtype_size(t), 1), 256);
  if (blocks_.empty() || blocks_.back().used + bytes > blocks_.back().buf.bytes()) {
    size_t grow = std::max(bytes, blocks_.empty() ? size_t(64) << 20 : blocks_.back().buf.bytes());
    blocks_.push_back(Block{Buffer(be_, grow), 0});
    device_allocs_++;
  }
  Block& b = blocks_.back();
  Tensor out(static_cast<char*>(b.buf.data()) + b.used, t, be_.device(), s);
  b.used += bytes;
  in_use_ += bytes;
  high_water_ = std::max(high_water_, in_use_);
  return out;
}

void Arena::reset() {
  if (blocks_.size() > 1) {
    blocks_.clear();
    blocks_.push_back(Block{Buffer(be_, align_up(high_water_, 1 << 20)), 0});
    device_allocs_++;
  }
  for (auto& b : blocks_) b.used = 0;
  in_use_ = 0;
}

size_t Arena::capacity() const {
  size_t c = 0;
  for (auto& b : blocks_) c += b.buf.bytes();
  return c;
}

}  // namespace dtrain

#pragma once
// Buffer: RAII owner of device memory from a Backend. Arena: a bump allocator for
// activations and workspaces, planned at the first step and reused (DESIGN: static
// memory). After the first step, reset() consolidates into one block of the high-water
// size so that the steady-state step allocates nothing.
#include <cstddef>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "core/tensor.h"

namespace dtrain {

class Buffer {
 public:
  Buffer() = default;
  Buffer(Allocator& be, size_t bytes) : be_(&be), bytes_(bytes) {
    ptr_ = bytes ? be.alloc(bytes) : nullptr;
  }
  ~Buffer() { release(); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      be_ = o.be_;
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Tensor tensor(DType t, Shape s, size_t byte_offset = 0) const {
    DTRAIN_CHECK(byte_offset + size_t(s.numel()) * dtype_size(t) <= bytes_,
                 "tensor {} at {} exceeds buffer of {} bytes", s.str(), byte_offset, bytes_);
    return Tensor(static_cast<char*>(ptr_) + byte_offset, t, be_->device(), s);
  }

 private:
  void release() {
    if (ptr_ && be_) be_->free(ptr_);
    ptr_ = nullptr;
  }
  Allocator* be_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class Arena {
 public:
  explicit Arena(Allocator& be) : be_(be) {}
  Tensor alloc(DType t, Shape s);
  // Frees everything allocated since construction/the last reset. If more than one block
  // was needed, replaces them by one block of the high-water size.
  void reset();
  size_t high_water() const { return high_water_; }
  size_t capacity() const;
  int64_t device_allocations() const { return device_allocs_; }  // calls to Allocator::alloc

 private:
  struct Block {
    Buffer buf;
    size_t used = 0;
  };
  Allocator& be_;
  std::vector<Block> blocks_;
  size_t in_use_ = 0, high_water_ = 0;
  int64_t device_allocs_ = 0;
};

}  // namespace dtrain

#pragma once
// Where device memory comes from: the one thing core/ needs of a backend (Buffer and Arena
// allocate through it). Backend implements it; core never sees the ops.
#include <cstddef>

#include "core/device.h"

namespace dtrain {

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  virtual void* alloc(size_t bytes) = 0;  // aligned to 256 bytes; throws on OOM
  virtual void free(void* p) = 0;
};

}  // namespace dtrain

#pragma once
// The host side of optimizer offload (optim/optimizer.h, parallel.offload): shared by
// optimizer.cpp (which owns it) and offload.cpp (which runs the pipeline).
#include <memory>
#include <vector>

#include "optim/optimizer.h"

namespace dtrain {

// Buffer's allocator for host staging: Backend::alloc_host (pinned on CUDA); tensors over it
// are CPU tensors, which the host backend's kernels take.
class HostAllocator final : public Allocator {
 public:
  explicit HostAllocator(Backend& be) : be_(be) {}
  Device device() const override { return Device::cpu(); }
  void* alloc(size_t bytes) override { return be_.alloc_host(bytes); }
  void free(void* p) override { be_.free_host(p); }

 private:
  Backend& be_;
};

struct Optimizer::Offload {
  struct Chunk {
    int64_t begin = 0, count = 0;
    std::vector<ParamSegment> segs;  // relative to the chunk
  };
  explicit Offload(Backend& dev) : alloc(dev) {}
  HostAllocator alloc;
  std::unique_ptr<Backend> own_host;  // the CPU backend the update runs on (device is not the CPU)
  Backend* host = nullptr;
  Buffer master, grads;  // f32 [local_] on the host
  std::vector<Chunk> chunks;
  bool master_fresh = false;
};

}  // namespace dtrain

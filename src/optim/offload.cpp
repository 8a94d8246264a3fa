// Optimizer offload (parallel.offload = "optimizer"; optim/optimizer.h): host-resident master
// weights, gradient staging and optimizer state, and the chunked copy/update pipeline.
#include <algorithm>
#include <cstring>

#include "optim/offload.h"

namespace dtrain {

Optimizer::~Optimizer() = default;

Allocator& Optimizer::host_allocator() const { return off_->alloc; }

int64_t Optimizer::offload_chunks() const { return off_ ? int64_t(off_->chunks.size()) : 0; }

void Optimizer::enable_offload(const OffloadOptions& o) {
  DTRAIN_CHECK(states_.empty() && steps_ == 0, "enable_offload after the optimizer state was made");
  DTRAIN_CHECK(o.chunk_elems > 0, "offload chunk of {} elements", o.chunk_elems);
  off_ = std::make_unique<Offload>(be_);
  Offload& f = *off_;
  if (be_.device().is_cpu()) {
    f.host = &be_;  // the same kernels on the same memory: the "copies" are memcpy
  } else {
    f.own_host = make_backend("cpu", 0, o.host_threads);
    f.host = f.own_host.get();
  }
  f.master = Buffer(f.alloc, size_t(local_) * 4);
  f.grads = Buffer(f.alloc, size_t(local_) * 4);
  for (int64_t b = 0; b < local_; b += o.chunk_elems) {
    Offload::Chunk c{b, std::min(o.chunk_elems, local_ - b), {}};
    for (const ParamSegment& s : segs_) {
      const int64_t lo = std::max(s.offset, c.begin), hi = std::min(s.offset + s.count, c.begin + c.count);
      if (lo < hi) c.segs.push_back({lo - c.begin, hi - lo, s.decay});
    }
    f.chunks.push_back(std::move(c));
  }
}

// Chunk k's gradients come device->host while the host updates chunk k-1 and chunk k-2's
// parameters go host->device: D2H(k+1) is issued before the update of k, whose H2D follows
// it. Every chunk's elements are updated by the same elementwise kernel as without offload.
void Optimizer::run_offloaded(const Update& u) {
  Offload& f = *off_;
  if (local_ == 0) return;
  Tensor dp = params(), dg = grads();
  float* hp = static_cast<float*>(f.master.data());
  float* hg = static_cast<float*>(f.grads.data());
  if (!f.master_fresh) {  // the device parameters are the truth until the first update
    be_.copy_to_host(hp, dp.data, size_t(local_) * 4);
    f.master_fresh = true;
  }
  auto d2h = [&](const Offload::Chunk& c) {
    return be_.copy_to_host_async(hg + c.begin, dg.f32() + c.begin, size_t(c.count) * 4);
  };
  const size_t K = f.chunks.size();
  uint64_t next = d2h(f.chunks[0]), last_h2d = 0;
  std::vector<Tensor> st(states_.size());
  for (size_t k = 0; k < K; ++k) {
    const Offload::Chunk& c = f.chunks[k];
    const uint64_t cur = next;
    if (k + 1 < K) next = d2h(f.chunks[k + 1]);
    be_.copy_wait(cur);
    Tensor p(hp + c.begin, DType::F32, Device::cpu(), Shape{c.count});
    const Tensor g(hg + c.begin, DType::F32, Device::cpu(), Shape{c.count});
    for (size_t i = 0; i < states_.size(); ++i)
      st[i] = Tensor(static_cast<float*>(states_[i].buf.data()) + c.begin, DType::F32, Device::cpu(), Shape{c.count});
    if (!c.segs.empty()) u(*f.host, p, g, st, c.segs);
    last_h2d = be_.copy_from_host_async(dp.f32() + c.begin, hp + c.begin, size_t(c.count) * 4);
  }
  be_.copy_wait(last_h2d);  // the host master is not written again before its copy is done
  be_.copy_join();          // and the device reads the new parameters after it
}

}  // namespace dtrain

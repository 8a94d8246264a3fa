// Out-of-line defaults of the Backend interface for optional capabilities: each is guarded
// by a query (supports(Op::Conv2dCat), can_capture()) that callers check first.
#include "backend/backend.h"

#include <algorithm>
#include <cstdlib>

#include "core/buffer.h"

#include "core/error.h"

namespace dtrain {

void Backend::conv2d_fwd_cat(const Tensor&, const Tensor&, const Tensor&, Tensor&, const Conv2dParams&) {
  fault("the {} backend has no convolution over a concatenation (check supports(Op::Conv2dCat))", name());
}
void Backend::conv2d_bwd_data_cat(const Tensor&, const Tensor&, Tensor&, Tensor&, const Conv2dParams&) {
  fault("the {} backend has no convolution over a concatenation (check supports(Op::Conv2dCat))", name());
}
void Backend::conv2d_bwd_filter_cat(const Tensor&, const Tensor&, const Tensor&, Tensor&, const Conv2dParams&,
                                    bool) {
  fault("the {} backend has no convolution over a concatenation (check supports(Op::Conv2dCat))", name());
}

void Backend::capture_begin() { fault("the {} backend cannot capture graphs (train.cuda_graph needs CUDA)", name()); }
std::unique_ptr<DeviceGraph> Backend::capture_end() {
  fault("the {} backend cannot capture graphs (train.cuda_graph needs CUDA)", name());
}

void* Backend::alloc_host(size_t bytes) {
  const size_t n = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  void* p = std::aligned_alloc(256, n);
  if (!p) fault("out of host memory: {} bytes requested for host staging (parallel.offload)", bytes);
  return p;
}
void Backend::free_host(void* p) { std::free(p); }
uint64_t Backend::copy_to_host_async(void* dst, const void* src, size_t bytes) {
  copy_to_host(dst, src, bytes);
  return 0;
}
uint64_t Backend::copy_from_host_async(void* dst, const void* src, size_t bytes) {
  copy_from_host(dst, src, bytes);
  return 0;
}
void Backend::copy_wait(uint64_t) {}

Stream& Backend::compute_stream() {
  if (!compute_) compute_ = std::make_unique<Stream>("compute", checker_);
  return *compute_;
}
std::unique_ptr<Stream> Backend::make_stream(const std::string& name) {
  return std::make_unique<Stream>(name, checker_);
}

void copy_to_host_f32(Backend& be, Arena& scratch, const Tensor& t, std::vector<float>& out) {
  out.resize(size_t(t.numel()));
  Tensor t32 = t;
  if (t.dtype != DType::F32) {
    t32 = scratch.alloc(DType::F32, t.shape);
    be.cast(t, t32);
  }
  be.copy_to_host(out.data(), t32.data, t32.nbytes());
}


}  // namespace dtrain

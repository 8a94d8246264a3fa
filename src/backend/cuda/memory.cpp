// Caching device allocator. Sizes are rounded up (512 B small, 2 MiB above 16 MiB);
// a request reuses the smallest cached block that fits without wasting more than a
// quarter of it. On cudaMalloc failure the cache is released and the call retried once;
// a second failure throws RuntimeFault with the sizes and the recipe knobs that reduce
// memory.
#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "core/log.h"

namespace dtrain {
namespace {

size_t round_size(size_t b) {
  if (b == 0) b = 1;
  const size_t small = 512, big = size_t(2) << 20;
  size_t q = b > (size_t(16) << 20) ? big : small;
  return (b + q - 1) / q * q;
}
double mib(size_t b) { return double(b) / (1024.0 * 1024.0); }

}  // namespace

CudaAllocator::~CudaAllocator() {
  release_cached();
  // Blocks still live at shutdown belong to owners destroyed after the backend (a bug in
  // their order); free them so the process does not leak device memory.
  for (auto& [p, sz] : live_) {
    cudaFree(p);
    cuda_frees_++;
  }
}

void* CudaAllocator::alloc(size_t bytes) {
  size_t sz = round_size(bytes);
  auto it = free_.lower_bound(sz);
  if (it != free_.end() && it->first <= sz + sz / 4) {
    void* p = it->second;
    size_t got = it->first;
    free_.erase(it);
    cached_ -= got;
    live_[p] = got;
    in_use_ += got;
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, sz);
  if (e == cudaErrorMemoryAllocation && cached_ > 0) {
    (void)cudaGetLastError();
    release_cached();
    e = cudaMalloc(&p, sz);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (e == cudaErrorStreamCaptureUnsupported || e == cudaErrorStreamCaptureInvalidated ||
        e == cudaErrorStreamCaptureImplicit)
      fault("cuda:{}: {:.1f} MiB of device memory requested while a CUDA graph was being captured ({}): "
            "the captured step allocated; set train.cuda_graph = false",
            device_, mib(bytes), cudaGetErrorString(e));
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    (void)cudaGetLastError();
    fault(
        "CUDA out of memory on cuda:{}: requested {:.1f} MiB with {:.1f} MiB in use by dtrain "
        "(peak {:.1f} MiB; device free {:.1f} of {:.1f} MiB; {}). Reduce train.batch_size "
        "(and raise train.grad_accum to keep the effective batch), or set precision.dtype = "
        "\"bf16\" to halve activation memory",
        device_, mib(bytes), mib(in_use_), mib(peak_), mib(free_b), mib(total_b),
        cudaGetErrorString(e));
  }
  cuda_mallocs_++;
  live_[p] = sz;
  in_use_ += sz;
  peak_ = std::max(peak_, in_use_);
  return p;
}

void CudaAllocator::free(void* p) {
  if (!p) return;
  auto it = live_.find(p);
  DTRAIN_CHECK(it != live_.end(), "CudaAllocator::free of {} which this backend did not allocate",
               p);
  in_use_ -= it->second;
  cached_ += it->second;
  free_.emplace(it->second, p);
  live_.erase(it);
}

void CudaAllocator::release_cached() {
  if (free_.empty()) return;
  cudaDeviceSynchronize();  // cached blocks may still be read by queued kernels
  for (auto& [sz, p] : free_) {
    cudaFree(p);
    cuda_frees_++;
  }
  free_.clear();
  cached_ = 0;
}

void* DeviceScratch::get(size_t bytes) {
  if (bytes <= bytes_ && p_) return p_;
  reset();
  p_ = a_.alloc(bytes);
  bytes_ = bytes;
  allocations_++;
  return p_;
}

void DeviceScratch::reset() {
  if (p_) a_.free(p_);
  p_ = nullptr;
  bytes_ = 0;
}

}  // namespace dtrain

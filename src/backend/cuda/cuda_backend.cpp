// CudaBackend: construction (device, stream, library handles), memory, supports(),
// the factory functions registry.cpp calls. Op bodies live in ops.cpp, gemm.cpp, conv.cpp.
#include "backend/cuda/cuda_backend.h"

#include <cuda_profiler_api.h>
#include <cudnn.h>
#include <fmt/format.h>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_stream.h"
#include "backend/cuda/plans.h"
#include "core/log.h"

namespace dtrain {

CudaBackend::CudaBackend(int device_index)
    : dev_(device_index),
      alloc_(device_index),
      gemm_ws_(alloc_),
      conv_ws_(alloc_),
      scratch_(alloc_),
      segs_dev_(alloc_),
      cat_ws_(alloc_),
      mixed_ws_(alloc_) {
  unfused_ = cuda_unfused_from_env();  // first: a bad value is a UserError before any resource exists
  if (unfused_.any())
    log::warn("DTRAIN_CUDA_UNFUSED: running{}{}{} as separate passes", unfused_.gelu_epilogue ? " gelu_epilogue" : "",
              unfused_.bgrad_epilogue ? " bgrad_epilogue" : "", unfused_.conv_cat ? " conv_cat" : "");
  std::string what = fmt::format("CudaBackend(cuda:{})", dev_);
  DTRAIN_CUDA_CHECK(cudaSetDevice(dev_), what);
  DTRAIN_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, dev_),
                    what);
  DTRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), what);
  try {
    DTRAIN_CUBLAS_CHECK(cublasLtCreate(&lt_), what);
    DTRAIN_CUDNN_CHECK(cudnnCreate(&cudnn_), what);
    DTRAIN_CUDNN_CHECK(cudnnSetStream(cudnn_, stream_), what);
    reduce_dev_ = static_cast<double*>(alloc_.alloc((cuda_kernels::kReduceBlocks + 2) * sizeof(double)));
    DTRAIN_CUDA_CHECK(cudaMallocHost(&host_pinned_, 16), what);
  } catch (...) {
    if (reduce_dev_) alloc_.free(reduce_dev_);
    if (cudnn_) cudnnDestroy(cudnn_);
    if (lt_) cublasLtDestroy(lt_);
    cudaStreamDestroy(stream_);
    throw;
  }
}

CudaBackend::~CudaBackend() {
  cudaStreamSynchronize(stream_);
  release_copy_streams();
  gemm_plans_.clear();
  conv_plans_.clear();
  if (reduce_dev_) alloc_.free(reduce_dev_);
  if (host_pinned_) cudaFreeHost(host_pinned_);
  if (cudnn_) cudnnDestroy(cudnn_);
  if (lt_) cublasLtDestroy(lt_);
  compute_wrap_.reset();
  if (stream_) cudaStreamDestroy(stream_);
  // scratch buffers and the allocator are members: released after this body.
}

void CudaBackend::set_allow_tf32(bool on) { allow_tf32_ = on; }  // part of every plan key

std::string CudaBackend::describe() const {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, dev_) != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("cuda:{} (properties unavailable)", dev_);
  }
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  size_t cv = cudnnGetVersion();
  return fmt::format("{} (sm_{}{}, {:.1f} GiB, {} SMs, runtime {}.{}, driver {}.{}, cuDNN {}.{}.{})",
                     prop.name, prop.major, prop.minor,
                     double(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0),
                     prop.multiProcessorCount, rt / 1000, (rt % 1000) / 10, drv / 1000,
                     (drv % 1000) / 10, cv / 10000, (cv % 10000) / 100, cv % 100);
}

bool CudaBackend::supports(Op op, DType t) const {
  if (op == Op::Conv2dCat && unfused_.conv_cat) return false;
  if (t == DType::F32) return true;
  if (t != DType::BF16 && t != DType::F16) return false;
  switch (op) {
    case Op::SgdStep:
    case Op::AdamWStep:
      return false;  // master weights and optimizer state are f32
    default:
      return true;
  }
}

// ---- memory ----
void* CudaBackend::alloc(size_t bytes) {
  void* p = alloc_.alloc(bytes);
  allocs_++;
  return p;
}
void CudaBackend::free(void* p) {
  if (!p) return;
  alloc_.free(p);
  frees_++;
}

AllocCounts CudaBackend::alloc_counts() const {
  AllocCounts c;
  c.allocs = allocs_;
  c.frees = frees_;
  // reduce_dev_ (one block from alloc_ at construction) is internal too
  c.internal = (reduce_dev_ ? 1 : 0) + gemm_ws_.allocations() + conv_ws_.allocations() + scratch_.allocations() +
               segs_dev_.allocations() + cat_ws_.allocations() + mixed_ws_.allocations() +
               int64_t(gemm_plans_.size()) + int64_t(conv_plans_.size());
  c.system_allocs = alloc_.cuda_mallocs() + (host_pinned_ ? 1 : 0) + host_allocs_;  // + cudaMallocHost/HostAlloc
  c.system_frees = alloc_.cuda_frees() + host_frees_;
  c.bytes_in_use = int64_t(alloc_.in_use());
  c.peak_bytes = int64_t(alloc_.peak());
  return c;
}

void CudaBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  // Pageable source: the call returns once the data is staged, so src may be reused.
  DTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_),
                    fmt::format("copy_from_host {} bytes", bytes));
}
void CudaBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  DTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
                    fmt::format("copy_to_host {} bytes", bytes));
  DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream_), fmt::format("copy_to_host {} bytes", bytes));
}
void CudaBackend::copy_device(void* dst, const void* src, size_t bytes) {
  if (!bytes || dst == src) return;
  DTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
                    fmt::format("copy_device {} bytes", bytes));
}
void CudaBackend::synchronize() {
  DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream_), "synchronize");
}
Stream& CudaBackend::compute_stream() {
  if (!compute_wrap_) compute_wrap_ = std::make_unique<CudaStream>("compute", checker_, dev_, stream_);
  return *compute_wrap_;
}
std::unique_ptr<Stream> CudaBackend::make_stream(const std::string& name) {
  return std::make_unique<CudaStream>(name, checker_, dev_);
}
void CudaBackend::profiler_range(bool start) {
  DTRAIN_CUDA_CHECK(cudaDeviceSynchronize(), "profiler_range");
  DTRAIN_CUDA_CHECK(start ? cudaProfilerStart() : cudaProfilerStop(), "profiler_range");
}

// ---- factories (registry.cpp) ----
std::unique_ptr<Backend> make_cuda_backend(int device_index, const BackendOptions& opts) {
  auto be = std::make_unique<CudaBackend>(device_index);
  be->set_allow_tf32(opts.allow_tf32);
  be->set_cudnn_benchmark(opts.cudnn_benchmark);
  log::debug("cuda backend: {}", be->describe());
  return be;
}

int cuda_device_count_impl() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: not an error for "auto"
    return 0;
  }
  return n;
}

}  // namespace dtrain

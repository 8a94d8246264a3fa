// `dtrain version` and `dtrain info`: the build and the libraries/devices it sees.
// `info` must succeed on a machine without a GPU, even in a CUDA build.
#include <cblas.h>
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.h>

#include <string>
#include <thread>

#include "cli/commands.h"

#ifdef DTRAIN_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nccl.h>
#endif

namespace dtrain {

namespace {

std::string compiler() {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "GCC " __VERSION__;
#else
  return "unknown";
#endif
}

const char* dnnl_runtime(unsigned r) {
  switch (r) {
    case DNNL_RUNTIME_SEQ: return "sequential";
    case DNNL_RUNTIME_OMP: return "OpenMP";
    case DNNL_RUNTIME_TBB: return "TBB";
    case DNNL_RUNTIME_THREADPOOL: return "threadpool";
    default: return "none";
  }
}

#ifdef DTRAIN_WITH_CUDA
// CUDA runtime/driver versions are 1000*major + 10*minor.
std::string cuda_ver(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

void print_cuda() {
  fmt::print("CUDA backend: built (archs {})\n", DTRAIN_CUDA_ARCHS);
  int rt = 0, drv = 0;
  if (cudaRuntimeGetVersion(&rt) == cudaSuccess) fmt::print("  CUDA runtime: {}\n", cuda_ver(rt));
  cudaError_t de = cudaDriverGetVersion(&drv);
  if (de == cudaSuccess && drv > 0) fmt::print("  CUDA driver: {}\n", cuda_ver(drv));
  else fmt::print("  CUDA driver: not found\n");
  size_t dnn = cudnnGetVersion();
  // cuDNN >= 9: 10000*major + 100*minor + patch; cuDNN 8: 1000*major + 100*minor + patch.
  if (dnn >= 90000) fmt::print("  cuDNN: {}.{}.{}\n", dnn / 10000, (dnn % 10000) / 100, dnn % 100);
  else fmt::print("  cuDNN: {}.{}.{}\n", dnn / 1000, (dnn % 1000) / 100, dnn % 100);
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) {
    if (nccl >= 20900) fmt::print("  NCCL: {}.{}.{}\n", nccl / 10000, (nccl % 10000) / 100, nccl % 100);
    else fmt::print("  NCCL: {}.{}.{}\n", nccl / 1000, (nccl % 1000) / 100, nccl % 100);
  }
  size_t lt = cublasLtGetVersion();
  fmt::print("  cuBLASLt: {}.{}.{}\n", lt / 10000, (lt % 10000) / 100, lt % 100);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    fmt::print("  no CUDA devices ({})\n", cudaGetErrorString(e));
    cudaGetLastError();  // reset the runtime error state
    return;
  }
  if (n == 0) {
    fmt::print("  no CUDA devices\n");
    return;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      fmt::print("  device {}: properties unavailable\n", i);
      continue;
    }
    fmt::print("  device {}: {}, {:.1f} GiB, {} SMs, compute capability {}.{}\n", i, p.name,
               double(p.totalGlobalMem) / (1024.0 * 1024 * 1024), p.multiProcessorCount, p.major,
               p.minor);
  }
}
#endif

}  // namespace

int cmd_version() {
  fmt::print("dtrain {}\n", DTRAIN_VERSION);
  return 0;
}

int cmd_info() {
  fmt::print("dtrain {}\n", DTRAIN_VERSION);
#ifdef NDEBUG
  fmt::print("build: release (optimized, NDEBUG)\n");
#else
  fmt::print("build: debug\n");
#endif
  fmt::print("compiler: {}\n", compiler());
  fmt::print("CPU threads: {}\n", std::thread::hardware_concurrency());
  fmt::print("OpenBLAS: {} ({} threads)\n", openblas_get_config(), openblas_get_num_threads());
  const dnnl_version_t* d = dnnl_version();
  fmt::print("oneDNN: {}.{}.{} ({}, {} runtime)\n", d->major, d->minor, d->patch, d->hash,
             dnnl_runtime(d->cpu_runtime));
#ifdef DTRAIN_WITH_CUDA
  print_cuda();
#else
  fmt::print("CUDA backend: not built (configure with DTRAIN_CUDA=ON and nvcc to build it)\n");
#endif
  return 0;
}

}  // namespace dtrain

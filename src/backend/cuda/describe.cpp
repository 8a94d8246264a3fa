// What `dtrain info` says of the CUDA backend: runtime, driver, cuDNN, cuBLASLt, devices.
// Must work on a machine without a GPU (or without a driver).
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <fmt/format.h>

#include <string>
#include <vector>

namespace dtrain {

namespace {
// CUDA runtime/driver versions are 1000*major + 10*minor.
std::string cuda_ver(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }
}  // namespace

std::vector<std::string> describe_cuda_backend() {
  std::vector<std::string> out;
  out.push_back(fmt::format("CUDA backend: built (archs {})", DTRAIN_CUDA_ARCHS));
  int rt = 0, drv = 0;
  if (cudaRuntimeGetVersion(&rt) == cudaSuccess) out.push_back(fmt::format("  CUDA runtime: {}", cuda_ver(rt)));
  const cudaError_t de = cudaDriverGetVersion(&drv);
  out.push_back(de == cudaSuccess && drv > 0 ? fmt::format("  CUDA driver: {}", cuda_ver(drv))
                                             : std::string("  CUDA driver: not found"));
  const size_t dnn = cudnnGetVersion();
  // cuDNN >= 9: 10000*major + 100*minor + patch; cuDNN 8: 1000*major + 100*minor + patch.
  if (dnn >= 90000) out.push_back(fmt::format("  cuDNN: {}.{}.{}", dnn / 10000, (dnn % 10000) / 100, dnn % 100));
  else out.push_back(fmt::format("  cuDNN: {}.{}.{}", dnn / 1000, (dnn % 1000) / 100, dnn % 100));
  const size_t lt = cublasLtGetVersion();
  out.push_back(fmt::format("  cuBLASLt: {}.{}.{}", lt / 10000, (lt % 10000) / 100, lt % 100));
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    out.push_back(fmt::format("  no CUDA devices ({})", cudaGetErrorString(e)));
    cudaGetLastError();  // reset the runtime error state
    return out;
  }
  if (n == 0) out.push_back("  no CUDA devices");
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      out.push_back(fmt::format("  device {}: properties unavailable", i));
      continue;
    }
    out.push_back(fmt::format("  device {}: {}, {:.1f} GiB, {} SMs, compute capability {}.{}", i, p.name,
                              double(p.totalGlobalMem) / (1024.0 * 1024 * 1024), p.multiProcessorCount, p.major,
                              p.minor));
  }
  return out;
}

}  // namespace dtrain

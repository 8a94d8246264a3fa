#include <cstdlib>

#include "backend/backend.h"
#include "backend/checked_backend.h"
#include "core/error.h"
#include "core/log.h"

namespace dtrain {

std::unique_ptr<Backend> make_cpu_backend(int threads);  // backend/cpu
std::vector<std::string> describe_cpu_backend();         // backend/cpu
#ifdef DTRAIN_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int device_index, const BackendOptions& opts);  // backend/cuda
int cuda_device_count_impl();                                  // backend/cuda
std::vector<std::string> describe_cuda_backend();              // backend/cuda
#endif

int cuda_device_count() {
#ifdef DTRAIN_WITH_CUDA
  return cuda_device_count_impl();
#else
  return 0;
#endif
}

namespace {

std::unique_ptr<Backend> make_plain_backend(const std::string& device, int local_rank, int cpu_threads,
                                            const BackendOptions& opts) {
  if (device == "cpu") return make_cpu_backend(cpu_threads);
  if (device != "auto" && device != "cuda")
    user_error("device: expected one of cpu, cuda, auto, got '{}'", device);
  int n = cuda_device_count();
  if (n == 0) {
    if (device == "cuda") {
#ifdef DTRAIN_WITH_CUDA
      user_error("device = \"cuda\" but no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES); use device = \"cpu\" or \"auto\"");
#else
      user_error("device = \"cuda\" but this dtrain was built without CUDA (DTRAIN_CUDA=OFF or no nvcc); use device = \"cpu\" or \"auto\"");
#endif
    }
#ifdef DTRAIN_WITH_CUDA
    log::info("no CUDA device found; running on the CPU");
#endif
    return make_cpu_backend(cpu_threads);
  }
#ifdef DTRAIN_WITH_CUDA
  return make_cuda_backend(local_rank % n, opts);
#else
  return make_cpu_backend(cpu_threads);
#endif
}

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& device, int local_rank, int cpu_threads,
                                      const BackendOptions& opts) {
  const StreamCheckMode check = stream_check_mode();
  auto be = make_plain_backend(device, local_rank, cpu_threads, opts);
  if (check == StreamCheckMode::Off) return be;
  return std::make_unique<CheckedBackend>(std::move(be),
                                          std::make_shared<StreamChecker>(check == StreamCheckMode::Report));
}

std::vector<std::string> describe_backends() {
  std::vector<std::string> out = describe_cpu_backend();
#ifdef DTRAIN_WITH_CUDA
  for (auto& l : describe_cuda_backend()) out.push_back(std::move(l));
#else
  out.push_back("CUDA backend: not built (configure with DTRAIN_CUDA=ON and nvcc to build it)");
#endif
  return out;
}

}  // namespace dtrain

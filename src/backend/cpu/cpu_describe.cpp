// What `dtrain info` says of the CPU backend: the libraries behind it and the threads.
#include <cblas.h>
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.h>

#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"

namespace dtrain {

namespace {

const char* dnnl_runtime(unsigned r) {
  switch (r) {
    case DNNL_RUNTIME_SEQ: return "sequential";
    case DNNL_RUNTIME_OMP: return "OpenMP";
    case DNNL_RUNTIME_TBB: return "TBB";
    case DNNL_RUNTIME_THREADPOOL: return "threadpool";
    default: return "none";
  }
}

}  // namespace

std::vector<std::string> describe_cpu_backend() {
  const dnnl_version_t* d = dnnl_version();
  return {fmt::format("CPUs: {} (this machine)", std::thread::hardware_concurrency()),
          fmt::format("OpenBLAS: {} ({} threads), kernels {}", openblas_get_config(), openblas_get_num_threads(),
                      blas_kernels_note()),
          fmt::format("oneDNN: {}.{}.{} ({}, {} runtime)", d->major, d->minor, d->patch, d->hash,
                      dnnl_runtime(d->cpu_runtime))};
}

}  // namespace dtrain

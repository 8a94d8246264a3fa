#include "obs/nvml.h"

#include <dlfcn.h>
#include <fmt/format.h>

namespace dtrain {

// The few NVML types and entry points used, as nvml.h declares them (ABI-stable).
namespace {
using nvmlReturn_t = int;  // NVML_SUCCESS == 0
struct nvmlDevice_st;
using nvmlDevice_t = nvmlDevice_st*;
struct nvmlUtilization_t {
  unsigned int gpu, memory;  // percent
};
struct nvmlMemory_t {
  unsigned long long total, free, used;  // bytes
};
constexpr unsigned kNameBuffer = 96;  // NVML_DEVICE_NAME_V2_BUFFER_SIZE
}  // namespace

struct Nvml::Api {
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  const char* (*error_string)(nvmlReturn_t) = nullptr;
  nvmlReturn_t (*count)(unsigned int*) = nullptr;
  nvmlReturn_t (*handle)(unsigned int, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*util)(nvmlDevice_t, nvmlUtilization_t*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned int) = nullptr;
};

namespace {
template <typename F>
bool load(void* lib, const char* sym, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, sym));
  return fn != nullptr;
}
}  // namespace

Nvml::Nvml(const std::string& library) {
  lib_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib_) {
    const char* e = dlerror();
    status_ = fmt::format("NVML not available: {}", e ? e : library + " not found");
    return;
  }
  api_ = new Api;
  Api& a = *api_;
  bool all = load(lib_, "nvmlInit_v2", a.init) && load(lib_, "nvmlShutdown", a.shutdown) &&
             load(lib_, "nvmlErrorString", a.error_string) && load(lib_, "nvmlDeviceGetCount_v2", a.count) &&
             load(lib_, "nvmlDeviceGetHandleByIndex_v2", a.handle) &&
             load(lib_, "nvmlDeviceGetUtilizationRates", a.util) && load(lib_, "nvmlDeviceGetMemoryInfo", a.memory) &&
             load(lib_, "nvmlDeviceGetName", a.name);
  if (!all) {
    status_ = fmt::format("NVML not available: {} lacks an expected entry point", library);
    return;
  }
  nvmlReturn_t r = a.init();
  if (r != 0) {
    status_ = fmt::format("NVML not available: nvmlInit_v2: {}", a.error_string(r));
    a.shutdown = nullptr;  // not initialised: nothing to shut down
    return;
  }
  unsigned int n = 0;
  r = a.count(&n);
  if (r != 0) {
    status_ = fmt::format("NVML not available: nvmlDeviceGetCount_v2: {}", a.error_string(r));
    return;
  }
  count_ = int(n);
  ok_ = true;
  status_ = fmt::format("NVML: {} device{}", n, n == 1 ? "" : "s");
}

Nvml::~Nvml() {
  if (api_ && api_->shutdown) api_->shutdown();
  delete api_;
  if (lib_) dlclose(lib_);
}

std::vector<GpuStat> Nvml::sample() const {
  std::vector<GpuStat> out;
  if (!ok_) return out;
  for (int i = 0; i < count_; i++) {
    GpuStat g;
    g.index = i;
    nvmlDevice_t d = nullptr;
    if (api_->handle(unsigned(i), &d) != 0) {
      out.push_back(g);
      continue;
    }
    char name[kNameBuffer] = {0};
    if (api_->name(d, name, kNameBuffer) == 0) g.name = name;
    nvmlUtilization_t u{};
    if (api_->util(d, &u) == 0) g.utilization_ratio = double(u.gpu) / 100.0;
    nvmlMemory_t m{};
    if (api_->memory(d, &m) == 0) {
      g.memory_used_bytes = double(m.used);
      g.memory_total_bytes = double(m.total);
    }
    out.push_back(g);
  }
  return out;
}

}  // namespace dtrain

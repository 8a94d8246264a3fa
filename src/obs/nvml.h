#pragma once
// GPU utilisation and memory through NVML, loaded at run time with dlopen so the binary
// neither links nor needs the NVIDIA driver library: without libnvidia-ml.so.1 (a CPU
// machine, a container without the driver) available() is false and sample() returns
// nothing. Nothing here throws.
//
// NVML numbers devices in PCI bus order, which can differ from CUDA's order (and
// ignores CUDA_VISIBLE_DEVICES); GpuStat::index is NVML's index.
#include <string>
#include <vector>

#include "obs/metrics.h"

namespace dtrain {

class Nvml {
 public:
  explicit Nvml(const std::string& library = "libnvidia-ml.so.1");
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  bool available() const { return ok_; }
  // "NVML: 8 devices" or why NVML is not available (library missing, init error).
  const std::string& status() const { return status_; }
  int device_count() const { return count_; }
  // One GpuStat per device; a field NVML cannot give stays negative. Thread-safe.
  std::vector<GpuStat> sample() const;

 private:
  struct Api;
  void* lib_ = nullptr;
  Api* api_ = nullptr;
  bool ok_ = false;
  int count_ = 0;
  std::string status_;
};

}  // namespace dtrain

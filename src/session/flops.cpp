#include "session/flops.h"

#include "models/model.h"
#include "obs/nvml.h"
#include "obs/peak_flops.h"
#include "session/session.h"

namespace dtrain {

double train_flops_per_unit(const Session& s) {
  if (!s.model) return 0;
  // training = forward + backward (twice the forward: input and weight gradients)
  return 3.0 * s.model->forward_flops(s.height, s.width);
}

std::string peak_precision(const std::string& dtype, bool tf32) {
  if (dtype == "fp32") return tf32 ? "tf32" : "fp32";
  return dtype;
}

double session_peak_flops(const Session& s, Nvml& nvml, int device_index, std::string* name) {
  const double override_tf = s.cfg.observability.peak_tflops;
  std::string dev_name;
  if (s.be->device().is_cuda() && nvml.available()) {
    const auto gpus = nvml.sample();
    for (const auto& g : gpus)
      if (g.index == device_index) dev_name = g.name;
    if (dev_name.empty() && !gpus.empty()) dev_name = gpus.front().name;
  }
  if (name) *name = dev_name;
  if (!s.be->device().is_cuda() && override_tf <= 0) return 0;
  return resolve_peak_flops(dev_name, peak_precision(s.cfg.precision.dtype, s.cfg.precision.tf32),
                            override_tf);
}

}  // namespace dtrain

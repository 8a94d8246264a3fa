#pragma once
// Dynamic loss scaling for fp16 mixed precision, as torch.cuda.amp.GradScaler does it:
// the loss gradient is multiplied by scale() before backward; after backward the f32
// gradients are checked. Any inf/nan: the optimizer step is skipped and the scale is
// multiplied by backoff (0.5). Otherwise the update uses gradients * 1/scale(), and after
// growth_interval clean steps in a row the scale is multiplied by growth (2).
// Disabled (fp32, bf16): scale() is 1 and nothing is checked.
#include <cstdint>

namespace dtrain {

struct LossScalerState {
  double scale = 1.0;
  int64_t good_steps = 0;     // clean steps since the last change of scale
  int64_t skipped_steps = 0;  // steps skipped for non-finite gradients (whole run)
};

class LossScaler {
 public:
  LossScaler() = default;
  LossScaler(bool enabled, double init_scale, int64_t growth_interval, double growth = 2.0,
             double backoff = 0.5);

  bool enabled() const { return enabled_; }
  float scale() const { return enabled_ ? float(st_.scale) : 1.f; }
  // Records the outcome of a step's gradient check; returns true when the step applies.
  bool update(bool grads_finite);

  const LossScalerState& state() const { return st_; }
  void restore(const LossScalerState& s);  // validates (UserError on a bad scale)

 private:
  bool enabled_ = false;
  int64_t growth_interval_ = 2000;
  double growth_ = 2.0, backoff_ = 0.5;
  LossScalerState st_;
};

}  // namespace dtrain

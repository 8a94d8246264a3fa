#include "optim/loss_scaler.h"

#include <cmath>

#include "core/error.h"

namespace dtrain {

LossScaler::LossScaler(bool enabled, double init_scale, int64_t growth_interval, double growth,
                       double backoff)
    : enabled_(enabled), growth_interval_(growth_interval), growth_(growth), backoff_(backoff) {
  DTRAIN_CHECK(init_scale > 0 && std::isfinite(init_scale) && growth_interval >= 1 && growth > 1 &&
                   backoff > 0 && backoff < 1,
               "loss scaler: bad settings scale={} interval={} growth={} backoff={}", init_scale,
               growth_interval, growth, backoff);
  st_.scale = enabled ? init_scale : 1.0;
}

bool LossScaler::update(bool grads_finite) {
  if (!enabled_) return true;
  if (!grads_finite) {
    st_.scale *= backoff_;
    st_.good_steps = 0;
    st_.skipped_steps++;
    return false;
  }
  if (++st_.good_steps >= growth_interval_) {
    // kept finite in f32 (the scale multiplies f32/f16 gradients)
    if (st_.scale * growth_ < 3.0e38) st_.scale *= growth_;
    st_.good_steps = 0;
  }
  return true;
}

void LossScaler::restore(const LossScalerState& s) {
  if (!(s.scale > 0) || !std::isfinite(s.scale) || s.good_steps < 0 || s.skipped_steps < 0)
    user_error("loss scale state: expected a positive finite scale and non-negative counters, got "
               "scale {} good_steps {} skipped_steps {}",
               s.scale, s.good_steps, s.skipped_steps);
  st_ = s;
  if (!enabled_) st_.scale = 1.0;
}

}  // namespace dtrain

// CpuBackend optimizers over flat f32 buffers, exactly the update rules of PyTorch's
// torch.optim.SGD and torch.optim.AdamW (single-tensor, non-amsgrad), applied to the given
// segments (decay = false segments use weight_decay 0). Gradients are multiplied by
// grad_scale first. Elements outside every segment are left untouched.
#include <cmath>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace dtrain {

namespace {
void check_segments(const char* op, const std::vector<ParamSegment>& segs, int64_t n) {
  for (const auto& s : segs)
    if (s.offset < 0 || s.count < 0 || s.offset + s.count > n)
      fault("cpu backend: {}: segment [{}, +{}) outside the buffer of {} elements", op, s.offset,
            s.count, n);
}
void check_state(const char* op, const Tensor& params, std::initializer_list<const Tensor*> ts) {
  if (params.dtype != DType::F32)
    fault("cpu backend: {}: params must be f32 master weights, got {}", op, params.str());
  for (const Tensor* t : ts)
    if (t->dtype != DType::F32 || t->numel() != params.numel())
      fault("cpu backend: {}: {} must be f32 with {} elements like params", op, t->str(),
            params.numel());
}
}  // namespace

// d = g*scale (+ wd*p); buf = first ? d : momentum*buf + (1-dampening)*d;
// d = nesterov ? d + momentum*buf : buf (when momentum != 0); p -= lr*d
void CpuBackend::sgd_step(Tensor& params, const Tensor& grads, Tensor& momentum_buf,
                          const std::vector<ParamSegment>& segments, const SgdArgs& a) {
  require_all(Op::SgdStep, params, grads, momentum_buf);
  const bool use_m = a.momentum != 0.f;
  if (use_m) check_state("sgd_step", params, {&grads, &momentum_buf});
  else check_state("sgd_step", params, {&grads});
  if (a.nesterov && (a.momentum <= 0.f || a.dampening != 0.f))
    user_error("optimizer: nesterov momentum requires momentum > 0 and dampening = 0");
  check_segments("sgd_step", segments, params.numel());
  float* p = params.f32();
  const float* g = grads.f32();
  float* buf = use_m ? momentum_buf.f32() : nullptr;
  for (const auto& s : segments) {
    const float wd = s.decay ? a.weight_decay : 0.f;
    const int64_t b = s.offset, e = s.offset + s.count;
#pragma omp parallel for schedule(static) if (s.count > 65536)
    for (int64_t i = b; i < e; ++i) {
      float d = g[i] * a.grad_scale;
      if (wd != 0.f) d = d + wd * p[i];
      if (use_m) {
        buf[i] = a.first_step ? d : a.momentum * buf[i] + (1.f - a.dampening) * d;
        d = a.nesterov ? d + a.momentum * buf[i] : buf[i];
      }
      p[i] = p[i] - a.lr * d;
    }
  }
}

// p *= 1 - lr*wd; m = lerp(m, g, 1-beta1); v = beta2*v + (1-beta2)*g*g;
// p -= (lr / (1-beta1^t)) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)
void CpuBackend::adamw_step(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                            const std::vector<ParamSegment>& segments, const AdamWArgs& a) {
  require_all(Op::AdamWStep, params, grads, m, v);
  check_state("adamw_step", params, {&grads, &m, &v});
  check_segments("adamw_step", segments, params.numel());
  if (a.step < 1) fault("cpu backend: adamw_step: step must be >= 1, got {}", a.step);
  float* p = params.f32();
  const float* g = grads.f32();
  float* pm = m.f32();
  float* pv = v.f32();
  // Python-side scalars are doubles in PyTorch; they enter the kernels as floats.
  const double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  const double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  const float step_size = float(double(a.lr) / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float w1 = 1.f - a.beta1, b2 = a.beta2, w2 = 1.f - a.beta2;
  for (const auto& s : segments) {
    const float decay = s.decay ? 1.f - a.lr * a.weight_decay : 1.f;
    const int64_t b = s.offset, e = s.offset + s.count;
#pragma omp parallel for schedule(static) if (s.count > 65536)
    for (int64_t i = b; i < e; ++i) {
      const float gi = g[i] * a.grad_scale;
      float pi = p[i] * decay;
      // torch.lerp(m, g, w) for w < 0.5: m + w*(g-m); else g - (g-m)*(1-w)
      const float mi = w1 < 0.5f ? pm[i] + w1 * (gi - pm[i]) : gi - (gi - pm[i]) * (1.f - w1);
      const float vi = b2 * pv[i] + w2 * gi * gi;
      const float denom = std::sqrt(vi) / bc2_sqrt + a.eps;
      pi = pi - step_size * (mi / denom);
      pm[i] = mi, pv[i] = vi, p[i] = pi;
    }
  }
}

}  // namespace dtrain

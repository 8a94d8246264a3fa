#include "models/rope.h"

#include <cmath>

#include "core/error.h"

namespace dtrain {

namespace {
// A value rounded to f32 and kept from being fused into a neighbouring operation (an FMA would
// skip a rounding torch makes: every tensor operation there rounds its result).
float rn(float v) {
  volatile float t = v;
  return t;
}
}  // namespace

std::vector<float> rope_inv_freq(double rope_theta, const RopeScaling& sc, int head_dim) {
  if (head_dim < 2 || head_dim % 2 != 0)
    user_error("model.head_dim: rotary embeddings need an even head size, got {}", head_dim);
  if (!(rope_theta > 0) || !std::isfinite(rope_theta))
    user_error("model.rope_theta: expected a positive number, got {}", rope_theta);
  const int half = head_dim / 2;
  // base ** (arange(0, dim, 2).float() / dim): the base rounded to f32, the pow in f32
  const float base = float(rope_theta);
  std::vector<float> inv(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    const float e = rn(float(2 * i) / float(head_dim));
    inv[size_t(i)] = rn(1.f / rn(std::pow(base, e)));
  }
  if (sc.rope_type == "default") return inv;
  if (sc.rope_type != "llama3")
    user_error("model.rope_scaling.rope_type: expected \"default\" or \"llama3\", got \"{}\"", sc.rope_type);
  if (!(sc.factor > 0) || !(sc.low_freq_factor > 0) || !(sc.high_freq_factor > sc.low_freq_factor) ||
      sc.original_max_position_embeddings < 1)
    user_error("model.rope_scaling: llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
               "original_max_position_embeddings >= 1 (got {}, {}, {}, {})", sc.factor, sc.low_freq_factor,
               sc.high_freq_factor, sc.original_max_position_embeddings);
  // python floats (double) where transformers computes on scalars; f32 where on tensors (a
  // python scalar meeting an f32 tensor is used as an f32)
  const double old = double(sc.original_max_position_embeddings);
  const float low_wavelen = float(old / sc.low_freq_factor), high_wavelen = float(old / sc.high_freq_factor);
  const float two_pi = float(2 * M_PI), factor = float(sc.factor), lf = float(sc.low_freq_factor);
  const float span = float(sc.high_freq_factor - sc.low_freq_factor), oldf = float(old);
  for (float& f : inv) {
    const float wavelen = rn(two_pi / f);
    const float llama = wavelen > low_wavelen ? rn(f / factor) : f;
    const float smooth = rn(rn(rn(oldf / wavelen) - lf) / span);
    const float smoothed = rn(rn(rn(rn(1.f - smooth) * llama) / factor) + rn(smooth * llama));
    const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
    f = medium ? smoothed : llama;
  }
  return inv;
}

void rope_tables(const std::vector<float>& inv, int positions, std::vector<float>& cos, std::vector<float>& sin) {
  const size_t half = inv.size();
  cos.assign(size_t(positions) * half, 0.f);
  sin.assign(size_t(positions) * half, 0.f);
  for (int p = 0; p < positions; ++p)
    for (size_t i = 0; i < half; ++i) {
      const float angle = rn(inv[i] * float(p));  // (inv_freq @ position_ids) in f32
      cos[size_t(p) * half + i] = float(std::cos(double(angle)));
      sin[size_t(p) * half + i] = float(std::sin(double(angle)));
    }
}

}  // namespace dtrain

// CpuBackend: tensor parallelism's cross-entropy over a vocabulary slice (backend.h,
// "vocabulary-parallel cross-entropy"), one row per sample; exp in f32, sums in double.
#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace dtrain {

namespace {

void check_rows(const char* op, const Tensor& logits, int64_t valid) {
  if (logits.ndim() != 2) fault("cpu backend: {}: logits {} must be [N,Vl]", op, logits.str());
  if (valid < 0 || valid > logits.dim(1))
    fault("cpu backend: {}: {} real columns of logits {}", op, valid, logits.str());
}

void check_f32(const char* op, const Tensor& t, const char* what, int64_t n) {
  if (t.dtype != DType::F32 || t.numel() != n) fault("cpu backend: {}: {} {} must be f32 [{}]", op, what, t.str(), n);
}

void check_labels(const char* op, const Tensor& labels, int64_t n) {
  if (labels.dtype != DType::I32 || labels.numel() != n)
    fault("cpu backend: {}: labels {} must be i32 [{}]", op, labels.str(), n);
}

}  // namespace

void CpuBackend::vocab_xent_max(const Tensor& logits, int64_t valid, Tensor& mx) {
  const char* op = "vocab_xent_max";
  require(Op::VocabXent, logits);
  check_rows(op, logits, valid);
  const int64_t N = logits.dim(0), Vl = logits.dim(1);
  check_f32(op, mx, "mx", N);
  const float* z = in_f32(logits, 0);
  float* m = mx.f32();
#pragma omp parallel for schedule(static) if (N * valid > 16384)
  for (int64_t i = 0; i < N; ++i) {
    float v = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < valid; ++c) v = std::max(v, z[i * Vl + c]);
    m[i] = v;
  }
}

void CpuBackend::vocab_xent_parts(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                  int64_t classes, const Tensor& gmax, Tensor& parts) {
  const char* op = "vocab_xent_parts";
  require(Op::VocabXent, logits);
  check_rows(op, logits, valid);
  const int64_t N = logits.dim(0), Vl = logits.dim(1);
  check_labels(op, labels, N);
  check_f32(op, gmax, "gmax", N);
  check_f32(op, parts, "parts", 2 * N);
  const int32_t* lab = labels.i32();
  for (int64_t i = 0; i < N; ++i)
    if ((lab[i] < 0 || lab[i] >= classes) && lab[i] != kIgnoreTarget)
      user_error("cross-entropy: target token {} at position {} is outside [0, {})", lab[i], i, classes);
  const float* z = in_f32(logits, 0);
  const float* m = gmax.f32();
  float* out = parts.f32();
#pragma omp parallel for schedule(static) if (N * valid > 16384)
  for (int64_t i = 0; i < N; ++i) {
    const float* zi = z + i * Vl;
    double se = 0;
    for (int64_t c = 0; c < valid; ++c) se += std::exp(zi[c] - m[i]);
    const int64_t y = lab[i] - offset;
    out[2 * i] = float(se);
    out[2 * i + 1] = y >= 0 && y < valid ? zi[y] : 0.f;
  }
}

void CpuBackend::vocab_xent_finish(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                   const Tensor& gmax, const Tensor& sums, float grad_scale, Tensor& losses,
                                   Tensor& dlogits) {
  const char* op = "vocab_xent_finish";
  require_all(Op::VocabXent, logits, dlogits);
  check_rows(op, logits, valid);
  const int64_t N = logits.dim(0), Vl = logits.dim(1);
  check_labels(op, labels, N);
  check_f32(op, gmax, "gmax", N);
  check_f32(op, sums, "sums", 2 * N);
  if (losses.defined()) check_f32(op, losses, "losses", N);
  if (dlogits.defined() && (dlogits.numel() != logits.numel() || dlogits.dtype != logits.dtype))
    fault("cpu backend: {}: dlogits {} differs from logits {}", op, dlogits.str(), logits.str());
  const int32_t* lab = labels.i32();
  const float* z = in_f32(logits, 0);
  const float* m = gmax.f32();
  const float* s = sums.f32();
  float* loss = losses.defined() ? losses.f32() : nullptr;
  float* dz = out_f32(dlogits, 1, false);
#pragma omp parallel for schedule(static) if (N * Vl > 16384)
  for (int64_t i = 0; i < N; ++i) {
    const bool ignored = lab[i] == kIgnoreTarget;  // not a target: no loss, no gradient
    if (loss) loss[i] = ignored ? 0.f : float(double(m[i]) + std::log(double(s[2 * i])) - double(s[2 * i + 1]));
    if (!dz) continue;
    const float* zi = z + i * Vl;
    float* di = dz + i * Vl;
    if (ignored) {
      std::fill(di, di + Vl, 0.f);
      continue;
    }
    const float inv = float(1.0 / double(s[2 * i]));
    const int64_t y = lab[i] - offset;
    for (int64_t c = 0; c < valid; ++c) di[c] = grad_scale * (std::exp(zi[c] - m[i]) * inv - (c == y ? 1.f : 0.f));
    for (int64_t c = valid; c < Vl; ++c) di[c] = 0.f;
  }
  store_f32(dz, dlogits);
}

}  // namespace dtrain

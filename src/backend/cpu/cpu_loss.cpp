// CpuBackend softmax cross-entropy, per sample, numerically stable (max subtracted, sums in
// double). Label smoothing as torch.nn.CrossEntropyLoss(label_smoothing=s):
//   target = (1-s)*onehot(label) + s/C,   loss = logsumexp(z) - sum_c target_c * z_c
//   dlogits = grad_scale * (softmax(z) - target)
#include <cmath>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace dtrain {

void CpuBackend::softmax_xent(const Tensor& logits, const Tensor& labels, float label_smoothing,
                              float grad_scale, Tensor& losses, Tensor& dlogits) {
  require(Op::SoftmaxXent, logits);
  require(Op::SoftmaxXent, dlogits);
  if (logits.ndim() != 2)
    fault("cpu backend: softmax_xent: logits {} must be [N,C]", logits.str());
  const int64_t N = logits.dim(0), C = logits.dim(1);
  if (labels.dtype != DType::I32 || labels.numel() != N)
    fault("cpu backend: softmax_xent: labels {} must be i32 [{}]", labels.str(), N);
  if (losses.defined() && (losses.dtype != DType::F32 || losses.numel() != N))
    fault("cpu backend: softmax_xent: losses {} must be f32 [{}]", losses.str(), N);
  if (dlogits.defined() && dlogits.numel() != logits.numel())
    fault("cpu backend: softmax_xent: dlogits {} differs from logits {}", dlogits.str(),
          logits.str());
  if (!(label_smoothing >= 0.f && label_smoothing <= 1.f))
    user_error("label_smoothing: expected a value in [0, 1], got {}", label_smoothing);
  const int32_t* lab = labels.i32();
  for (int64_t i = 0; i < N; ++i)
    if (lab[i] < 0 || lab[i] >= C)
      user_error("softmax_xent: label {} of sample {} is outside [0, {})", lab[i], i, C);
  const float* z = in_f32(logits, 0);
  float* dz = out_f32(dlogits, 1, false);
  float* loss = losses.defined() ? losses.f32() : nullptr;
  const double s = label_smoothing, off = s / double(C), on = 1.0 - s + off;
#pragma omp parallel for schedule(static) if (N * C > 16384)
  for (int64_t i = 0; i < N; ++i) {
    const float* zi = z + i * C;
    float m = zi[0];
    for (int64_t c = 1; c < C; ++c) m = std::max(m, zi[c]);
    double se = 0, sz = 0;
    for (int64_t c = 0; c < C; ++c) {
      se += std::exp(double(zi[c]) - m);
      sz += zi[c];
    }
    const double lse = double(m) + std::log(se);
    const int64_t y = lab[i];
    if (loss) loss[i] = float(lse - (1.0 - s) * zi[y] - off * sz);
    if (dz) {
      float* di = dz + i * C;
      const double inv = 1.0 / se;
      for (int64_t c = 0; c < C; ++c) {
        const double p = std::exp(double(zi[c]) - m) * inv;
        di[c] = float(grad_scale * (p - (c == y ? on : off)));
      }
    }
  }
  store_f32(dz, dlogits);
}

}  // namespace dtrain

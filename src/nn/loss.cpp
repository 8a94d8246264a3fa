#include "nn/loss.h"

#include <vector>

namespace dtrain {

SoftmaxCrossEntropy::SoftmaxCrossEntropy(float label_smoothing) : smoothing_(label_smoothing) {
  if (!(label_smoothing >= 0.f && label_smoothing <= 1.f))
    user_error("label_smoothing: expected a value in [0, 1], got {}", label_smoothing);
}

Tensor SoftmaxCrossEntropy::forward(Ctx& ctx, const Tensor& logits, const Tensor& labels,
                                    float loss_scale, int64_t mean_over) {
  DTRAIN_CHECK(logits.ndim() == 2, "cross-entropy: logits {} are not [N, C]", logits.shape.str());
  DTRAIN_CHECK(labels.dtype == DType::I32 && labels.numel() == logits.dim(0),
               "cross-entropy: labels {} for logits {}", labels.str(), logits.str());
  const int64_t n = logits.dim(0);
  Tensor losses = ctx.arena.alloc(DType::F32, Shape{n});
  dlogits_ = ctx.training ? ctx.arena.alloc(logits.dtype, logits.shape) : Tensor();
  const float denom = float(mean_over > 0 ? mean_over : n);
  ctx.be.softmax_xent(logits, labels, smoothing_, loss_scale / denom, losses, dlogits_);
  return losses;
}

Tensor SoftmaxCrossEntropy::backward() const {
  DTRAIN_CHECK(dlogits_.defined(), "cross-entropy: backward without a training forward");
  return dlogits_;
}

double mean_loss(Backend& be, const Tensor& losses) {
  std::vector<float> h(size_t(losses.numel()));
  if (h.empty()) return 0.0;
  be.copy_to_host(h.data(), losses.f32(), h.size() * 4);
  double s = 0;
  for (float v : h) s += v;
  return s / double(h.size());
}

}  // namespace dtrain

#pragma once
// Softmax cross-entropy with label smoothing (PyTorch nn.CrossEntropyLoss semantics,
// reduction = mean over the batch) through Backend::softmax_xent.
#include "nn/module.h"

namespace dtrain {

class SoftmaxCrossEntropy {
 public:
  explicit SoftmaxCrossEntropy(float label_smoothing = 0.f);

  // logits [N, C] (any float dtype), labels i32 [N]. Returns per-sample losses f32 [N]
  // (on the device; use mean_loss() to read the mean). When ctx.training, also computes
  // dlogits = loss_scale / mean_over * d(sum of losses)/dlogits, i.e. the gradient of
  // loss_scale * (sum of losses) / mean_over. mean_over = 0 means N (this batch); with
  // gradient accumulation pass the total batch size over all micro-batches.
  Tensor forward(Ctx& ctx, const Tensor& logits, const Tensor& labels, float loss_scale = 1.f,
                 int64_t mean_over = 0);
  // The dlogits of the last training forward (same dtype and shape as logits).
  Tensor backward() const;

 private:
  float smoothing_;
  Tensor dlogits_;
};

// Mean of a f32 [N] loss vector, read to the host (synchronises).
double mean_loss(Backend& be, const Tensor& losses);

}  // namespace dtrain

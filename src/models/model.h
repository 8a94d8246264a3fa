#pragma once
// A model: one network from input batch to logits/outputs, built into a ParamStore.
#include <cstdint>

#include "nn/module.h"

namespace dtrain {

class Model {
 public:
  virtual ~Model() = default;
  // x: the input batch (images NHWC). Returns the output (logits [N, classes] for
  // classifiers). x must stay valid until backward has run.
  virtual Tensor forward(Ctx& ctx, const Tensor& x) = 0;
  // Accumulates every parameter gradient into the ParamStore's flat grad buffer.
  virtual void backward(Ctx& ctx, const Tensor& dout) = 0;
  // Forward FLOPs of one loss unit, counted from the model's own layer geometry for MFU
  // (the rules: session/flops.h): one height x width image (ResNet, U-Net), or one token of
  // block_size windows (GPT, which has no image geometry and ignores height and width).
  virtual double forward_flops(int64_t height, int64_t width) const = 0;
};

// Counting helpers of forward_flops.
// x after `times` stride-2 convolutions or pools with "same" padding: ceil(x / 2) each time.
inline int64_t halved(int64_t x, int times) {
  for (int i = 0; i < times; ++i) x = (x + 1) / 2;
  return x;
}
// A conv with a k x k kernel (k = 1: also a linear layer) from `in` to `out` channels
// applied at `positions`: 2 * weight elements * positions.
inline double layer_flops(int64_t in, int64_t out, int64_t k, int64_t positions) {
  return 2.0 * double(in * out * k * k) * double(positions);
}

}  // namespace dtrain

#pragma once
// A model: one network from input batch to logits/outputs, built into a ParamStore.
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
};

}  // namespace dtrain

#pragma once
// Layers: Conv2d, BatchNorm2d, Linear, ReLU, MaxPool2d, GlobalAvgPool, Flatten.
// Images are NHWC; conv weights OHWI (checkpoint OIHW); Linear weight [out, in] as PyTorch.
// Outputs have the input's dtype; parameters, grads and BN statistics are f32.
#include <memory>
#include <string>

#include "nn/module.h"

namespace dtrain {

class LoraAdapter;  // nn/lora.h

struct Conv2dOptions {
  int stride = 1, padding = 0, dilation = 1;
  bool bias = false;
  Init weight_init = Init::KaimingNormalFanOut;  // torchvision ResNet/U-Net conv init
  bool input_grad = true;  // false for a first layer: backward skips dx (returns undefined)
};

class Conv2d : public Module {
 public:
  Conv2d(ParamStore& ps, const std::string& name, int in_ch, int out_ch, int kernel,
         Conv2dOptions o = {});
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  Tensor backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc) override;
  Tensor forward_cat(Ctx& ctx, const Tensor& a, const Tensor& b) override;
  void backward_cat(Ctx& ctx, const Tensor& dy, Tensor& da, Tensor& db) override;
  int weight_id() const { return w_; }
  int bias_id() const { return b_; }  // -1 without bias
  void set_input_grad(bool on) { opt_.input_grad = on; }

 private:
  Tensor backward_impl(Ctx& ctx, const Tensor& dy, Tensor& acc);
  Shape out_shape(const Tensor& x, int64_t channels) const;  // checks x's rank and channels
  ParamStore& ps_;
  std::string name_;
  int in_, out_, k_;
  Conv2dOptions opt_;
  Conv2dParams cp_;
  int w_ = -1, b_ = -1;
  Tensor x_;
  Tensor xa_, xb_;  // forward_cat's two parts (when the backend convolved them separately)
  Tensor y_kept_;   // Recompute::Selective: the first forward's output
};

struct BatchNormOptions {
  float momentum = 0.1f, eps = 1e-5f;
  bool zero_init = false;  // weight initialised to 0 (zero_init_residual)
  bool relu = false;       // y = relu(bn(x)), fused into the batch norm (BatchNorm2d + ReLU)
};

// BatchNorm over all axes but the last (channels). Buffers: running_mean (0),
// running_var (1), num_batches_tracked (host int64, +1 per training forward).
class BatchNorm2d : public Module {
 public:
  BatchNorm2d(ParamStore& ps, const std::string& name, int channels, BatchNormOptions o = {});
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  // y = relu?(bn(x) + residual) (a residual block's tail, fused); its backward is
  // backward_residual.
  Tensor forward_residual(Ctx& ctx, const Tensor& x, const Tensor& residual);
  // Training-mode forward only (eval-mode BN is a fixed affine map whose gradient is
  // not implemented).
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  // After forward_residual: returns {dx, dsum}, dsum the gradient of the sum bn(x) +
  // residual (dy through the ReLU's mask, made in the same pass as the batch norm's
  // backward), which the shortcut receives: a fresh arena tensor the caller may add into.
  std::pair<Tensor, Tensor> backward_residual(Ctx& ctx, const Tensor& dy);
  int weight_id() const { return w_; }
  int bias_id() const { return b_; }

 private:
  ParamStore& ps_;
  std::string name_;
  int c_;
  BatchNormOptions opt_;
  Tensor forward_sync(Ctx& ctx, const Tensor& x, Tensor& y, const BnEpilogue& ep);
  Tensor backward_sync(Ctx& ctx, const Tensor& dy, Tensor masked);
  Tensor forward_impl(Ctx& ctx, const Tensor& x, const Tensor& residual);
  Tensor backward_impl(Ctx& ctx, const Tensor& dy, Tensor masked);

  int w_, b_, rm_, rv_, nbt_;
  Tensor x_, mean_, invstd_;
  Tensor relu_y_;  // the output, when the backward applies the fused ReLU's mask
  bool trained_ = false;
  bool residual_ = false;  // the last training forward was forward_residual
  // sync_bn: the forward's statistics were global (count over all ranks)
  bool synced_ = false;
  double global_count_ = 0;
  std::vector<float> mean_host_, invstd_host_;  // the global statistics, kept for backward
};

// How a Linear stores and initialises its parameters.
struct LinearOptions {
  bool bias = true;
  // false: W [out, in], y = x W^T + b (nn.Linear); true: W [in, out], y = x W + b (the
  // Conv1D of HF's GPT-2, whose checkpoints keep that layout)
  bool weight_in_out = false;
  Init weight_init = Init::LinearDefault;  // nn.Linear: U(-1/sqrt(in), 1/sqrt(in))
  float weight_init_arg = 0.f;             // std for Init::Normal
  Init bias_init = Init::LinearDefault;
  // Tensor parallelism (Megatron; nn/tp.h): this layer is one rank's part of a layer split over
  // tp_size ranks. Column: out_features is the part (weight and bias cut along the outputs, in
  // tp_blocks equal blocks each cut in tp_size: c_attn's q, k, v); the backward sums the input
  // gradient over the group. Row: in_features is the part (weight cut along the inputs, in
  // tp_blocks blocks likewise; bias whole); the forward sums the output over the group, then
  // adds the bias.
  enum class Tp { None, Column, Row };
  Tp tp = Tp::None;
  int tp_size = 1;
  int tp_blocks = 1;
  // Sequence parallelism (nn/seq_parallel.h; with a Column or Row cut): the rows outside the
  // layer are this rank's block. Column: the forward all-gathers the input rows (the layer
  // keeps the gathered input for its weight gradient) and the backward reduce-scatters the
  // input gradient (instead of all-reducing it). Row: the forward reduce-scatters the output
  // (instead of all-reducing it), then adds the bias to the rank's rows; the backward
  // all-gathers the output gradient first (so the bias gradient is the full one on every rank).
  bool sequence = false;
};

// A fully connected layer over the last axis; b [out]. nn.Linear by default.
class Linear : public Module {
 public:
  Linear(ParamStore& ps, const std::string& name, int in_features, int out_features,
         bool bias = true);
  Linear(ParamStore& ps, const std::string& name, int in_features, int out_features,
         const LinearOptions& o);
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  int weight_id() const { return w_; }
  int bias_id() const { return b_; }
  // GPT's MLP (Backend::gemm_bias_gelu / gemm_dgelu). forward_gelu returns gelu(x W^T + b)
  // and sets pre to the pre-activation x W^T + b; backward_dgelu is the backward of a Linear
  // whose input was gelu(pre): it returns the gradient at pre.
  Tensor forward_gelu(Ctx& ctx, const Tensor& x, Tensor& pre);
  Tensor backward_dgelu(Ctx& ctx, const Tensor& dy, const Tensor& pre);

 private:
  Tensor backward_impl(Ctx& ctx, const Tensor& dy, const Tensor* gelu_pre);

  ParamStore& ps_;
  std::string name_;
  int in_, out_;
  bool in_out_ = false;  // LinearOptions::weight_in_out
  LinearOptions::Tp tp_ = LinearOptions::Tp::None;
  bool seq_ = false;  // LinearOptions::sequence (with a cut)
  int w_ = -1, b_ = -1;
  std::shared_ptr<LoraAdapter> lora_;  // the store's LoRA targets this module (nn/lora.h)
  Tensor x_;
  Tensor y_kept_, pre_kept_;  // Recompute::Selective: the first forward's output (and pre-activation)
};

// What Linear and StackedLinear (nn/stacked_linear.h) share. A forward's input: x_in checked to
// end in `in` features and, with `gather` (sequence parallel, column-parallel), every rank's rows
// gathered; the GEMM's rows m and the output's shape (x's with `out` features).
struct LinearInput {
  Tensor x;
  int64_t m = 0;
  Shape y_shape;
};
LinearInput linear_input(Ctx& ctx, const std::string& name, const Tensor& x_in, int in, int out, bool gather);
// A column-parallel layer's input gradient dx (the rank's part) summed over the tensor-parallel
// group in place; with `sequence` the sum's block of this rank's rows instead.
Tensor column_parallel_dx(Ctx& ctx, const std::string& name, const Tensor& dx, bool sequence);

// ReLU keeps its output for backward. inplace=true overwrites x in forward and dy in
// backward (an exception to the Module rule): only use it when no other module saved x
// for its backward (true after BatchNorm2d or a residual add, whose outputs nobody keeps)
// and nobody else reads dy (true when dy comes from a single consumer's backward, as
// everywhere inside a ResNet).
class ReLU : public Module {
 public:
  explicit ReLU(bool inplace = false) : inplace_(inplace) {}
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  bool inplace_;
  Tensor y_;
};

// PyTorch nn.MaxPool2d(kernel, stride, padding) with ceil_mode=False.
class MaxPool2d : public Module {
 public:
  MaxPool2d(int kernel, int stride, int padding);
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  Tensor backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc) override;

 private:
  Pool2dParams p_;
  Shape in_shape_;
  Tensor argmax_;  // u8 [N,OH,OW,C]: each window's winner (training forwards only)
};

// AdaptiveAvgPool2d((1,1)) + flatten: [N,H,W,C] -> [N,C].
class GlobalAvgPool : public NhwcOpModule {
 public:
  GlobalAvgPool()
      : NhwcOpModule("GlobalAvgPool", &Backend::global_avgpool_fwd, &Backend::global_avgpool_bwd) {}

 private:
  Shape out_shape(const Shape& x) const override { return Shape{x[0], x[3]}; }
};

// [N, ...] -> [N, prod(...)] as a view (NHWC order: equals PyTorch's flatten only when
// H = W = 1). backward returns a view of dy.
class Flatten : public Module {
 public:
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  Shape in_shape_;
};

// Output size of a conv/pool window along one axis (PyTorch formula, floor mode).
int64_t conv_out_size(int64_t in, int kernel, int stride, int pad, int dilation);

}  // namespace dtrain

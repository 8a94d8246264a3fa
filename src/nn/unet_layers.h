#pragma once
// U-Net layers: ConvTranspose2d (no new backend op: its forward is conv2d_bwd_data, its
// input gradient conv2d_fwd, its weight gradient conv2d_bwd_filter with the roles of
// input and output gradient swapped) and bilinear x2 upsampling.
#include <string>

#include "nn/module.h"

namespace dtrain {

// PyTorch nn.ConvTranspose2d(in, out, kernel, stride, padding=0, bias) with groups = 1,
// dilation = 1, output_padding = 0: y [N,(H-1)s+k,(W-1)s+k,out].
// Weight: PyTorch [in, out, kh, kw]; internally [in, kh, kw, out] (the OHWI weight of the
// forward convolution out -> in), so the checkpoint's OIHW conversion gives PyTorch's
// layout. Init as PyTorch: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = out*k*k
// (PyTorch takes weight.size(1) as fan_in) for weight and bias.
class ConvTranspose2d : public Module {
 public:
  ConvTranspose2d(ParamStore& ps, const std::string& name, int in_ch, int out_ch, int kernel,
                  int stride, bool bias = true);
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  int weight_id() const { return w_; }
  int bias_id() const { return b_; }

 private:
  ParamStore& ps_;
  std::string name_;
  int in_, out_, k_, s_;
  Conv2dParams cp_;
  int w_ = -1, b_ = -1;
  Tensor x_;
};

// nn.Upsample(scale_factor=2, mode='bilinear', align_corners=False).
class UpsampleBilinear2x : public NhwcOpModule {
 public:
  UpsampleBilinear2x()
      : NhwcOpModule("Upsample", &Backend::upsample_bilinear2x_fwd,
                     &Backend::upsample_bilinear2x_bwd) {}

 private:
  Shape out_shape(const Shape& x) const override { return Shape{x[0], 2 * x[1], 2 * x[2], x[3]}; }
};

}  // namespace dtrain

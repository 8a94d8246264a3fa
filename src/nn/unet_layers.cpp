#include "nn/unet_layers.h"

namespace dtrain {

ConvTranspose2d::ConvTranspose2d(ParamStore& ps, const std::string& name, int in_ch, int out_ch,
                                 int kernel, int stride, bool bias)
    : ps_(ps), name_(name), in_(in_ch), out_(out_ch), k_(kernel), s_(stride) {
  DTRAIN_CHECK(in_ch > 0 && out_ch > 0 && kernel > 0 && stride > 0,
               "{}: bad transposed conv config in={} out={} k={} s={}", name, in_ch, out_ch, kernel,
               stride);
  cp_.stride_h = cp_.stride_w = stride;
  const int64_t fan_in = int64_t(out_ch) * kernel * kernel;  // PyTorch: weight.size(1) * k * k
  ParamDesc w;
  w.name = join_name(name, "weight");
  w.shape = Shape{in_ch, kernel, kernel, out_ch};
  w.init = Init::LinearDefault;
  w.layout = Layout::OHWI;
  w.fan_in = fan_in;
  w.fan_out = int64_t(in_ch) * kernel * kernel;
  w_ = ps.declare(w);
  if (bias) {
    ParamDesc b;
    b.name = join_name(name, "bias");
    b.shape = Shape{out_ch};
    b.init = Init::LinearDefault;
    b.decay = false;
    b.fan_in = fan_in;
    b.fan_out = w.fan_out;
    b_ = ps.declare(b);
  }
}

Tensor ConvTranspose2d::forward(Ctx& ctx, const Tensor& x) {
  DTRAIN_CHECK(x.ndim() == 4 && x.dim(3) == in_, "{}: input {} is not NHWC with {} channels",
               name_, x.shape.str(), in_);
  const int64_t oh = (x.dim(1) - 1) * s_ + k_, ow = (x.dim(2) - 1) * s_ + k_;
  Tensor y = ctx.arena.alloc(x.dtype, Shape{x.dim(0), oh, ow, out_});
  // y is the "input" of the forward convolution out -> in whose output is x
  ctx.be.conv2d_bwd_data(x, ps_.cparam(w_), y, cp_, /*accumulate=*/false);
  if (b_ >= 0) {
    Tensor y2 = y.view(Shape{y.numel() / out_, out_});
    ctx.be.add_bias(y2, ps_.cparam(b_));
  }
  x_ = x;
  return y;
}

Tensor ConvTranspose2d::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(x_.defined(), "{}: backward without forward", name_);
  Tensor dw = ps_.grad(w_);
  Tensor none;
  // forward conv: input dy [N,OH,OW,out] -> output x [N,H,W,in]; its filter gradient with
  // "output gradient" x is this layer's weight gradient.
  ctx.be.conv2d_bwd_filter(dy, x_, dw, none, cp_, /*accumulate=*/true);
  ctx.notify_grad(w_);
  if (b_ >= 0) {
    Tensor db = ps_.grad(b_);
    ctx.be.sum_rows(dy.view(Shape{dy.numel() / out_, out_}), db, /*accumulate=*/true);
    ctx.notify_grad(b_);
  }
  Tensor dx = ctx.arena.alloc(dy.dtype, x_.shape);
  ctx.be.conv2d_fwd(dy, ps_.cparam(w_), Tensor(), dx, cp_);
  x_ = Tensor();
  return dx;
}

}  // namespace dtrain

#include "nn/layers.h"

namespace dtrain {

int64_t conv_out_size(int64_t in, int kernel, int stride, int pad, int dilation) {
  return (in + 2 * int64_t(pad) - int64_t(dilation) * (kernel - 1) - 1) / stride + 1;
}

Conv2d::Conv2d(ParamStore& ps, const std::string& name, int in_ch, int out_ch, int kernel,
               Conv2dOptions o)
    : ps_(ps), name_(name), in_(in_ch), out_(out_ch), k_(kernel), opt_(o) {
  DTRAIN_CHECK(in_ch > 0 && out_ch > 0 && kernel > 0 && o.stride > 0 && o.dilation > 0 &&
                   o.padding >= 0,
               "{}: bad conv config in={} out={} k={} s={} p={} d={}", name, in_ch, out_ch, kernel,
               o.stride, o.padding, o.dilation);
  cp_.stride_h = cp_.stride_w = o.stride;
  cp_.pad_h = cp_.pad_w = o.padding;
  cp_.dil_h = cp_.dil_w = o.dilation;
  const int64_t fan_in = int64_t(in_ch) * kernel * kernel;
  const int64_t fan_out = int64_t(out_ch) * kernel * kernel;
  ParamDesc w;
  w.name = join_name(name, "weight");
  w.shape = Shape{out_ch, kernel, kernel, in_ch};
  w.init = o.weight_init;
  w.decay = true;
  w.layout = Layout::OHWI;
  w.fan_in = fan_in;
  w.fan_out = fan_out;
  w_ = ps.declare(w);
  if (o.bias) {
    ParamDesc b;
    b.name = join_name(name, "bias");
    b.shape = Shape{out_ch};
    b.init = Init::LinearDefault;  // PyTorch conv bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    b.decay = false;
    b.fan_in = fan_in;
    b.fan_out = fan_out;
    b_ = ps.declare(b);
  }
}

Shape Conv2d::out_shape(const Tensor& x, int64_t channels) const {
  DTRAIN_CHECK(x.ndim() == 4 && channels == in_, "{}: input {} is not NHWC with {} channels", name_,
               x.shape.str(), in_);
  const int64_t oh = conv_out_size(x.dim(1), k_, opt_.stride, opt_.padding, opt_.dilation);
  const int64_t ow = conv_out_size(x.dim(2), k_, opt_.stride, opt_.padding, opt_.dilation);
  if (oh < 1 || ow < 1)
    user_error("{}: input of {}x{} pixels is too small for a {}x{} convolution (stride {}, padding {})",
               name_, x.dim(1), x.dim(2), k_, k_, opt_.stride, opt_.padding);
  return Shape{x.dim(0), oh, ow, out_};
}

Tensor Conv2d::forward(Ctx& ctx, const Tensor& x) {
  x_ = x;
  xa_ = xb_ = Tensor();
  if (ctx.replaying && ctx.keep) return y_kept_;  // selective recompute: the convolution is not redone
  Tensor y = ctx.output_arena().alloc(x.dtype, out_shape(x, x.ndim() == 4 ? x.dim(3) : -1));
  ctx.be.conv2d_fwd(x, ps_.cparam(w_), b_ >= 0 ? ps_.cparam(b_) : Tensor(), y, cp_);
  y_kept_ = ctx.keep ? y : Tensor();
  return y;
}

// x = cat(a, b) never built where the backend convolves the two parts with the filter's two
// halves (Op::Conv2dCat; without a bias); elsewhere Module's concatenate-then-forward.
Tensor Conv2d::forward_cat(Ctx& ctx, const Tensor& a, const Tensor& b) {
  if (b_ >= 0 || !ctx.be.supports(Op::Conv2dCat, a.dtype)) return Module::forward_cat(ctx, a, b);
  DTRAIN_CHECK(b.ndim() == 4 && a.ndim() == 4 && b.dtype == a.dtype && b.dim(0) == a.dim(0) &&
                   b.dim(1) == a.dim(1) && b.dim(2) == a.dim(2),
               "{}: forward_cat of {} and {}", name_, a.str(), b.str());
  xa_ = a;
  xb_ = b;
  x_ = Tensor();
  if (ctx.replaying && ctx.keep) return y_kept_;
  Tensor y = ctx.output_arena().alloc(a.dtype, out_shape(a, a.dim(3) + b.dim(3)));
  ctx.be.conv2d_fwd_cat(a, b, ps_.cparam(w_), y, cp_);
  y_kept_ = ctx.keep ? y : Tensor();
  return y;
}

void Conv2d::backward_cat(Ctx& ctx, const Tensor& dy, Tensor& da, Tensor& db) {
  if (!xa_.defined()) return Module::backward_cat(ctx, dy, da, db);  // the forward concatenated
  DTRAIN_CHECK(opt_.input_grad, "{}: backward_cat on a convolution without input gradient", name_);
  Tensor dw = ps_.grad(w_);
  ctx.be.conv2d_bwd_filter_cat(xa_, xb_, dy, dw, cp_, /*accumulate=*/true);
  ctx.notify_grad(w_);
  ctx.be.conv2d_bwd_data_cat(dy, ps_.cparam(w_), da, db, cp_);
  xa_ = xb_ = Tensor();
}

Tensor Conv2d::backward(Ctx& ctx, const Tensor& dy) {
  Tensor none;
  return backward_impl(ctx, dy, none);
}

Tensor Conv2d::backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc) {
  DTRAIN_CHECK(opt_.input_grad, "{}: backward_into on a convolution without input gradient", name_);
  return backward_impl(ctx, dy, acc);
}

// acc defined: the input gradient is added into it (the backend's accumulating backward-data)
Tensor Conv2d::backward_impl(Ctx& ctx, const Tensor& dy, Tensor& acc) {
  DTRAIN_CHECK(x_.defined(), "{}: backward without forward", name_);
  Tensor dw = ps_.grad(w_);
  Tensor db = b_ >= 0 ? ps_.grad(b_) : Tensor();
  ctx.be.conv2d_bwd_filter(x_, dy, dw, db, cp_, /*accumulate=*/true);
  ctx.notify_grad(w_);
  ctx.notify_grad(b_);
  Tensor dx;
  if (acc.defined()) {
    DTRAIN_CHECK(acc.shape == x_.shape && acc.dtype == dy.dtype,
                 "{}: input gradient sum {} does not match input {}", name_, acc.str(), x_.str());
    ctx.be.conv2d_bwd_data(dy, ps_.cparam(w_), acc, cp_, /*accumulate=*/true);
    dx = acc;
  } else if (opt_.input_grad) {
    dx = ctx.arena.alloc(dy.dtype, x_.shape);
    ctx.be.conv2d_bwd_data(dy, ps_.cparam(w_), dx, cp_, /*accumulate=*/false);
  }
  x_ = Tensor();
  return dx;
}

}  // namespace dtrain

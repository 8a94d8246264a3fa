// Parameter-free layers: ReLU, MaxPool2d, GlobalAvgPool, Flatten.
#include "nn/layers.h"

namespace dtrain {

Tensor ReLU::forward(Ctx& ctx, const Tensor& x) {
  Tensor y = inplace_ ? x : ctx.arena.alloc(x.dtype, x.shape);
  ctx.be.relu_fwd(x, y);
  y_ = y;
  return y;
}

Tensor ReLU::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(y_.defined(), "ReLU: backward without forward");
  // in place: dx overwrites dy (Backend::relu_bwd allows dx to alias dy)
  Tensor dx = inplace_ ? dy : ctx.arena.alloc(dy.dtype, dy.shape);
  ctx.be.relu_bwd(y_, dy, dx);
  y_ = Tensor();
  return dx;
}

MaxPool2d::MaxPool2d(int kernel, int stride, int padding) {
  DTRAIN_CHECK(kernel > 0 && stride > 0 && padding >= 0 && 2 * padding <= kernel &&
                   kernel * kernel <= 256,  // the u8 argmax holds a window offset
               "MaxPool2d: kernel {} stride {} padding {}", kernel, stride, padding);
  p_.kernel_h = p_.kernel_w = kernel;
  p_.stride_h = p_.stride_w = stride;
  p_.pad_h = p_.pad_w = padding;
}

Tensor MaxPool2d::forward(Ctx& ctx, const Tensor& x) {
  DTRAIN_CHECK(x.ndim() == 4, "MaxPool2d: input {} is not NHWC", x.shape.str());
  const int64_t oh = conv_out_size(x.dim(1), p_.kernel_h, p_.stride_h, p_.pad_h, 1);
  const int64_t ow = conv_out_size(x.dim(2), p_.kernel_w, p_.stride_w, p_.pad_w, 1);
  if (oh < 1 || ow < 1)
    user_error("maxpool: input of {}x{} pixels is too small for a {}x{} window", x.dim(1), x.dim(2),
               p_.kernel_h, p_.kernel_w);
  const Shape ys{x.dim(0), oh, ow, x.dim(3)};
  Tensor y = ctx.arena.alloc(x.dtype, ys);
  argmax_ = ctx.training ? ctx.arena.alloc(DType::U8, ys) : Tensor();
  ctx.be.maxpool2d_fwd(x, y, argmax_, p_);
  in_shape_ = x.shape;
  return y;
}

Tensor MaxPool2d::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(argmax_.defined(), "MaxPool2d: backward without a training forward");
  Tensor dx = ctx.arena.alloc(dy.dtype, in_shape_);
  ctx.be.maxpool2d_bwd(argmax_, dy, dx, p_, /*accumulate=*/false);
  argmax_ = Tensor();
  return dx;
}

Tensor MaxPool2d::backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc) {
  DTRAIN_CHECK(argmax_.defined(), "MaxPool2d: backward without a training forward");
  DTRAIN_CHECK(acc.shape == in_shape_ && acc.dtype == dy.dtype,
               "MaxPool2d: input gradient sum {} does not match input {}", acc.str(), in_shape_.str());
  ctx.be.maxpool2d_bwd(argmax_, dy, acc, p_, /*accumulate=*/true);
  argmax_ = Tensor();
  return acc;
}

Tensor Flatten::forward(Ctx&, const Tensor& x) {
  DTRAIN_CHECK(x.ndim() >= 1, "Flatten: scalar input");
  in_shape_ = x.shape;
  return x.view(Shape{x.dim(0), x.dim(0) ? x.numel() / x.dim(0) : 0});
}

Tensor Flatten::backward(Ctx&, const Tensor& dy) { return dy.view(in_shape_); }

}  // namespace dtrain

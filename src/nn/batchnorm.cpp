#include "nn/layers.h"

namespace dtrain {

BatchNorm2d::BatchNorm2d(ParamStore& ps, const std::string& name, int channels, BatchNormOptions o)
    : ps_(ps), name_(name), c_(channels), opt_(o) {
  ParamDesc w;
  w.name = join_name(name, "weight");
  w.shape = Shape{channels};
  w.init = o.zero_init ? Init::Zeros : Init::Ones;
  w.decay = false;
  w_ = ps.declare(w);
  ParamDesc b;
  b.name = join_name(name, "bias");
  b.shape = Shape{channels};
  b.init = Init::Zeros;
  b.decay = false;
  b_ = ps.declare(b);
  rm_ = ps.declare_buffer(join_name(name, "running_mean"), Shape{channels}, 0.f);
  rv_ = ps.declare_buffer(join_name(name, "running_var"), Shape{channels}, 1.f);
  nbt_ = ps.declare_counter(join_name(name, "num_batches_tracked"));
}

Tensor BatchNorm2d::forward(Ctx& ctx, const Tensor& x) {
  DTRAIN_CHECK(x.ndim() >= 2 && x.dim(-1) == c_, "{}: input {} does not end in {} channels",
               name_, x.shape.str(), c_);
  Tensor y = ctx.arena.alloc(x.dtype, x.shape);
  if (ctx.training) {
    if (x.numel() / c_ < 2)
      user_error("{}: training-mode batch norm needs more than 1 value per channel, got input {}",
                 name_, x.shape.str());
    mean_ = ctx.arena.alloc(DType::F32, Shape{c_});
    invstd_ = ctx.arena.alloc(DType::F32, Shape{c_});
    Tensor rm = ps_.buffer(rm_), rv = ps_.buffer(rv_);
    ctx.be.batchnorm_fwd_train(x, ps_.param(w_), ps_.param(b_), y, rm, rv, mean_, invstd_,
                               opt_.momentum, opt_.eps);
    ps_.counter(nbt_) += 1;
    x_ = x;
    trained_ = true;
  } else {
    ctx.be.batchnorm_fwd_eval(x, ps_.param(w_), ps_.param(b_), ps_.buffer(rm_), ps_.buffer(rv_), y,
                              opt_.eps);
    x_ = Tensor();
    trained_ = false;
  }
  return y;
}

Tensor BatchNorm2d::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(trained_ && x_.defined(), "{}: backward needs a training-mode forward", name_);
  Tensor dx = ctx.arena.alloc(dy.dtype, x_.shape);
  Tensor dw = ps_.grad(w_), db = ps_.grad(b_);
  ctx.be.batchnorm_bwd(dy, x_, ps_.param(w_), mean_, invstd_, dx, dw, db, /*accumulate=*/true);
  ctx.notify_grad(w_);
  ctx.notify_grad(b_);
  x_ = Tensor();
  trained_ = false;
  return dx;
}

}  // namespace dtrain

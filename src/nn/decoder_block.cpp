#include "nn/decoder_block.h"

namespace dtrain {

// ---------------------------------------------------------------- ResidualNorm
ResidualNorm::ResidualNorm(ParamStore& ps, const std::string& name, int channels, float eps, bool tp_partial)
    : ps_(ps), name_(name), c_(channels), eps_(eps), w_(ps.declare(weight_desc(name, channels, tp_partial))) {}

ParamDesc ResidualNorm::weight_desc(const std::string& name, int channels, bool tp_partial) {
  ParamDesc w;
  w.name = join_name(name, "weight");
  w.shape = Shape{channels};
  w.init = Init::Ones;
  w.decay = false;
  w.read_f32 = true;
  w.tp_partial = tp_partial;
  return w;
}

Tensor ResidualNorm::alloc_outputs(Ctx& ctx, const Tensor& x, Tensor* mean) {
  DTRAIN_CHECK(x.ndim() >= 1 && x.dim(-1) == c_, "{}: input {} does not end in {} channels", name_, x.shape.str(),
               c_);
  const int64_t m = x.numel() / c_;
  Tensor y = ctx.arena.alloc(x.dtype, x.shape);
  if (mean) *mean = ctx.arena.alloc(DType::F32, Shape{m});
  rstd_ = ctx.arena.alloc(DType::F32, Shape{m});
  return y;
}

Tensor ResidualNorm::alloc_add_outputs(Ctx& ctx, const Tensor& a, const Tensor& b, Tensor& h, Tensor* mean) {
  DTRAIN_CHECK(b.shape == a.shape && b.dtype == a.dtype, "{}: forward_add of {} and {} (expected equal shapes)",
               name_, a.str(), b.str());
  h = ctx.arena.alloc(a.dtype, a.shape);
  return alloc_outputs(ctx, a, mean);
}

Tensor ResidualNorm::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(x_.defined(), "{}: backward without forward", name_);
  Tensor dx = ctx.arena.alloc(dy.dtype, x_.shape);
  backward_to(ctx, dy, dx, false);
  return dx;
}

Tensor ResidualNorm::backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc) {
  DTRAIN_CHECK(x_.defined() && acc.shape == x_.shape && acc.dtype == dy.dtype,
               "{}: backward_into a sum {} for input {}", name_, acc.str(), x_.str());
  backward_to(ctx, dy, acc, true);
  return acc;
}

// ---------------------------------------------------------------- DecoderBlock

void DecoderBlock::set_layers(ResidualNorm& norm_1, DecoderAttention& attn, ResidualNorm& norm_2, Module& mlp) {
  norm_1_ = &norm_1;
  attn_ = &attn;
  norm_2_ = &norm_2;
  mlp_ = &mlp;
}

// h = x + attn(...) is made by norm_2's kernel, which normalises it too.
Tensor DecoderBlock::forward(Ctx& ctx, const Tensor& x) {
  Tensor a = attn_->forward(ctx, norm_1_->forward(ctx, x));
  Tensor h;
  Tensor m = mlp_->forward(ctx, norm_2_->forward_add(ctx, x, a, h));
  ctx.be.add(h, m, m);  // nobody saved the MLP output: reuse it for y
  return m;
}

Tensor DecoderBlock::decode(Ctx& ctx, const Tensor& x, Tensor& kcache, Tensor& vcache, int64_t pos) {
  Tensor a = attn_->decode(ctx, norm_1_->forward(ctx, x), kcache, vcache, pos);
  Tensor h;
  Tensor m = mlp_->forward(ctx, norm_2_->forward_add(ctx, x, a, h));
  ctx.be.add(h, m, m);
  return m;
}

// The residual stream's gradient is summed in place by the norms' backward: dy (read by nobody
// after the MLP's backward) becomes dh = dy + norm_2'(...), then dx = dh + norm_1'(...).
Tensor DecoderBlock::backward(Ctx& ctx, const Tensor& dy) {
  Tensor dh = dy;
  norm_2_->backward_into(ctx, mlp_->backward(ctx, dy), dh);
  norm_1_->backward_into(ctx, attn_->backward(ctx, dh), dh);
  return dh;
}

}  // namespace dtrain

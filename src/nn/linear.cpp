#include "nn/layers.h"
#include "nn/lora.h"
#include "nn/seq_parallel.h"

namespace dtrain {

Linear::Linear(ParamStore& ps, const std::string& name, int in_features, int out_features, bool bias)
    : Linear(ps, name, in_features, out_features, LinearOptions{bias}) {}

Linear::Linear(ParamStore& ps, const std::string& name, int in_features, int out_features,
               const LinearOptions& o)
    : ps_(ps), name_(name), in_(in_features), out_(out_features), in_out_(o.weight_in_out), tp_(o.tp) {
  using Tp = LinearOptions::Tp;
  const bool cut = o.tp != Tp::None && o.tp_size > 1;
  if (!cut) tp_ = Tp::None;
  seq_ = cut && o.sequence;
  ParamDesc w;
  w.name = join_name(name, "weight");
  w.shape = o.weight_in_out ? Shape{in_features, out_features} : Shape{out_features, in_features};
  w.init = o.weight_init;
  w.init_arg = o.weight_init_arg;
  w.decay = true;
  w.fan_in = in_features;
  w.fan_out = out_features;
  if (cut) {  // the axis of the outputs (Column) or of the inputs (Row)
    const bool outputs = o.tp == Tp::Column;
    w.tp_dim = (outputs == o.weight_in_out) ? 1 : 0;
    w.tp_blocks = o.tp_blocks;
    w.tp_full = int64_t(outputs ? out_features : in_features) * o.tp_size;
  }
  w_ = ps.declare(w);
  if (o.bias) {
    ParamDesc b = w;
    b.name = join_name(name, "bias");
    b.shape = Shape{out_features};
    b.init = o.bias_init;
    b.init_arg = 0.f;
    b.decay = false;
    b.tp_dim = -1;  // not cut, or row-parallel: whole on every rank
    b.tp_blocks = 1;
    if (cut && o.tp == Tp::Column) {
      b.tp_dim = 0;
      b.tp_blocks = o.tp_blocks;
      b.tp_full = int64_t(out_features) * o.tp_size;
    }
    b_ = ps.declare(b);
  }
  if (const LoraOptions* lo = ps.lora(); lo && lo->targets_module(name)) {
    LoraCut c;
    c.kind = !cut ? LoraCut::Kind::None : o.tp == Tp::Column ? LoraCut::Kind::Column : LoraCut::Kind::Row;
    c.tp_size = o.tp_size;
    c.tp_blocks = o.tp_blocks;
    DTRAIN_CHECK(!seq_, "{}: LoRA with sequence parallelism", name);
    lora_ = std::make_shared<LoraAdapter>(*lo, name, in_features, out_features, c);
  }
}

LinearInput linear_input(Ctx& ctx, const std::string& name, const Tensor& x_in, int in, int out, bool gather) {
  DTRAIN_CHECK(x_in.ndim() >= 1 && x_in.dim(-1) == in, "{}: input {} does not end in {} features", name,
               x_in.shape.str(), in);
  LinearInput r;
  r.x = gather ? sp_gather_rows(ctx, x_in) : x_in;
  r.m = r.x.numel() / in;
  r.y_shape = r.x.shape;
  r.y_shape[-1] = out;
  return r;
}

Tensor column_parallel_dx(Ctx& ctx, const std::string& name, const Tensor& dx, bool sequence) {
  DTRAIN_CHECK(ctx.tp, "{}: a column-parallel layer without a tensor-parallel group", name);
  Tensor dx2 = dx.view(Shape{dx.numel() / dx.dim(-1), dx.dim(-1)});
  if (sequence) return sp_scatter_rows(ctx, dx2);  // the sum's block of this rank's rows
  ctx.tp->allreduce_sum(dx2);
  return dx;
}

Tensor Linear::forward(Ctx& ctx, const Tensor& x_in) {
  // sequence parallel column: the rank's rows gathered into all of them
  const auto [x, m, ys] = linear_input(ctx, name_, x_in, in_, out_, seq_ && tp_ == LinearOptions::Tp::Column);
  x_ = x;
  if (ctx.replaying && ctx.keep) return y_kept_;  // selective recompute: the GEMM is not redone
  Tensor y = ctx.output_arena().alloc(x.dtype, ys);
  Tensor y2 = y.view(Shape{m, out_});
  if (tp_ == LinearOptions::Tp::Row) {  // the ranks' partial products summed, then the bias once
    DTRAIN_CHECK(ctx.tp, "{}: a row-parallel layer without a tensor-parallel group", name_);
    ctx.be.gemm(false, !in_out_, 1.f, x.view(Shape{m, in_}), ps_.cparam(w_), 0.f, y2);
    if (seq_) {  // the sum's block of this rank's rows (selective recompute keeps it: output arena)
      y = sp_scatter_rows(ctx, y2, &ctx.output_arena());
      y2 = y;
    } else {
      ctx.tp->allreduce_sum(y2);
    }
    if (lora_) lora_->forward(ctx, x.view(Shape{m, in_}), y2);  // sums its own part over the group
    if (b_ >= 0) ctx.be.add_bias(y2, ps_.cparam(b_));
    y_kept_ = ctx.keep ? y : Tensor();
    return y;
  }
  // y = x W^T ([out, in]) or x W ([in, out])
  if (b_ >= 0)
    ctx.be.gemm_bias(false, !in_out_, x.view(Shape{m, in_}), ps_.cparam(w_), ps_.cparam(b_), y2);
  else
    ctx.be.gemm(false, !in_out_, 1.f, x.view(Shape{m, in_}), ps_.cparam(w_), 0.f, y2);
  if (lora_) lora_->forward(ctx, x.view(Shape{m, in_}), y2);
  y_kept_ = ctx.keep ? y : Tensor();
  return y;
}

Tensor Linear::forward_gelu(Ctx& ctx, const Tensor& x_in, Tensor& pre) {
  DTRAIN_CHECK(b_ >= 0, "{}: forward_gelu needs a bias", name_);
  const auto [x, m, ys] = linear_input(ctx, name_, x_in, in_, out_, seq_ && tp_ == LinearOptions::Tp::Column);
  x_ = x;
  Tensor y = ctx.arena.alloc(x.dtype, ys);
  if (ctx.replaying && ctx.keep) {  // selective recompute: the GELU again from the kept GEMM output
    pre = pre_kept_;
    ctx.be.gelu_fwd(pre, y);
    return y;
  }
  pre = ctx.output_arena().alloc(x.dtype, ys);
  Tensor pre2 = pre.view(Shape{m, out_}), y2 = y.view(Shape{m, out_});
  if (ctx.keep || lora_) {
    // LoRA: the adapter's sum goes into pre before the GELU. Selective recompute replays gelu(pre) from the kept, rounded pre: the forward computes
    // it the same way, not in the GEMM's epilogue (which, on CUDA, takes the GELU of the
    // unrounded product), so the replay gives the forward's bits on every backend.
    ctx.be.gemm_bias(false, !in_out_, x.view(Shape{m, in_}), ps_.cparam(w_), ps_.cparam(b_), pre2);
    if (lora_) lora_->forward(ctx, x.view(Shape{m, in_}), pre2);
    ctx.be.gelu_fwd(pre, y);
  } else {
    ctx.be.gemm_bias_gelu(false, !in_out_, x.view(Shape{m, in_}), ps_.cparam(w_), ps_.cparam(b_), pre2, y2);
  }
  pre_kept_ = ctx.keep ? pre : Tensor();
  return y;
}

Tensor Linear::backward(Ctx& ctx, const Tensor& dy) { return backward_impl(ctx, dy, nullptr); }

Tensor Linear::backward_dgelu(Ctx& ctx, const Tensor& dy, const Tensor& pre) {
  DTRAIN_CHECK(pre.defined() && pre.shape == x_.shape && pre.dtype == dy.dtype,
               "{}: backward_dgelu: pre-activation {} for input {}", name_, pre.str(), x_.str());
  return backward_impl(ctx, dy, &pre);
}

Tensor Linear::backward_impl(Ctx& ctx, const Tensor& dy_in, const Tensor* gelu_pre) {
  DTRAIN_CHECK(x_.defined(), "{}: backward without forward", name_);
  // sequence parallel row: the output gradient of every rank's rows
  const Tensor dy = seq_ && tp_ == LinearOptions::Tp::Row ? sp_gather_rows(ctx, dy_in) : dy_in;
  const int64_t m = x_.numel() / in_;
  Tensor dy2 = dy.view(Shape{m, out_});
  Tensor x2 = x_.view(Shape{m, in_});
  if (!ps_.frozen()) {  // a frozen (LoRA base) weight takes no gradient
    Tensor dw = ps_.grad(w_);
    Tensor db = b_ >= 0 ? ps_.grad(b_) : Tensor();
    ctx.be.linear_wgrad(dy2, x2, in_out_, dw, db);  // dW += dy^T x (or x^T dy), db += colsum(dy)
    ctx.notify_grad(w_);
    ctx.notify_grad(b_);
  }
  Tensor dx = ctx.arena.alloc(dy.dtype, x_.shape);
  Tensor dx2 = dx.view(Shape{m, in_});
  // dx = dy W or dy W^T (times gelu'(pre) when the input was gelu(pre)); LoRA adds du A first
  if (gelu_pre && !lora_) {
    ctx.be.gemm_dgelu(false, in_out_, dy2, ps_.cparam(w_), gelu_pre->view(Shape{m, in_}), dx2);
  } else {
    ctx.be.gemm(false, in_out_, 1.f, dy2, ps_.cparam(w_), 0.f, dx2);
    if (lora_) lora_->backward(ctx, dy2, x2, dx2);
    if (gelu_pre) ctx.be.gelu_bwd(*gelu_pre, dx, dx);
  }
  x_ = Tensor();
  // column-parallel: every rank's part of the input gradient, summed
  return tp_ == LinearOptions::Tp::Column ? column_parallel_dx(ctx, name_, dx, seq_) : dx;
}

}  // namespace dtrain

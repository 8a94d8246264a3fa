#include "nn/stacked_linear.h"

#include <algorithm>

#include "nn/layers.h"

namespace dtrain {

StackedLinear::StackedLinear(ParamStore& ps, const std::string& prefix, int in_features,
                             std::vector<StackedPart> parts, bool bias, float std, int tp_size, bool sequence)
    : ps_(ps), name_(prefix), in_(in_features), cut_(tp_size > 1), seq_(tp_size > 1 && sequence) {
  DTRAIN_CHECK(!parts.empty() && in_features > 0, "{}: a stacked linear layer needs parts and inputs", prefix);
  auto desc = [&](const StackedPart& p, bool is_bias) {
    ParamDesc d;
    d.name = join_name(join_name(prefix, p.name), is_bias ? "bias" : "weight");
    d.shape = is_bias ? Shape{p.out} : Shape{p.out, in_features};
    d.init = is_bias ? Init::Zeros : Init::Normal;
    d.init_arg = is_bias ? 0.f : std;
    d.decay = !is_bias;
    d.fan_in = in_features;
    d.fan_out = p.out;
    if (cut_ && p.replicated) {  // every rank has it; each computes part of its gradient
      d.tp_partial = true;
    } else if (cut_) {  // column-parallel: the part's outputs (axis 0 of both) cut over the group
      d.tp_dim = 0;
      d.tp_blocks = p.tp_blocks;
      d.tp_full = int64_t(p.out) * tp_size;
    }
    return d;
  };
  for (const StackedPart& p : parts) {
    DTRAIN_CHECK(p.out > 0, "{}.{}: no output features", prefix, p.name);
    w_.push_back(ps.declare(desc(p, false)));
    out_ += p.out;
  }
  if (bias)
    for (const StackedPart& p : parts) b_.push_back(ps.declare(desc(p, true)));
  const LoraOptions* lo = ps.lora();
  for (const StackedPart& p : parts) {
    widths_.push_back(p.out);
    const std::string module = join_name(prefix, p.name);
    if (!lo || !lo->targets_module(module)) {
      lora_.push_back(nullptr);
      continue;
    }
    DTRAIN_CHECK(!seq_, "{}: LoRA with sequence parallelism", module);
    lora_.push_back(std::make_shared<LoraAdapter>(
        *lo, module, in_features, p.out, LoraCut{LoraCut::Kind::Column, tp_size, p.tp_blocks, p.replicated}));
  }
}

void StackedLinear::lora_forward(Ctx& ctx, const Tensor& x2, Tensor& y2) {
  std::vector<Tensor> parts(lora_.size());
  bool any = false;
  for (size_t i = 0; i < lora_.size(); ++i) {
    if (!lora_[i]) continue;
    parts[i] = ctx.arena.alloc(y2.dtype, Shape{y2.dim(0), widths_[i]});
    ctx.be.fill(parts[i], 0.f);
    lora_[i]->forward(ctx, x2, parts[i]);
    any = true;
  }
  if (!any) return;
  const Tensor d = lora_concat_parts(ctx, parts, widths_, y2.dim(0), y2.dtype);
  ctx.be.add(y2, d, y2);
}

Tensor StackedLinear::stacked(const std::vector<int>& ids, Buf which) const {
  Tensor first = which == Buf::Grad ? ps_.grad(ids[0]) : ps_.cparam(ids[0]);
  const size_t es = dtype_size(first.dtype);
  int64_t n = 0;
  for (int id : ids) {  // each part where the previous one ends
    Tensor t = which == Buf::Grad ? ps_.grad(id) : ps_.cparam(id);
    DTRAIN_CHECK(t.data == static_cast<char*>(first.data) + size_t(n) * es,
                 "{}: part {} is not where the previous part ends (parameters not declared back to back)", name_,
                 ps_.params()[size_t(id)].name);
    n += t.numel();
  }
  const bool bias = &ids == &b_;
  DTRAIN_CHECK(n == (bias ? out_ : int64_t(out_) * in_), "{}: stacked parts hold {} values", name_, n);
  return Tensor(first.data, first.dtype, first.device, bias ? Shape{out_} : Shape{out_, in_});
}

Tensor StackedLinear::forward(Ctx& ctx, const Tensor& x_in) {
  const auto [x, m, ys] = linear_input(ctx, name_, x_in, in_, out_, seq_);  // sequence parallel: every rank's rows
  x_ = x;
  if (ctx.replaying && ctx.keep) return y_kept_;  // selective recompute: the GEMM is not redone
  Tensor y = ctx.output_arena().alloc(x.dtype, ys);
  Tensor y2 = y.view(Shape{m, out_});
  const Tensor x2 = x.view(Shape{m, in_});
  if (!b_.empty())
    ctx.be.gemm_bias(false, true, x2, stacked(w_, Buf::Compute), stacked(b_, Buf::Compute), y2);
  else
    ctx.be.gemm(false, true, 1.f, x2, stacked(w_, Buf::Compute), 0.f, y2);
  lora_forward(ctx, x2, y2);
  y_kept_ = ctx.keep ? y : Tensor();
  return y;
}

Tensor StackedLinear::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(x_.defined(), "{}: backward without forward", name_);
  const int64_t m = x_.numel() / in_;
  Tensor dy2 = dy.view(Shape{m, out_});
  Tensor x2 = x_.view(Shape{m, in_});
  if (!ps_.frozen()) {  // a frozen (LoRA base) weight takes no gradient
    Tensor dw = stacked(w_, Buf::Grad);
    Tensor db = b_.empty() ? Tensor() : stacked(b_, Buf::Grad);
    ctx.be.linear_wgrad(dy2, x2, false, dw, db);  // dW += dy^T x, db += colsum(dy)
    for (int id : w_) ctx.notify_grad(id);
    for (int id : b_) ctx.notify_grad(id);
  }
  Tensor dx = ctx.arena.alloc(dy.dtype, x_.shape);
  Tensor dx2 = dx.view(Shape{m, in_});
  ctx.be.gemm(false, false, 1.f, dy2, stacked(w_, Buf::Compute), 0.f, dx2);  // dx = dy W
  std::vector<bool> wanted;
  for (const auto& a : lora_) wanted.push_back(a != nullptr);
  if (std::find(wanted.begin(), wanted.end(), true) != wanted.end()) {  // LoRA: each part's du A added
    const std::vector<Tensor> dys = lora_split_parts(ctx, dy2, widths_, wanted);
    for (size_t i = 0; i < lora_.size(); ++i)
      if (lora_[i]) lora_[i]->backward(ctx, dys[i], x2, dx2);
  }
  x_ = Tensor();
  return cut_ ? column_parallel_dx(ctx, name_, dx, seq_) : dx;  // every rank's part of the input gradient, summed
}

}  // namespace dtrain

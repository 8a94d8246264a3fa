#include "nn/lora.h"

namespace dtrain {

bool LoraOptions::targets_module(const std::string& path) const {
  const size_t dot = path.rfind('.');
  const std::string last = dot == std::string::npos ? path : path.substr(dot + 1);
  for (const std::string& t : targets)
    if (t == last) return true;
  return false;
}

std::string lora_param_name(const std::string& module, bool b) {
  return std::string(kLoraPrefix) + module + (b ? ".lora_B.weight" : ".lora_A.weight");
}

LoraAdapter::LoraAdapter(const LoraOptions& o, const std::string& module, int in, int out, const LoraCut& cut)
    : ps_(*o.adapters), name_(module), in_(in), out_(out), r_(o.rank), s_(o.scaling()), cut_(cut) {
  DTRAIN_CHECK(o.adapters && o.rank > 0 && in > 0 && out > 0, "{}: LoRA adapter of rank {} on [{} -> {}]", module,
               o.rank, in, out);
  using K = LoraCut::Kind;
  const bool tp = cut.kind != K::None && cut.tp_size > 1;
  if (!tp) cut_.kind = K::None;
  ParamDesc a;
  a.name = lora_param_name(module, false);
  a.shape = Shape{r_, in};
  a.init = Init::LinearDefault;  // kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
  a.fan_in = int64_t(in) * (tp && cut.kind == K::Row ? cut.tp_size : 1);  // the full layer's inputs
  a.fan_out = r_;
  ParamDesc b;
  b.name = lora_param_name(module, true);
  b.shape = Shape{out, r_};
  b.init = Init::Zeros;
  b.fan_in = r_;
  b.fan_out = out;
  if (tp && cut.kind == K::Column) {
    a.tp_partial = true;  // every rank's output columns add to its gradient
    if (cut.replicated) {
      b.tp_partial = true;
    } else {
      b.tp_dim = 0;
      b.tp_blocks = cut.tp_blocks;
      b.tp_full = int64_t(out) * cut.tp_size;
    }
  } else if (tp && cut.kind == K::Row) {
    a.tp_dim = 1;
    a.tp_blocks = cut.tp_blocks;
    a.tp_full = int64_t(in) * cut.tp_size;
  }
  a_ = ps_.declare(a);
  b_ = ps_.declare(b);
}

void LoraAdapter::forward(Ctx& ctx, const Tensor& x2, Tensor& y2) {
  const int64_t m = x2.dim(0);
  if (!(ctx.replaying && ctx.keep)) {  // selective recompute keeps z from the first forward
    z_ = ctx.output_arena().alloc(x2.dtype, Shape{m, r_});
    ctx.be.gemm(false, true, s_, x2, ps_.cparam(a_), 0.f, z_);  // z = s x A^T
    if (cut_.kind == LoraCut::Kind::Row) {
      DTRAIN_CHECK(ctx.tp, "{}: a row-parallel LoRA adapter without a tensor-parallel group", name_);
      ctx.tp->allreduce_sum(z_);  // the ranks' input columns
    }
  }
  ctx.be.gemm(false, true, 1.f, z_, ps_.cparam(b_), 1.f, y2);  // y += z B^T
}

void LoraAdapter::backward(Ctx& ctx, const Tensor& dy2, const Tensor& x2, Tensor& dx2) {
  DTRAIN_CHECK(z_.defined() && z_.dim(0) == dy2.dim(0), "{}: LoRA backward without forward", name_);
  Tensor none;
  Tensor db = ps_.grad(b_);
  ctx.be.linear_wgrad(dy2, z_, false, db, none);  // dB += dy^T z
  ctx.notify_grad(b_);
  Tensor du = ctx.arena.alloc(dy2.dtype, z_.shape);
  ctx.be.gemm(false, false, s_, dy2, ps_.cparam(b_), 0.f, du);  // du = s dy B
  Tensor da = ps_.grad(a_);
  ctx.be.linear_wgrad(du, x2, false, da, none);  // dA += du^T x
  ctx.notify_grad(a_);
  ctx.be.gemm(false, false, 1.f, du, ps_.cparam(a_), 1.f, dx2);  // dx += du A
  z_ = Tensor();
}

Tensor lora_concat_parts(Ctx& ctx, const std::vector<Tensor>& parts, const std::vector<int>& widths, int64_t m,
                         DType dt) {
  DTRAIN_CHECK(parts.size() == widths.size() && !parts.empty(), "lora: {} parts of {} widths", parts.size(),
               widths.size());
  auto part = [&](size_t i) {
    if (parts[i].defined()) return parts[i];
    Tensor z = ctx.arena.alloc(dt, Shape{m, widths[i]});
    ctx.be.fill(z, 0.f);
    return z;
  };
  Tensor acc = part(0);
  int64_t w = widths[0];
  for (size_t i = 1; i < parts.size(); ++i) {
    Tensor next = ctx.arena.alloc(dt, Shape{m, w + widths[i]});
    ctx.be.concat_channels(acc, part(i), next);
    acc = next;
    w += widths[i];
  }
  return acc;
}

std::vector<Tensor> lora_split_parts(Ctx& ctx, const Tensor& dy2, const std::vector<int>& widths,
                                     const std::vector<bool>& wanted) {
  const int64_t m = dy2.dim(0);
  std::vector<Tensor> out(widths.size());
  Tensor rest = dy2;  // the columns of parts [0, i]
  int64_t w = dy2.dim(1);
  for (size_t i = widths.size(); i-- > 1;) {
    w -= widths[i];
    bool any_before = false;
    for (size_t j = 0; j < i; ++j) any_before = any_before || wanted[j];
    Tensor head = any_before ? ctx.arena.alloc(dy2.dtype, Shape{m, w}) : Tensor();
    Tensor tail = wanted[i] ? ctx.arena.alloc(dy2.dtype, Shape{m, widths[i]}) : Tensor();
    if (head.defined() || tail.defined()) ctx.be.split_channels(rest, head, tail);
    out[i] = tail;
    if (!any_before) return out;
    rest = head;
  }
  out[0] = rest;
  return out;
}

}  // namespace dtrain

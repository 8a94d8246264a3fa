#include "nn/transformer.h"

namespace dtrain {

// ---------------------------------------------------------------- LayerNorm
LayerNorm::LayerNorm(ParamStore& ps, const std::string& name, int channels, float eps, bool tp_partial)
    : ResidualNorm(ps, name, channels, eps, tp_partial) {
  ParamDesc b = weight_desc(name, channels, tp_partial);
  b.name = join_name(name, "bias");
  b.init = Init::Zeros;
  b_ = ps.declare(b);
}

Tensor LayerNorm::forward(Ctx& ctx, const Tensor& x) {
  Tensor y = alloc_outputs(ctx, x, &mean_);
  ctx.be.layernorm_fwd(x, ps_.param(w_), ps_.param(b_), y, mean_, rstd_, eps_);
  x_ = x;
  return y;
}

Tensor LayerNorm::forward_add(Ctx& ctx, const Tensor& a, const Tensor& b, Tensor& h) {
  Tensor y = alloc_add_outputs(ctx, a, b, h, &mean_);
  ctx.be.add_layernorm_fwd(a, b, h, ps_.param(w_), ps_.param(b_), y, mean_, rstd_, eps_);
  x_ = h;
  return y;
}

void LayerNorm::backward_to(Ctx& ctx, const Tensor& dy, Tensor& dx, bool accumulate_dx) {
  const bool grads = !ps_.frozen();  // a frozen (LoRA base) norm: the input gradient alone
  Tensor dg = grads ? ps_.grad(w_) : Tensor(), db = grads ? ps_.grad(b_) : Tensor();
  ctx.be.layernorm_bwd(dy, x_, ps_.param(w_), mean_, rstd_, dx, dg, db, /*accumulate=*/true, accumulate_dx);
  if (grads) {
    ctx.notify_grad(w_);
    ctx.notify_grad(b_);
  }
  x_ = Tensor();
}

// ---------------------------------------------------------------- Conv1D
namespace {
LinearOptions conv1d_options(float std, LinearOptions::Tp tp, int tp_size, int tp_blocks, bool sequence) {
  LinearOptions o;
  o.sequence = sequence;
  o.tp = tp;
  o.tp_size = tp_size;
  o.tp_blocks = tp_blocks;
  o.weight_in_out = true;
  o.weight_init = Init::Normal;
  o.weight_init_arg = std;
  o.bias_init = Init::Zeros;
  return o;
}
}  // namespace

Conv1D::Conv1D(ParamStore& ps, const std::string& name, int in_features, int out_features,
               float std, LinearOptions::Tp tp, int tp_size, int tp_blocks, bool sequence)
    : Linear(ps, name, in_features, out_features, conv1d_options(std, tp, tp_size, tp_blocks, sequence)) {}

// ---------------------------------------------------------------- attention
CausalSelfAttention::CausalSelfAttention(ParamStore& ps, const std::string& name, int n_embd,
                                         int n_head, float proj_std, int tp_size, bool sequence)
    : c_(n_embd / tp_size),
      h_(n_head / tp_size),
      seq_(sequence && tp_size > 1),
      c_attn_(ps, join_name(name, "c_attn"), n_embd, 3 * (n_embd / tp_size), 0.02f, LinearOptions::Tp::Column,
              tp_size, 3, seq_),
      c_proj_(ps, join_name(name, "c_proj"), n_embd / tp_size, n_embd, proj_std, LinearOptions::Tp::Row, tp_size, 1,
              seq_) {
  DTRAIN_CHECK(n_head > 0 && n_embd % n_head == 0 && tp_size > 0 && n_head % tp_size == 0,
               "{}: n_embd {} not divisible by n_head {}, or n_head not by tensor parallel {}", name, n_embd,
               n_head, tp_size);
}

Tensor CausalSelfAttention::forward(Ctx& ctx, const Tensor& x) {
  int64_t B = 0, T = 0;
  if (seq_) {  // c_attn gathers the ranks' rows: all B*T of them
    DTRAIN_CHECK(x.ndim() == 2 && seq_len_ > 0, "attention: sequence-parallel input {} (sequence length {})",
                 x.shape.str(), seq_len_);
    qkv_ = c_attn_.forward(ctx, x);
    T = seq_len_;
    B = qkv_.dim(0) / T;
    DTRAIN_CHECK(B * T == qkv_.dim(0), "attention: {} gathered rows are not sequences of {}", qkv_.dim(0), T);
    qkv_ = qkv_.view(Shape{B, T, qkv_.dim(1)});
  } else {
    DTRAIN_CHECK(x.ndim() == 3, "attention: input {} is not [B,T,C]", x.shape.str());
    B = x.dim(0), T = x.dim(1);
    qkv_ = c_attn_.forward(ctx, x);
  }
  y_ = ctx.arena.alloc(x.dtype, Shape{B, T, c_});
  const AttentionSaved sv = ctx.be.attention_saved(B, h_, T, c_ / h_, qkv_.dtype);
  saved_ = ctx.arena.alloc(sv.dtype, sv.shape);
  ctx.be.attention_fwd(qkv_, y_, saved_, h_, 0, doc_pos_);
  return c_proj_.forward(ctx, y_);
}

Tensor CausalSelfAttention::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(qkv_.defined(), "attention: backward without forward");
  Tensor dyattn = c_proj_.backward(ctx, dy);
  Tensor dqkv = ctx.arena.alloc(qkv_.dtype, qkv_.shape);
  ctx.be.attention_bwd(dyattn, qkv_, y_, saved_, dqkv, h_, 0, doc_pos_);
  qkv_ = y_ = saved_ = Tensor();
  return c_attn_.backward(ctx, dqkv);
}

Tensor CausalSelfAttention::decode(Ctx& ctx, const Tensor& x, Tensor& kcache, Tensor& vcache,
                                   int64_t pos) {
  DTRAIN_CHECK(x.ndim() == 3 && x.dim(1) == 1, "attention decode: input {} is not [B,1,C]", x.shape.str());
  Tensor qkv = c_attn_.forward(ctx, x);
  Tensor y = ctx.arena.alloc(x.dtype, Shape{x.dim(0), 1, c_});
  ctx.be.attention_decode(qkv, kcache, vcache, pos, y, h_);
  return c_proj_.forward(ctx, y);
}

// ---------------------------------------------------------------- MLP and block
Mlp::Mlp(ParamStore& ps, const std::string& name, int n_embd, float proj_std, int tp_size, bool sequence)
    : c_fc_(ps, join_name(name, "c_fc"), n_embd, 4 * n_embd / tp_size, 0.02f, LinearOptions::Tp::Column, tp_size, 1,
            sequence),
      c_proj_(ps, join_name(name, "c_proj"), 4 * n_embd / tp_size, n_embd, proj_std, LinearOptions::Tp::Row,
              tp_size, 1, sequence) {}

// c_fc's GEMM applies the GELU (and keeps the pre-activation); c_proj's input-gradient
// GEMM applies GELU's derivative (Backend::gemm_bias_gelu / gemm_dgelu).
Tensor Mlp::forward(Ctx& ctx, const Tensor& x) {
  Tensor h = c_fc_.forward_gelu(ctx, x, pre_);
  return c_proj_.forward(ctx, h);
}

Tensor Mlp::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(pre_.defined(), "mlp: backward without forward");
  Tensor dpre = c_proj_.backward_dgelu(ctx, dy, pre_);
  pre_ = Tensor();
  return c_fc_.backward(ctx, dpre);
}

namespace {
std::unique_ptr<Module> make_mlp(ParamStore& ps, const std::string& name, int n_embd, float proj_std, int tp_size,
                                 bool sequence, const MoeConfig* moe, MoeStats* stats) {
  if (!moe) return std::make_unique<Mlp>(ps, name, n_embd, proj_std, tp_size, sequence);
  auto expert = [n_embd, proj_std](ParamStore& p, const std::string& n) -> std::unique_ptr<Module> {
    return std::make_unique<Mlp>(p, n, n_embd, proj_std);
  };
  return std::make_unique<MoeMlp>(ps, name, n_embd, *moe, 0.02f, stats, expert);
}
}  // namespace

Block::Block(ParamStore& ps, const std::string& name, int n_embd, int n_head, float proj_std, int tp_size,
             bool sequence, const MoeConfig* moe, MoeStats* moe_stats)
    : ln_1_(ps, join_name(name, "ln_1"), n_embd, 1e-5f, sequence && tp_size > 1),
      attn_(ps, join_name(name, "attn"), n_embd, n_head, proj_std, tp_size, sequence),
      ln_2_(ps, join_name(name, "ln_2"), n_embd, 1e-5f, sequence && tp_size > 1),
      mlp_(make_mlp(ps, join_name(name, "mlp"), n_embd, proj_std, tp_size, sequence && tp_size > 1, moe, moe_stats)) {
  set_layers(ln_1_, attn_, ln_2_, *mlp_);
}

}  // namespace dtrain

#include "nn/llama_layers.h"

namespace dtrain {

// ---------------------------------------------------------------- RMSNorm
RMSNorm::RMSNorm(ParamStore& ps, const std::string& name, int channels, float eps, bool tp_partial)
    : ResidualNorm(ps, name, channels, eps, tp_partial) {}

Tensor RMSNorm::forward(Ctx& ctx, const Tensor& x) {
  Tensor y = alloc_outputs(ctx, x);
  ctx.be.rmsnorm_fwd(x, ps_.param(w_), y, rstd_, eps_);
  x_ = x;
  return y;
}

Tensor RMSNorm::forward_add(Ctx& ctx, const Tensor& a, const Tensor& b, Tensor& h) {
  Tensor y = alloc_add_outputs(ctx, a, b, h);
  ctx.be.add_rmsnorm_fwd(a, b, h, ps_.param(w_), y, rstd_, eps_);
  x_ = h;
  return y;
}

void RMSNorm::backward_to(Ctx& ctx, const Tensor& dy, Tensor& dx, bool accumulate_dx) {
  const bool grads = !ps_.frozen();  // a frozen (LoRA base) norm: the input gradient alone
  Tensor dw = grads ? ps_.grad(w_) : Tensor();
  ctx.be.rmsnorm_bwd(dy, x_, ps_.param(w_), rstd_, dx, dw, /*accumulate=*/true, accumulate_dx);
  if (grads) ctx.notify_grad(w_);
  x_ = Tensor();
}

// ---------------------------------------------------------------- attention
namespace {
LinearOptions row_parallel(bool bias, float std, int tp_size, bool sequence, int tp_blocks = 1) {
  LinearOptions o;
  o.tp_blocks = tp_blocks;
  o.bias = bias;
  o.weight_init = Init::Normal;
  o.weight_init_arg = std;
  o.bias_init = Init::Zeros;
  o.tp = LinearOptions::Tp::Row;
  o.tp_size = tp_size;
  o.sequence = sequence;
  return o;
}
bool sequence_parallel(const LlamaLayerSpec& s) { return s.sequence && s.tp_size > 1; }
// Tensor parallel: the key/value heads split over the ranks (T divides them), or else
// replicated: every rank holds all of them and, of every key/value head's group of query heads,
// the same share (block k of q_proj's rows, and of o_proj's columns, is group k, cut in T).
bool kv_split(const LlamaLayerSpec& s) { return s.kv_heads % s.tp_size == 0; }
}  // namespace

LlamaAttention::LlamaAttention(ParamStore& ps, const std::string& name, const LlamaLayerSpec& s,
                               const RopeInputs* rope)
    : h_(s.heads / s.tp_size),
      hkv_(kv_split(s) ? s.kv_heads / s.tp_size : s.kv_heads),
      hd_(s.head_dim),
      seq_(sequence_parallel(s)),
      rope_(rope),
      qkv_(ps, name, s.hidden,
           {{"q_proj", h_ * hd_, kv_split(s) ? 1 : s.kv_heads},
            {"k_proj", hkv_ * hd_, 1, !kv_split(s)},
            {"v_proj", hkv_ * hd_, 1, !kv_split(s)}},
           s.qkv_bias, s.init_std, s.tp_size, seq_),
      o_proj_(ps, join_name(name, "o_proj"), h_ * hd_, s.hidden,
              row_parallel(s.o_bias, s.init_std, s.tp_size, seq_, kv_split(s) ? 1 : s.kv_heads)) {
  DTRAIN_CHECK(s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0 && s.tp_size > 0 &&
                   s.heads % s.tp_size == 0 && (kv_split(s) || s.heads % (s.kv_heads * s.tp_size) == 0) && rope,
               "{}: {} query heads, {} key/value heads over {} tensor-parallel ranks", name, s.heads, s.kv_heads,
               s.tp_size);
}

Tensor LlamaAttention::forward(Ctx& ctx, const Tensor& x) {
  int64_t B = 0, T = 0;
  Tensor qkv = qkv_.forward(ctx, x);
  if (seq_) {  // the stacked projection gathered the ranks' rows: all B*T of them
    DTRAIN_CHECK(x.ndim() == 2 && seq_len_ > 0 && qkv.dim(0) % seq_len_ == 0,
                 "attention: sequence-parallel input {} (sequence length {})", x.shape.str(), seq_len_);
    T = seq_len_;
    B = qkv.dim(0) / T;
    qkv = qkv.view(Shape{B, T, qkv.dim(1)});
  } else {
    DTRAIN_CHECK(x.ndim() == 3, "attention: input {} is not [B,T,C]", x.shape.str());
    B = x.dim(0), T = x.dim(1);
  }
  // q and k rotated into a new tensor: the projection's output may be kept (selective recompute)
  qkv_rot_ = ctx.arena.alloc(qkv.dtype, qkv.shape);
  ctx.be.rope_fwd(qkv, rope_->cos, rope_->sin, rope_->positions, h_ + hkv_, qkv_rot_);
  y_ = ctx.arena.alloc(qkv.dtype, Shape{B, T, int64_t(h_) * hd_});
  const AttentionSaved sv = ctx.be.attention_saved(B, h_, T, hd_, qkv.dtype);
  saved_ = ctx.arena.alloc(sv.dtype, sv.shape);
  ctx.be.attention_fwd(qkv_rot_, y_, saved_, h_, hkv_, doc_pos_);
  return o_proj_.forward(ctx, y_);
}

Tensor LlamaAttention::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(qkv_rot_.defined(), "attention: backward without forward");
  Tensor dyattn = o_proj_.backward(ctx, dy);
  Tensor dqkv = ctx.arena.alloc(qkv_rot_.dtype, qkv_rot_.shape);
  ctx.be.attention_bwd(dyattn, qkv_rot_, y_, saved_, dqkv, h_, hkv_, doc_pos_);
  ctx.be.rope_bwd(dqkv, rope_->cos, rope_->sin, rope_->positions, h_ + hkv_, dqkv);  // in place
  qkv_rot_ = y_ = saved_ = Tensor();
  return qkv_.backward(ctx, dqkv);
}

Tensor LlamaAttention::decode(Ctx& ctx, const Tensor& x, Tensor& kcache, Tensor& vcache, int64_t pos) {
  DTRAIN_CHECK(x.ndim() == 3 && x.dim(1) == 1, "attention decode: input {} is not [B,1,C]", x.shape.str());
  Tensor qkv = qkv_.forward(ctx, x);
  // the position's row of the tables: every sample is at `pos`
  ctx.be.rope_fwd(qkv, rope_->cos.slice0(pos, pos + 1), rope_->sin.slice0(pos, pos + 1), Tensor(), h_ + hkv_, qkv);
  Tensor y = ctx.arena.alloc(x.dtype, Shape{x.dim(0), 1, int64_t(h_) * hd_});
  ctx.be.attention_decode(qkv, kcache, vcache, pos, y, h_, hkv_);
  return o_proj_.forward(ctx, y);
}

// ---------------------------------------------------------------- SwiGLU MLP
SwiGluMlp::SwiGluMlp(ParamStore& ps, const std::string& name, const LlamaLayerSpec& s, SwiGluNames names,
                     int intermediate)
    : gate_up_(ps, name, s.hidden,
               {{names.gate, (intermediate ? intermediate : s.intermediate) / s.tp_size},
                {names.up, (intermediate ? intermediate : s.intermediate) / s.tp_size}},
               s.mlp_bias, s.init_std, s.tp_size, sequence_parallel(s)),
      down_proj_(ps, join_name(name, names.down), (intermediate ? intermediate : s.intermediate) / s.tp_size, s.hidden,
                 row_parallel(s.mlp_bias, s.init_std, s.tp_size, sequence_parallel(s))) {
  const int width = intermediate ? intermediate : s.intermediate;
  DTRAIN_CHECK(width > 0 && width % s.tp_size == 0, "{}: intermediate size {} over {} ranks", name, width, s.tp_size);
}

Tensor SwiGluMlp::forward(Ctx& ctx, const Tensor& x) {
  gu_ = gate_up_.forward(ctx, x);
  Shape hs = gu_.shape;
  hs[-1] /= 2;
  Tensor h = ctx.arena.alloc(gu_.dtype, hs);
  ctx.be.swiglu_fwd(gu_, h);
  return down_proj_.forward(ctx, h);
}

Tensor SwiGluMlp::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(gu_.defined(), "mlp: backward without forward");
  Tensor dh = down_proj_.backward(ctx, dy);
  Tensor dgu = ctx.arena.alloc(gu_.dtype, gu_.shape);
  ctx.be.swiglu_bwd(gu_, dh, dgu);
  gu_ = Tensor();
  return gate_up_.backward(ctx, dgu);
}

// ---------------------------------------------------------------- decoder layer
namespace {
// The block's MLP: dense SwiGLU, or the mixture of experts (Mixtral's names for llama, Qwen2-MoE's
// for qwen2).
std::unique_ptr<Module> make_mlp(ParamStore& ps, const std::string& block, const LlamaLayerSpec& s) {
  if (!s.moe_layer) return std::make_unique<SwiGluMlp>(ps, join_name(block, "mlp"), s);
  const int width = s.moe.expert_intermediate > 0 ? s.moe.expert_intermediate : s.intermediate;
  const SwiGluNames names = s.qwen2 ? SwiGluNames{} : SwiGluNames{"w1", "w3", "w2"};
  auto expert = [&s, names, width](ParamStore& p, const std::string& n) -> std::unique_ptr<Module> {
    return std::make_unique<SwiGluMlp>(p, n, s, names, width);
  };
  auto shared = [&s](ParamStore& p, const std::string& n) -> std::unique_ptr<Module> {
    return std::make_unique<SwiGluMlp>(p, n, s, SwiGluNames{}, s.moe.shared_intermediate);
  };
  return std::make_unique<MoeMlp>(ps, join_name(block, s.qwen2 ? "mlp" : "block_sparse_moe"), s.hidden, s.moe,
                                  s.init_std, s.moe_stats, expert, shared);
}
}  // namespace

LlamaBlock::LlamaBlock(ParamStore& ps, const std::string& name, const LlamaLayerSpec& s, const RopeInputs* rope)
    : attn_(ps, join_name(name, "self_attn"), s, rope),
      mlp_(make_mlp(ps, name, s)),
      input_layernorm_(ps, join_name(name, "input_layernorm"), s.hidden, s.eps, sequence_parallel(s)),
      post_attention_layernorm_(ps, join_name(name, "post_attention_layernorm"), s.hidden, s.eps,
                                sequence_parallel(s)) {
  set_layers(input_layernorm_, attn_, post_attention_layernorm_, *mlp_);
}

}  // namespace dtrain

#pragma once
// Transformer layers for GPT-2 (pre-LN decoder blocks), with Hugging Face GPT-2 names and
// layouts: LayerNorm (weight, bias), Conv1D (weight [in, out] as HF's Conv1D: y = x W + b),
// GELU (tanh), CausalSelfAttention (attn.c_attn fused QKV, attn.c_proj), MLP (mlp.c_fc,
// mlp.c_proj) and Block. Activations have the input's dtype; parameters and grads are f32
// (the model feeds compute-dtype casts of the weights under mixed precision: not yet).
#include <memory>
#include <string>

#include "nn/decoder_block.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/moe.h"

namespace dtrain {

class LayerNorm : public ResidualNorm {
 public:
  // tp_partial: sequence parallelism, the rank normalises its rows only (ParamDesc::tp_partial)
  LayerNorm(ParamStore& ps, const std::string& name, int channels, float eps = 1e-5f, bool tp_partial = false);
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  // forward of h = a + b, which it returns in h (Backend::add_layernorm_fwd): the residual
  // add in the layer norm's kernel
  Tensor forward_add(Ctx& ctx, const Tensor& a, const Tensor& b, Tensor& h) override;

 private:
  void backward_to(Ctx& ctx, const Tensor& dy, Tensor& dx, bool accumulate_dx) override;
  int b_;
  Tensor mean_;
};

// HF Conv1D: a Linear with weight [in, out] (Normal(0, std) init) and bias [out] (zeros).
class Conv1D : public Linear {
 public:
  // tp: Megatron's column- or row-parallel part (LinearOptions::tp); in/out are the part's
  Conv1D(ParamStore& ps, const std::string& name, int in_features, int out_features, float std,
         LinearOptions::Tp tp = LinearOptions::Tp::None, int tp_size = 1, int tp_blocks = 1, bool sequence = false);
};

// x [B,T,C] -> c_proj(attention(c_attn(x))) [B,T,C]. With tp_size T > 1 (T divides n_head)
// this rank holds n_head/T heads: c_attn column-parallel (its q, k and v columns), c_proj
// row-parallel (Megatron). With `sequence` (nn/seq_parallel.h) x and the output are the rank's
// block of the [B*T, C] rows, [B*T/tp_size, C]; set_seq_len(T) before each forward says how
// the gathered rows form sequences.
class CausalSelfAttention : public DecoderAttention {
 public:
  CausalSelfAttention(ParamStore& ps, const std::string& name, int n_embd, int n_head,
                      float proj_std, int tp_size = 1, bool sequence = false);
  void set_seq_len(int64_t t) override { seq_len_ = t; }
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  // the K/V cache kcache/vcache [B,n_head,Tmax,C/n_head]
  Tensor decode(Ctx& ctx, const Tensor& x, Tensor& kcache, Tensor& vcache, int64_t pos) override;

 private:
  int c_, h_;  // the rank's channels and heads (C/T, n_head/T)
  bool seq_ = false;
  int64_t seq_len_ = 0;  // sequence parallel: tokens per sequence of the gathered rows
  Conv1D c_attn_, c_proj_;
  // Kept for backward (step arena): c_attn's output, the attention output y (flash
  // attention's backward reads it) and what the backend saves (Backend::attention_saved).
  Tensor qkv_, y_, saved_;
};

class Mlp : public Module {
 public:
  // tp_size > 1: c_fc column-parallel, c_proj row-parallel (4*n_embd/T hidden units here)
  // sequence: x and the output are the rank's block of rows (nn/seq_parallel.h)
  Mlp(ParamStore& ps, const std::string& name, int n_embd, float proj_std, int tp_size = 1, bool sequence = false);
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  Conv1D c_fc_;
  Conv1D c_proj_;
  Tensor pre_;  // c_fc's output before the GELU, kept for backward
};

// GPT-2 block (nn/decoder_block.h): h = x + attn(ln_1(x)); y = h + mlp(ln_2(h)).
class Block : public DecoderBlock {
 public:
  // sequence: x and y are the rank's block of the [B*T, C] rows (nn/seq_parallel.h); the layer
  // norms and residual adds run on it
  // moe: the MLP is a mixture of these experts (nn/moe.h: mlp.gate, mlp.experts.{e}.c_fc / c_proj)
  Block(ParamStore& ps, const std::string& name, int n_embd, int n_head, float proj_std, int tp_size = 1,
        bool sequence = false, const MoeConfig* moe = nullptr, MoeStats* moe_stats = nullptr);

 private:
  LayerNorm ln_1_;
  CausalSelfAttention attn_;
  LayerNorm ln_2_;
  std::unique_ptr<Module> mlp_;  // Mlp, or MoeMlp
};

}  // namespace dtrain

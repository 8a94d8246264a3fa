#pragma once
// The Llama family's decoder layer (Hugging Face's LlamaDecoderLayer / Qwen2DecoderLayer) with
// its names and nn.Linear layouts ([out, in]): RMSNorm (weight only), attention with rotary
// position embeddings and grouped-query heads (self_attn.q_proj / k_proj / v_proj run as one
// stacked GEMM, nn/stacked_linear.h; self_attn.o_proj), the SwiGLU MLP (mlp.gate_proj | up_proj
// stacked, mlp.down_proj) and the pre-norm block (input_layernorm, post_attention_layernorm).
// Activations have the input's dtype; parameters and gradients are f32 (layers read the
// compute-dtype copy under mixed precision, norm weights in f32).
//
// Tensor parallelism (tp_size T > 1, Megatron): q/k/v and gate/up column-parallel, o_proj and
// down_proj row-parallel. The key/value heads are split when T divides them (rank r holds
// query heads [r H/T, (r+1) H/T) and key/value heads [r Hkv/T, (r+1) Hkv/T)), else replicated
// when Hkv T divides H: every rank holds k_proj and v_proj whole (their gradients partial,
// ParamDesc::tp_partial, summed over the group after the backward) and, of each key/value
// head's group of H/Hkv query heads, the r-th share of H/(Hkv T) (q_proj's rows and o_proj's
// columns cut in Hkv blocks), so local query head i still reads local key/value head
// i / (H/T / Hkv). `sequence`: sequence parallelism as GPT's (nn/seq_parallel.h: the norms and
// residual adds on the rank's block of rows).
#include <memory>
#include <string>

#include "nn/decoder_block.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/moe.h"
#include "nn/stacked_linear.h"

namespace dtrain {

// What one decoder layer is, as the full model declares it (head counts of the whole model;
// the layer takes its share under tensor parallelism).
struct LlamaLayerSpec {
  int hidden = 0;                            // hidden_size
  int heads = 0, kv_heads = 0, head_dim = 0;  // num_attention_heads, num_key_value_heads, head_dim
  int intermediate = 0;                      // intermediate_size
  float eps = 1e-6f;                         // rms_norm_eps
  bool qkv_bias = false, o_bias = false, mlp_bias = false;
  float init_std = 0.02f;                    // initializer_range
  int tp_size = 1;
  bool sequence = false;
  // Mixture of experts (nn/moe.h) in place of the MLP when moe_layer: Mixtral's
  // block_sparse_moe (experts' w1 / w3 / w2) for model_type llama, Qwen2-MoE's mlp (experts'
  // gate_proj / up_proj / down_proj, the shared expert) for qwen2.
  MoeConfig moe;
  bool moe_layer = false;
  bool qwen2 = false;
  MoeStats* moe_stats = nullptr;
};

// The rotary tables and positions a forward uses (owned by the model, valid for the step):
// cos/sin f32 [P, head_dim/2] (models/rope.h), positions i32 [B,T] or undefined (0..T-1).
struct RopeInputs {
  Tensor cos, sin, positions;
};

class RMSNorm : public ResidualNorm {
 public:
  // tp_partial: sequence parallelism, the rank normalises its rows only (ParamDesc::tp_partial)
  RMSNorm(ParamStore& ps, const std::string& name, int channels, float eps, bool tp_partial = false);
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  // forward of h = a + b, which it returns in h (Backend::add_rmsnorm_fwd)
  Tensor forward_add(Ctx& ctx, const Tensor& a, const Tensor& b, Tensor& h) override;

 private:
  void backward_to(Ctx& ctx, const Tensor& dy, Tensor& dx, bool accumulate_dx) override;
};

// x [B,T,C] -> o_proj(attention(rope(q_proj | k_proj | v_proj (x)))). With `sequence` x and the
// output are the rank's block of the [B*T, C] rows; set_seq_len(T) says how the gathered rows
// form sequences.
class LlamaAttention : public DecoderAttention {
 public:
  LlamaAttention(ParamStore& ps, const std::string& name, const LlamaLayerSpec& s, const RopeInputs* rope);
  void set_seq_len(int64_t t) override { seq_len_ = t; }
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  // the K/V cache kcache/vcache [B, kv heads, Tmax, head_dim]
  Tensor decode(Ctx& ctx, const Tensor& x, Tensor& kcache, Tensor& vcache, int64_t pos) override;

 private:
  int h_, hkv_, hd_;  // the rank's query and key/value heads, head size
  bool seq_ = false;
  int64_t seq_len_ = 0;
  const RopeInputs* rope_;
  StackedLinear qkv_;
  Linear o_proj_;
  // Kept for backward (step arena): the rotated q | k | v, the attention output and what the
  // backend saves (Backend::attention_saved).
  Tensor qkv_rot_, y_, saved_;
};

// SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)). An expert of a mixture names its parts
// as its model does (Mixtral: w1, w3, w2) and has its own width.
struct SwiGluNames {
  const char* gate = "gate_proj";
  const char* up = "up_proj";
  const char* down = "down_proj";
};
class SwiGluMlp : public Module {
 public:
  SwiGluMlp(ParamStore& ps, const std::string& name, const LlamaLayerSpec& s, SwiGluNames names = {},
            int intermediate = 0);
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  StackedLinear gate_up_;
  Linear down_proj_;
  Tensor gu_;  // gate | up, kept for backward
};

// The decoder layer (nn/decoder_block.h): h = x + self_attn(input_layernorm(x));
// y = h + mlp(post_attention_layernorm(h)).
class LlamaBlock : public DecoderBlock {
 public:
  LlamaBlock(ParamStore& ps, const std::string& name, const LlamaLayerSpec& s, const RopeInputs* rope);

 private:
  // declared in Hugging Face's module order (its state_dict order)
  LlamaAttention attn_;
  std::unique_ptr<Module> mlp_;  // SwiGluMlp, or MoeMlp in a mixture-of-experts layer
  RMSNorm input_layernorm_;
  RMSNorm post_attention_layernorm_;
};

}  // namespace dtrain

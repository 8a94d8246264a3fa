#include "models/llama.h"

#include "models/decoder_lm.h"
#include "nn/llama_layers.h"

namespace dtrain {

GptSpec llama_spec(const LlamaConfig& c) {
  GptSpec s;
  s.preset = c.model_type;
  s.family = "llama";
  s.llama = c;
  return s;
}

void llama_validate(GptSpec& s) {
  LlamaConfig& c = s.llama;
  if (c.model_type != "llama" && c.model_type != "qwen2")
    user_error("model.model_type: expected \"llama\" or \"qwen2\", got \"{}\"", c.model_type);
  require_positive({{"vocab_size", c.vocab_size}, {"hidden_size", c.hidden_size},
                    {"intermediate_size", c.intermediate_size}, {"num_hidden_layers", c.num_hidden_layers},
                    {"num_attention_heads", c.num_attention_heads},
                    {"max_position_embeddings", c.max_position_embeddings}});
  if (c.num_key_value_heads < 0 || c.head_dim < 0)
    user_error("model.num_key_value_heads / head_dim: expected >= 0 (0: the default), got {} / {}",
               c.num_key_value_heads, c.head_dim);
  if (c.num_key_value_heads == 0) c.num_key_value_heads = c.num_attention_heads;
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    user_error("model.num_key_value_heads: {} does not divide model.num_attention_heads {}", c.num_key_value_heads,
               c.num_attention_heads);
  if (c.head_dim == 0) {
    if (c.hidden_size % c.num_attention_heads != 0)
      user_error("model.hidden_size: {} is not divisible by model.num_attention_heads {} (or set model.head_dim)",
                 c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) user_error("model.head_dim: rotary embeddings need an even head size, got {}", c.head_dim);
  if (!(c.rms_norm_eps > 0)) user_error("model.rms_norm_eps: expected a positive number, got {}", c.rms_norm_eps);
  if (!(c.initializer_range >= 0))
    user_error("model.initializer_range: expected a number >= 0, got {}", c.initializer_range);
  if (c.model_type == "qwen2" && (c.attention_bias || c.mlp_bias))
    user_error("model.attention_bias / mlp_bias: qwen2 has biases on q_proj, k_proj and v_proj only (set neither)");
  rope_inv_freq(c.rope_theta, c.rope_scaling, c.head_dim);  // the rope switches (UserError naming them)
  s.n_layer = c.num_hidden_layers;
  s.n_head = c.num_attention_heads;
  s.n_embd = c.hidden_size;
  s.block_size = c.max_position_embeddings;
  s.vocab_size = c.vocab_size;
  // tensor parallel: key/value heads split (T divides them) or replicated (Hkv T divides the
  // query heads: each rank the same share of every group; nn/llama_layers.h)
  const int T = s.tp_size, kv = c.num_key_value_heads;
  if (T > 1 && (c.intermediate_size % T != 0 || c.num_attention_heads % T != 0 ||
                (kv % T != 0 && c.num_attention_heads % (kv * T) != 0)))
    user_error("parallel.tensor = {} must divide model.intermediate_size = {} and model.num_attention_heads = {}, and "
               "either divide model.num_key_value_heads = {} (split) or divide num_attention_heads / "
               "num_key_value_heads = {} (replicated key/value heads)",
               T, c.intermediate_size, c.num_attention_heads, kv, c.num_attention_heads / kv);
}

int64_t llama_param_count(const GptSpec& s, bool padded) {
  const LlamaConfig& c = s.llama;
  const int64_t C = c.hidden_size, I = c.intermediate_size, V = padded ? s.padded_vocab : c.vocab_size;
  const int64_t q = int64_t(c.num_attention_heads) * c.head_size(), kv = int64_t(c.kv_heads()) * c.head_size();
  const int64_t attn = C * (q + 2 * kv) + (c.qkv_bias() ? q + 2 * kv : 0) + q * C + (c.o_bias() ? C : 0);
  const int64_t mlp = 3 * C * I + (c.ffn_bias() ? 2 * I + C : 0);
  // a mixture of experts' layer: the router, E SwiGLU experts (no biases) and the shared expert
  // with its gate
  const MoeConfig& m = s.moe;
  const int64_t Ie = m.expert_intermediate > 0 ? m.expert_intermediate : I, Is = m.shared_intermediate;
  const int64_t moe = C * m.num_experts + int64_t(m.num_experts) * 3 * C * Ie + (Is > 0 ? 3 * C * Is + C : 0);
  const int64_t L = c.num_hidden_layers, Lm = m.moe_layers(c.num_hidden_layers);
  return V * C + L * (attn + 2 * C) + (L - Lm) * mlp + Lm * moe + C + (c.tie_word_embeddings ? 0 : V * C);
}

namespace {

LlamaLayerSpec layer_spec(const GptSpec& s) {
  const LlamaConfig& c = s.llama;
  LlamaLayerSpec l;
  l.hidden = c.hidden_size;
  l.heads = c.num_attention_heads;
  l.kv_heads = c.kv_heads();
  l.head_dim = c.head_size();
  l.intermediate = c.intermediate_size;
  l.eps = float(c.rms_norm_eps);
  l.qkv_bias = c.qkv_bias();
  l.o_bias = c.o_bias();
  l.mlp_bias = c.ffn_bias();
  l.init_std = float(c.initializer_range);
  l.tp_size = s.tp_size;
  l.sequence = s.sequence_parallel;
  l.moe = s.moe;
  l.qwen2 = c.model_type == "qwen2";
  return l;
}

class Llama final : public DecoderLm<LlamaModel> {
 public:
  Llama(const GptSpec& spec, ParamStore& ps)
      : DecoderLm(spec, ps, {"llama", "max_position_embeddings"}, spec.llama.kv_heads(),
                  spec.llama.head_size()),
        ls_(layer_spec(spec)) {
    const LlamaConfig& c = s_.llama;
    rope_inv_ = rope_inv_freq(c.rope_theta, c.rope_scaling, c.head_size());
    // the full model's init streams: embed_tokens 0, layer i from 1 + i * per_block, then
    // model.norm and lm_head
    const float std = float(c.initializer_range);
    const bool tied = c.tie_word_embeddings;
    if (s_.pp_embed || (tied && s_.pp_head)) embed_ = ps.declare(vocab_desc("model.embed_tokens.weight", std, 0));
    const int64_t after = add_blocks("model.layers.", 1, [&](ParamStore& p, const std::string& name, int layer) {
      LlamaLayerSpec l = ls_;
      l.moe_layer = layer < 0 ? s_.moe.enabled() : s_.moe.layer_is_moe(layer);
      l.moe_stats = moe_stats_.get();
      return std::make_unique<LlamaBlock>(p, name, l, &rope_);
    });
    if (s_.pp_head) {
      ps.set_next_init_stream(after);
      norm_ = std::make_unique<RMSNorm>(ps, "model.norm", c.hidden_size, float(c.rms_norm_eps), sp());
      head_ = tied ? embed_ : ps.declare(vocab_desc("lm_head.weight", std, after + 1));
    }
  }

  // Per token: 2 * N (every parameter of the padded flat buffer once) + 4 * L * (heads *
  // head_dim) * T (attention scores and values over a block_size window); training is 3x.
  // A mixture of experts counts the parameters a token uses: its top k experts of E.
  double forward_flops(int64_t, int64_t) const override {
    const LlamaConfig& c = s_.llama;
    const MoeConfig& m = s_.moe;
    const int64_t ie = m.expert_intermediate > 0 ? m.expert_intermediate : c.intermediate_size;
    const double idle = double(m.moe_layers(s_.n_layer)) * (m.num_experts - m.top_k) * 3.0 * c.hidden_size * ie;
    return transformer_forward_flops_per_token(double(llama_param_count(s_, true)) - (m.enabled() ? idle : 0.0),
                                               s_.n_layer, c.num_attention_heads * c.head_size(), s_.block_size);
  }

 private:
  void before_forward(Backend& be) override {
    upload_rope(be);
    rope_.positions = positions_;  // this forward's (its backward and a recompute read them there)
  }

  void before_decode(Backend& be) override { upload_rope(be); }

  // The rotary tables [block_size, head_dim/2] on the backend, made at the first forward.
  void upload_rope(Backend& be) {
    if (rope_buf_.bytes() > 0 && rope_be_ == &be) return;
    std::vector<float> cos, sin;
    rope_tables(rope_inv_, s_.block_size, cos, sin);
    rope_buf_ = Buffer(be, 2 * cos.size() * sizeof(float));
    const Shape sh{int64_t(s_.block_size), int64_t(rope_inv_.size())};
    rope_.cos = rope_buf_.tensor(DType::F32, sh);
    rope_.sin = rope_buf_.tensor(DType::F32, sh, cos.size() * sizeof(float));
    be.copy_from_host(rope_.cos.data, cos.data(), cos.size() * sizeof(float));
    be.copy_from_host(rope_.sin.data, sin.data(), sin.size() * sizeof(float));
    rope_be_ = &be;
  }

  LlamaLayerSpec ls_;
  std::vector<float> rope_inv_;
  RopeInputs rope_;  // the tables on the device and this step's positions; the layers read it
  Buffer rope_buf_;
  const Backend* rope_be_ = nullptr;
};

}  // namespace

std::unique_ptr<LlamaModel> build_llama(const GptSpec& spec, ParamStore& ps) {
  GptSpec s = spec;
  gpt_validate(s);
  DTRAIN_CHECK(s.family == "llama", "build_llama: a spec of family {}", s.family);
  return std::make_unique<Llama>(s, ps);
}

}  // namespace dtrain

#include "models/llama.h"

#include "core/buffer.h"
#include "nn/llama_layers.h"
#include "nn/seq_parallel.h"
#include "nn/vocab_parallel.h"

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
  auto positive = [](const char* key, int v) {
    if (v < 1) user_error("model.{}: expected a positive integer, got {}", key, v);
  };
  positive("vocab_size", c.vocab_size);
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  positive("num_attention_heads", c.num_attention_heads);
  positive("max_position_embeddings", c.max_position_embeddings);
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
  return V * C + c.num_hidden_layers * (attn + mlp + 2 * C) + C + (c.tie_word_embeddings ? 0 : V * C);
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
  return l;
}

class Llama final : public LlamaModel {
 public:
  Llama(const GptSpec& spec, ParamStore& ps) : s_(spec), ps_(ps), ls_(layer_spec(spec)) {
    const LlamaConfig& c = s_.llama;
    const int C = c.hidden_size;
    const int first = s_.pp_layers >= 0 ? s_.pp_first : 0;
    const int count = s_.pp_layers >= 0 ? s_.pp_layers : s_.n_layer;
    rope_inv_ = rope_inv_freq(c.rope_theta, c.rope_scaling, c.head_size());
    // the full model's init streams: embed_tokens 0, layer i from 1 + i * per_block, then
    // model.norm and lm_head
    int64_t per_block = 0;
    {
      ParamStore probe;
      if (s_.tp_size > 1) probe.set_tensor_parallel(0, s_.tp_size);
      LlamaBlock b(probe, "probe", ls_, &rope_);
      per_block = int64_t(probe.params().size());
    }
    vl_ = gpt_local_vocab(s_);
    auto vocab_desc = [&](const char* name, int64_t stream) {
      ParamDesc d;
      d.name = name;
      d.shape = Shape{vl_, C};
      if (s_.tp_size > 1) {  // rows [rank * vl_, (rank + 1) * vl_) of the padded vocabulary
        DTRAIN_CHECK(ps.tp_size() == s_.tp_size, "llama: tensor parallel {} but the ParamStore has {}", s_.tp_size,
                     ps.tp_size());
        d.tp_dim = 0;
        d.tp_full = s_.padded_vocab;
      }
      d.init = Init::Normal;
      d.init_arg = float(c.initializer_range);
      d.decay = true;
      d.layout = Layout::PadRows;
      d.torch_rows = s_.vocab_size;
      d.init_stream = stream;
      return d;
    };
    const bool tied = c.tie_word_embeddings;
    if (s_.pp_embed || (tied && s_.pp_head)) embed_ = ps.declare(vocab_desc("model.embed_tokens.weight", 0));
    for (int i = first; i < first + count; ++i) {  // one unit per layer (ZeRO-3, recompute)
      const std::string name = "model.layers." + std::to_string(i);
      ps.set_next_init_stream(1 + int64_t(i) * per_block);
      units_.push_back(ps.begin_unit(name));
      blocks_.push_back(std::make_unique<LlamaBlock>(ps, name, ls_, &rope_));
      ps.end_unit();
    }
    if (s_.pp_head) {
      ps.set_next_init_stream(1 + int64_t(s_.n_layer) * per_block);
      norm_ = std::make_unique<RMSNorm>(ps, "model.norm", C, float(c.rms_norm_eps), sp());
      head_ = tied ? embed_ : ps.declare(vocab_desc("lm_head.weight", 2 + int64_t(s_.n_layer) * per_block));
    }
  }

  const GptSpec& spec() const override { return s_; }

  // Per token: 2 * N (every parameter of the padded flat buffer once) + 4 * L * (heads *
  // head_dim) * T (attention scores and values over a block_size window); training is 3x.
  double forward_flops(int64_t, int64_t) const override {
    const LlamaConfig& c = s_.llama;
    return transformer_forward_flops_per_token(double(llama_param_count(s_, true)), s_.n_layer,
                                               c.num_attention_heads * c.head_size(), s_.block_size);
  }

  void set_positions(const Tensor& positions) override { positions_ = positions; }

  Tensor forward(Ctx& ctx, const Tensor& ids) override {
    if (!s_.pp_embed) return forward_from(ctx, ids);
    if (ids.dtype != DType::I32 || ids.ndim() != 2) fault("llama: input {} must be token ids i32 [B,T]", ids.str());
    const int64_t B = ids.dim(0), T = ids.dim(1), C = s_.n_embd;
    check_len(B, T);
    Tensor x = ctx.arena.alloc(ps_.compute_dtype(), sp() ? Shape{B * T / s_.tp_size, C} : Shape{B, T, C});
    if (tp())
      emb_ = vp_embedding_fwd(ctx, ids, ps_.cparam(embed_), Tensor(), int64_t(ps_.tp_rank()) * vl_,
                              int64_t(vl_) * s_.tp_size, x, sp());
    else
      ctx.be.embedding_fwd(ids, ps_.cparam(embed_), Tensor(), x);
    ids_ = ids;
    return forward_blocks(ctx, x, B, T);
  }

  Tensor input_grad() const override { return dx_in_; }

  void backward(Ctx& ctx, const Tensor& dout) override {
    DTRAIN_CHECK(!block_in_.empty() || blocks_.empty(), "llama: backward without forward");
    const int64_t B = B_, T = T_, C = s_.n_embd;
    Tensor dx;
    if (s_.pp_head) {
      DTRAIN_CHECK(dout.numel() == B * T * vl_, "llama: dlogits {}", dout.str());
      Tensor dl = dout.view(Shape{B * T, vl_});
      Tensor dhead = ps_.grad(head_);
      ctx.be.gemm(true, false, 1.f, dl, h_, 1.f, dhead);  // dW += dlogits^T h (the LM head)
      Tensor dh = ctx.arena.alloc(dl.dtype, Shape{B, T, C});
      Tensor dh2 = dh.view(Shape{B * T, C});
      ctx.be.gemm(false, false, 1.f, dl, ps_.cparam(head_), 0.f, dh2);
      // the head is column-parallel in h: the ranks' parts summed (sequence parallel: this
      // rank's block of rows of the sum)
      if (sp()) dh = sp_scatter_rows(ctx, dh2);
      else if (tp()) ctx.tp->allreduce_sum(dh2);
      if (head_ != embed_) ctx.notify_grad(head_);
      dx = norm_->backward(ctx, dh);
    } else {  // a pipeline stage before the last: the gradient of its output activations
      DTRAIN_CHECK(dout.numel() == B * T * C, "llama: pipeline stage output gradient {}", dout.str());
      dx = dout.view(Shape{B, T, C});
    }
    for (size_t i = blocks_.size(); i-- > 0;)
      dx = ctx.unit_backward(
          units_[i], [&, i](Ctx& c) { return blocks_[i]->forward(c, block_in_[i]); },
          [&, i](Ctx& c) { return blocks_[i]->backward(c, dx); });
    block_in_.clear();
    if (s_.pp_embed) {
      Tensor dembed = ps_.grad(embed_);
      if (sp())
        vp_embedding_bwd(ctx, sp_gather_rows(ctx, dx).view(Shape{B, T, C}), emb_, dembed, no_grad_);
      else if (tp())
        vp_embedding_bwd(ctx, dx, emb_, dembed, no_grad_);
      else
        ctx.be.embedding_bwd(dx, ids_, dembed, no_grad_, /*accumulate=*/true);
      emb_ = VpEmbeddingSaved{};
      dx_in_ = Tensor();
    } else {
      dx_in_ = dx;
    }
    if (embed_ >= 0) ctx.notify_grad(embed_);
    ids_ = h_ = Tensor();
  }

  void decode_begin(Backend& be, int64_t batch) override {
    DTRAIN_CHECK(batch > 0, "llama: decode batch {}", batch);
    DTRAIN_CHECK(s_.tp_size == 1, "llama: incremental decoding of a tensor-parallel model");
    DTRAIN_CHECK(!s_.staged(), "llama: incremental decoding of a pipeline stage");
    cache_shape_ = Shape{batch, int64_t(ls_.kv_heads), int64_t(s_.block_size), int64_t(ls_.head_dim)};
    const size_t half = size_t(cache_shape_.numel()) * dtype_size(ps_.compute_dtype());
    if (cache_.size() != blocks_.size() || cache_[0].bytes() != 2 * half) {
      cache_.clear();
      for (size_t i = 0; i < blocks_.size(); ++i) cache_.emplace_back(be, 2 * half);
    }
  }

  Tensor decode_step(Ctx& ctx, const Tensor& ids, int64_t pos) override {
    DTRAIN_CHECK(!cache_.empty(), "llama: decode_step without decode_begin");
    const int64_t B = cache_shape_[0], C = s_.n_embd;
    if (ids.dtype != DType::I32 || ids.numel() != B) fault("llama: decode ids {} must be i32 [{}]", ids.str(), B);
    if (pos < 0 || pos >= s_.block_size)
      user_error("llama: decode position {} must be in [0, model.max_position_embeddings = {})", pos, s_.block_size);
    upload_rope(ctx.be);
    Tensor x = ctx.arena.alloc(ps_.compute_dtype(), Shape{B, 1, C});
    ctx.be.embedding_fwd(ids.view(Shape{B, 1}), ps_.cparam(embed_), Tensor(), x);
    const DType cd = ps_.compute_dtype();
    const size_t half = size_t(cache_shape_.numel()) * dtype_size(cd);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Tensor k = cache_[i].tensor(cd, cache_shape_);
      Tensor v = cache_[i].tensor(cd, cache_shape_, half);
      ctx.unit_begin(units_[i], false);
      x = blocks_[i]->decode(ctx, x, k, v, pos);
      ctx.unit_end(units_[i], false);
    }
    Tensor h = norm_->forward(ctx, x).view(Shape{B, C});
    Tensor logits = ctx.arena.alloc(h.dtype, Shape{B, s_.padded_vocab});
    ctx.be.gemm(false, true, 1.f, h, ps_.cparam(head_), 0.f, logits);
    return logits;
  }

 private:
  bool tp() const { return s_.tp_size > 1; }
  bool sp() const { return s_.tp_size > 1 && s_.sequence_parallel; }

  void check_len(int64_t B, int64_t T) const {
    if (T < 1 || T > s_.block_size)
      user_error("llama: sequence length {} must be in [1, model.max_position_embeddings = {}]", T, s_.block_size);
    if (sp() && (B * T) % s_.tp_size != 0)
      user_error("llama: parallel.sequence: {} tokens ({} sequences of {}) do not split over parallel.tensor = {} ranks",
                 B * T, B, T, s_.tp_size);
    if (positions_.defined() &&
        (positions_.dtype != DType::I32 || positions_.ndim() != 2 || positions_.dim(0) != B || positions_.dim(1) != T))
      fault("llama: positions {} must be i32 [{},{}]", positions_.str(), B, T);
  }

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

  // a pipeline stage after the first: x is the previous stage's output [B,T,C]
  Tensor forward_from(Ctx& ctx, const Tensor& x) {
    if (x.ndim() != 3 || x.dim(2) != s_.n_embd || x.dtype != ps_.compute_dtype())
      fault("llama: pipeline stage input {} must be [B,T,{}] {}", x.str(), s_.n_embd, dtype_name(ps_.compute_dtype()));
    check_len(x.dim(0), x.dim(1));
    ids_ = Tensor();
    return forward_blocks(ctx, x, x.dim(0), x.dim(1));
  }

  Tensor forward_blocks(Ctx& ctx, Tensor x, int64_t B, int64_t T) {
    const int64_t C = s_.n_embd;
    upload_rope(ctx.be);
    rope_.positions = positions_;  // this forward's (its backward and a recompute read them there)
    positions_ = Tensor();
    B_ = B;
    T_ = T;
    block_in_.resize(blocks_.size());
    for (size_t i = 0; i < blocks_.size(); ++i) {
      block_in_[i] = x;  // what a recomputing block runs on again
      blocks_[i]->set_seq_len(T);
      x = ctx.unit_forward(units_[i], [&, i](Ctx& c) { return blocks_[i]->forward(c, block_in_[i]); });
    }
    if (!s_.pp_head) return x;  // a pipeline stage before the last: the activations
    h_ = norm_->forward(ctx, x);
    h_ = sp() ? sp_gather_rows(ctx, h_) : h_.view(Shape{B * T, C});  // the LM head takes every row
    Tensor logits = ctx.arena.alloc(h_.dtype, Shape{B * T, vl_});
    ctx.be.gemm(false, true, 1.f, h_, ps_.cparam(head_), 0.f, logits);  // h W^T (the rank's vocabulary)
    return logits;
  }

  GptSpec s_;
  ParamStore& ps_;
  LlamaLayerSpec ls_;
  int embed_ = -1, head_ = -1;  // head_ == embed_ when tied
  int vl_ = 0;                  // vocabulary rows held here (gpt_local_vocab)
  std::vector<float> rope_inv_;
  RopeInputs rope_;  // the tables on the device and this step's positions; the layers read it
  Buffer rope_buf_;
  const Backend* rope_be_ = nullptr;
  Tensor positions_;
  Tensor no_grad_;  // no position embedding: embedding_bwd's dwpe
  VpEmbeddingSaved emb_;
  std::vector<std::unique_ptr<LlamaBlock>> blocks_;
  std::vector<int> units_;
  std::vector<Tensor> block_in_;
  std::unique_ptr<RMSNorm> norm_;
  Tensor ids_, h_;
  Tensor dx_in_;
  int64_t B_ = 0, T_ = 0;
  std::vector<Buffer> cache_;
  Shape cache_shape_;
};

}  // namespace

std::unique_ptr<LlamaModel> build_llama(const GptSpec& spec, ParamStore& ps) {
  GptSpec s = spec;
  gpt_validate(s);
  DTRAIN_CHECK(s.family == "llama", "build_llama: a spec of family {}", s.family);
  return std::make_unique<Llama>(s, ps);
}

}  // namespace dtrain

#include "models/gpt.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/buffer.h"
#include "models/llama.h"
#include "nn/seq_parallel.h"
#include "nn/transformer.h"
#include "nn/vocab_parallel.h"

namespace dtrain {

// Any real vocabulary (Llama 3: 128256) fits; far below where padded_vocab * n_embd overflows int64.
constexpr int kMaxVocab = 1 << 24;

GptSpec gpt_preset(const std::string& name) {
  GptSpec s;
  s.preset = name;
  auto set = [&](int l, int h, int c, int block, int vocab) {
    s.n_layer = l, s.n_head = h, s.n_embd = c, s.block_size = block, s.vocab_size = vocab;
  };
  if (name == "tiny") set(2, 2, 64, 64, 256);
  else if (name == "gpt2") set(12, 12, 768, 1024, 50257);
  else if (name == "gpt2-medium") set(24, 16, 1024, 1024, 50257);
  else if (name == "gpt2-large") set(36, 20, 1280, 1024, 50257);
  else if (name == "gpt2-xl") set(48, 25, 1600, 1024, 50257);
  else
    user_error("model.preset: expected one of tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, got '{}'",
               name);
  s.padded_vocab = 0;
  gpt_validate(s);
  return s;
}

void gpt_validate(GptSpec& s) {
  if (s.family == "llama") llama_validate(s);  // fills the shape fields from s.llama
  else if (s.family != "gpt2") user_error("model.family: expected \"gpt2\" or \"llama\", got \"{}\"", s.family);
  auto positive = [](const char* key, int v) {
    if (v < 1) user_error("model.{}: expected a positive integer, got {}", key, v);
  };
  positive("n_layer", s.n_layer);
  positive("n_head", s.n_head);
  positive("n_embd", s.n_embd);
  positive("block_size", s.block_size);
  positive("vocab_size", s.vocab_size);
  if (s.family == "gpt2" && s.n_embd % s.n_head != 0)
    user_error("model.n_embd: {} is not divisible by model.n_head {}", s.n_embd, s.n_head);
  if (s.vocab_size > kMaxVocab)
    user_error("model.vocab_size: {} exceeds {}", s.vocab_size, kMaxVocab);
  const int rounded = (s.vocab_size + 127) / 128 * 128;
  if (s.padded_vocab == 0) s.padded_vocab = rounded;
  if (s.padded_vocab < s.vocab_size || s.padded_vocab % 128 != 0)
    user_error("model.padded_vocab: expected a multiple of 128 >= vocab_size {}, got {}",
               s.vocab_size, s.padded_vocab);
  if (s.tp_size < 1 || s.n_head % s.tp_size != 0)
    user_error("parallel.tensor = {} must divide model.n_head = {} (each tensor-parallel rank holds whole "
               "attention heads)", s.tp_size, s.n_head);
  if (s.pp_layers >= 0 && (s.pp_first < 0 || s.pp_layers < 1 || s.pp_first + s.pp_layers > s.n_layer))
    user_error("model.n_layer = {}: a pipeline stage of blocks [{}, {}) does not fit", s.n_layer, s.pp_first,
               s.pp_first + s.pp_layers);
  if (s.sequence_parallel && (s.tp_size < 2 || s.block_size % s.tp_size != 0))
    user_error("parallel.sequence = true needs parallel.tensor > 1 dividing model.block_size, got parallel.tensor = "
               "{} and model.block_size = {}", s.tp_size, s.block_size);
}

int gpt_local_vocab(const GptSpec& s) {
  const int64_t unit = 128 * int64_t(s.tp_size);
  return int((int64_t(s.padded_vocab) + unit - 1) / unit * unit / s.tp_size);
}

std::string gpt_tied_param(const GptSpec& s) {
  if (s.family != "llama") return "transformer.wte.weight";
  return s.llama.tie_word_embeddings ? "model.embed_tokens.weight" : "";
}

int64_t gpt_param_count(const GptSpec& s, bool padded) {
  if (s.family == "llama") return llama_param_count(s, padded);
  const int64_t C = s.n_embd, V = padded ? s.padded_vocab : s.vocab_size;
  const int64_t block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C +
                        (C * 4 * C + 4 * C) + (4 * C * C + C);
  return V * C + int64_t(s.block_size) * C + s.n_layer * block + 2 * C;
}

double transformer_forward_flops_per_token(double params, int n_layer, int n_embd, int seq) {
  return 2.0 * params + 4.0 * n_layer * double(n_embd) * double(seq);
}

namespace {

class Gpt final : public GptModel {
 public:
  Gpt(const GptSpec& spec, ParamStore& ps) : s_(spec), ps_(ps) {
    const int C = s_.n_embd;
    const int first = s_.pp_layers >= 0 ? s_.pp_first : 0;
    const int count = s_.pp_layers >= 0 ? s_.pp_layers : s_.n_layer;
    // the full model's init streams: wte 0, wpe 1, block i from 2 + i * per_block, ln_f after
    int64_t per_block = 0;
    {
      ParamStore probe;
      if (s_.tp_size > 1) probe.set_tensor_parallel(0, s_.tp_size);
      Block b(probe, "probe", C, s_.n_head, 0.02f, s_.tp_size, sp());
      per_block = int64_t(probe.params().size());
    }
    ParamDesc te;
    te.name = "transformer.wte.weight";
    vl_ = gpt_local_vocab(s_);
    te.shape = Shape{vl_, C};
    if (s_.tp_size > 1) {  // rows [rank * vl_, (rank + 1) * vl_) of the padded vocabulary
      DTRAIN_CHECK(ps.tp_size() == s_.tp_size, "gpt: tensor parallel {} but the ParamStore has {}", s_.tp_size,
                   ps.tp_size());
      te.tp_dim = 0;
      te.tp_full = s_.padded_vocab;
    }
    te.init = Init::Normal;
    te.init_arg = 0.02f;
    te.decay = true;
    te.layout = Layout::PadRows;
    te.torch_rows = s_.vocab_size;
    te.init_stream = 0;
    if (s_.pp_embed || s_.pp_head) wte_ = ps.declare(te);
    if (s_.pp_embed) {
      ParamDesc pe = te;
      pe.name = "transformer.wpe.weight";
      pe.shape = Shape{s_.block_size, C};
      pe.layout = Layout::Plain;
      pe.torch_rows = 0;
      pe.tp_dim = -1;
      pe.init_stream = 1;
      wpe_ = ps.declare(pe);
    }
    const float proj_std = 0.02f / std::sqrt(2.f * float(s_.n_layer));
    for (int i = first; i < first + count; ++i) {  // one unit per block (ZeRO-3, recompute)
      const std::string name = "transformer.h." + std::to_string(i);
      ps.set_next_init_stream(2 + int64_t(i) * per_block);
      units_.push_back(ps.begin_unit(name));
      blocks_.push_back(std::make_unique<Block>(ps, name, C, s_.n_head, proj_std, s_.tp_size, sp()));
      ps.end_unit();
    }
    if (s_.pp_head) {
      ps.set_next_init_stream(2 + int64_t(s_.n_layer) * per_block);
      ln_f_ = std::make_unique<LayerNorm>(ps, "transformer.ln_f", C, 1e-5f, sp());
    }
  }

  const GptSpec& spec() const override { return s_; }

  // Per token: 2 * N (every parameter of the padded flat buffer once) + 4 * L * d * T
  // (attention scores and values over a block_size window); training is 3x (PaLM).
  double forward_flops(int64_t, int64_t) const override {
    return transformer_forward_flops_per_token(double(gpt_param_count(s_, true)), s_.n_layer, s_.n_embd, s_.block_size);
  }

  Tensor forward(Ctx& ctx, const Tensor& ids) override {
    if (!s_.pp_embed) return forward_from(ctx, ids);
    if (ids.dtype != DType::I32 || ids.ndim() != 2)
      fault("gpt: input {} must be token ids i32 [B,T]", ids.str());
    const int64_t B = ids.dim(0), T = ids.dim(1), C = s_.n_embd;
    if (T < 1 || T > s_.block_size)
      user_error("gpt: sequence length {} must be in [1, model.block_size = {}]", T, s_.block_size);
    // sequence parallel: between the tensor-parallel regions the rank's block of the B*T rows
    if (sp() && (B * T) % s_.tp_size != 0)
      user_error("gpt: parallel.sequence: {} tokens ({} sequences of {}) do not split over parallel.tensor = {} ranks",
                 B * T, B, T, s_.tp_size);
    Tensor x = ctx.arena.alloc(ps_.compute_dtype(), sp() ? Shape{B * T / s_.tp_size, C} : Shape{B, T, C});
    if (tp())
      emb_ = vp_embedding_fwd(ctx, ids, ps_.cparam(wte_), ps_.cparam(wpe_), int64_t(ps_.tp_rank()) * vl_,
                              int64_t(vl_) * s_.tp_size, x, sp());
    else
      ctx.be.embedding_fwd(ids, ps_.cparam(wte_), ps_.cparam(wpe_), x);
    ids_ = ids;
    return forward_blocks(ctx, x, B, T);
  }

  // a pipeline stage after the first: x is the previous stage's output [B,T,C]
  Tensor forward_from(Ctx& ctx, const Tensor& x) {
    if (x.ndim() != 3 || x.dim(2) != s_.n_embd || x.dtype != ps_.compute_dtype())
      fault("gpt: pipeline stage input {} must be [B,T,{}] {}", x.str(), s_.n_embd, dtype_name(ps_.compute_dtype()));
    ids_ = Tensor();
    return forward_blocks(ctx, x, x.dim(0), x.dim(1));
  }

  Tensor forward_blocks(Ctx& ctx, Tensor x, int64_t B, int64_t T) {
    const int64_t C = s_.n_embd;
    B_ = B;
    T_ = T;
    block_in_.resize(blocks_.size());
    for (size_t i = 0; i < blocks_.size(); ++i) {
      block_in_[i] = x;  // what a recomputing block runs on again
      blocks_[i]->set_seq_len(T);
      x = ctx.unit_forward(units_[i], [&, i](Ctx& c) { return blocks_[i]->forward(c, block_in_[i]); });
    }
    if (!s_.pp_head) return x;  // a pipeline stage before the last: the activations
    h_ = ln_f_->forward(ctx, x);
    h_ = sp() ? sp_gather_rows(ctx, h_) : h_.view(Shape{B * T, C});  // the LM head takes every row
    Tensor logits = ctx.arena.alloc(h_.dtype, Shape{B * T, vl_});
    ctx.be.gemm(false, true, 1.f, h_, ps_.cparam(wte_), 0.f, logits);  // h wte^T (the rank's vocabulary)
    return logits;
  }

  Tensor input_grad() const override { return dx_in_; }

  void backward(Ctx& ctx, const Tensor& dout) override {
    DTRAIN_CHECK(!block_in_.empty() || blocks_.empty(), "gpt: backward without forward");
    const int64_t B = B_, T = T_, C = s_.n_embd;
    Tensor dx;
    Tensor dwte = wte_ >= 0 ? ps_.grad(wte_) : Tensor();
    if (s_.pp_head) {
      DTRAIN_CHECK(dout.numel() == B * T * vl_, "gpt: dlogits {}", dout.str());
      Tensor dl = dout.view(Shape{B * T, vl_});
      ctx.be.gemm(true, false, 1.f, dl, h_, 1.f, dwte);  // dwte += dlogits^T h (LM head)
      Tensor dh = ctx.arena.alloc(dl.dtype, Shape{B, T, C});
      Tensor dh2 = dh.view(Shape{B * T, C});
      ctx.be.gemm(false, false, 1.f, dl, ps_.cparam(wte_), 0.f, dh2);
      // the LM head is column-parallel in h: the ranks' parts summed (sequence parallel: the
      // block of this rank's rows of the sum)
      if (sp()) dh = sp_scatter_rows(ctx, dh2);
      else if (tp()) ctx.tp->allreduce_sum(dh2);
      dx = ln_f_->backward(ctx, dh);
    } else {  // a pipeline stage before the last: the gradient of its output activations
      DTRAIN_CHECK(dout.numel() == B * T * C, "gpt: pipeline stage output gradient {}", dout.str());
      dx = dout.view(Shape{B, T, C});
    }
    for (size_t i = blocks_.size(); i-- > 0;)
      dx = ctx.unit_backward(
          units_[i], [&, i](Ctx& c) { return blocks_[i]->forward(c, block_in_[i]); },
          [&, i](Ctx& c) { return blocks_[i]->backward(c, dx); });
    block_in_.clear();
    if (s_.pp_embed) {
      Tensor dwpe = ps_.grad(wpe_);
      if (sp())
        vp_embedding_bwd(ctx, sp_gather_rows(ctx, dx).view(Shape{B, T, C}), emb_, dwte, dwpe);
      else if (tp())
        vp_embedding_bwd(ctx, dx, emb_, dwte, dwpe);
      else
        ctx.be.embedding_bwd(dx, ids_, dwte, dwpe, /*accumulate=*/true);
      emb_ = VpEmbeddingSaved{};
      ctx.notify_grad(wpe_);
      dx_in_ = Tensor();
    } else {
      dx_in_ = dx;
    }
    if (wte_ >= 0) ctx.notify_grad(wte_);
    ids_ = h_ = Tensor();
  }

  void decode_begin(Backend& be, int64_t batch) override {
    DTRAIN_CHECK(batch > 0, "gpt: decode batch {}", batch);
    DTRAIN_CHECK(s_.tp_size == 1, "gpt: incremental decoding of a tensor-parallel model");
    DTRAIN_CHECK(!s_.staged(), "gpt: incremental decoding of a pipeline stage");
    const int64_t H = s_.n_head, hd = s_.n_embd / s_.n_head;
    cache_shape_ = Shape{batch, H, int64_t(s_.block_size), hd};
    const size_t half = size_t(cache_shape_.numel()) * dtype_size(ps_.compute_dtype());
    if (cache_.size() != blocks_.size() || cache_[0].bytes() != 2 * half) {
      cache_.clear();
      for (size_t i = 0; i < blocks_.size(); ++i) cache_.emplace_back(be, 2 * half);
    }
  }

  Tensor decode_step(Ctx& ctx, const Tensor& ids, int64_t pos) override {
    DTRAIN_CHECK(!cache_.empty(), "gpt: decode_step without decode_begin");
    const int64_t B = cache_shape_[0], C = s_.n_embd;
    if (ids.dtype != DType::I32 || ids.numel() != B)
      fault("gpt: decode ids {} must be i32 [{}]", ids.str(), B);
    if (pos < 0 || pos >= s_.block_size)
      user_error("gpt: decode position {} must be in [0, model.block_size = {})", pos,
                 s_.block_size);
    Tensor x = ctx.arena.alloc(ps_.compute_dtype(), Shape{B, 1, C});
    Tensor wpe = ps_.cparam(wpe_).slice0(pos, pos + 1);
    ctx.be.embedding_fwd(ids.view(Shape{B, 1}), ps_.cparam(wte_), wpe, x);
    const DType cd = ps_.compute_dtype();
    const size_t half = size_t(cache_shape_.numel()) * dtype_size(cd);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Tensor k = cache_[i].tensor(cd, cache_shape_);
      Tensor v = cache_[i].tensor(cd, cache_shape_, half);
      ctx.unit_begin(units_[i], false);
      x = blocks_[i]->decode(ctx, x, k, v, pos);
      ctx.unit_end(units_[i], false);
    }
    Tensor h = ln_f_->forward(ctx, x).view(Shape{B, C});
    Tensor logits = ctx.arena.alloc(h.dtype, Shape{B, s_.padded_vocab});
    ctx.be.gemm(false, true, 1.f, h, ps_.cparam(wte_), 0.f, logits);
    return logits;
  }

 private:
  GptSpec s_;
  ParamStore& ps_;
  bool tp() const { return s_.tp_size > 1; }
  bool sp() const { return s_.tp_size > 1 && s_.sequence_parallel; }
  int wte_ = -1, wpe_ = -1;
  int vl_ = 0;  // wte rows held here (gpt_local_vocab)
  VpEmbeddingSaved emb_;  // tensor parallel: the embedding's forward, for its backward
  std::vector<std::unique_ptr<Block>> blocks_;
  std::vector<int> units_;  // ParamStore unit of each block
  std::vector<Tensor> block_in_;  // each block's input in the training forward
  std::unique_ptr<LayerNorm> ln_f_;
  Tensor ids_, h_;
  Tensor dx_in_;  // a stage without the embedding: its input's gradient
  int64_t B_ = 0, T_ = 0;
  std::vector<Buffer> cache_;  // per layer: K then V, each cache_shape_ in the compute dtype
  Shape cache_shape_;
};

}  // namespace

std::unique_ptr<GptModel> build_gpt(const GptSpec& spec, ParamStore& ps) {
  if (spec.family == "llama") return build_llama(spec, ps);
  GptSpec s = spec;
  gpt_validate(s);
  return std::make_unique<Gpt>(s, ps);
}

Tensor GptLoss::forward(Ctx& ctx, const Tensor& logits, const Tensor& targets, int64_t vocab_size,
                        float loss_scale, int64_t mean_over) {
  DTRAIN_CHECK(logits.ndim() == 2 && targets.dtype == DType::I32 &&
                   targets.numel() == logits.dim(0),
               "gpt loss: logits {} targets {}", logits.str(), targets.str());
  const int64_t n = logits.dim(0);
  Tensor losses = ctx.arena.alloc(DType::F32, Shape{n});
  dlogits_ = ctx.training ? ctx.arena.alloc(logits.dtype, logits.shape) : Tensor();
  const float denom = float(mean_over > 0 ? mean_over : n);
  if (ctx.tp && ctx.tp->size() > 1)  // logits of the rank's vocabulary slice
    vp_softmax_xent(ctx, logits, targets.view(Shape{n}), int64_t(ctx.tp->rank()) * logits.dim(1), vocab_size,
                    loss_scale / denom, losses, dlogits_);
  else
    ctx.be.softmax_xent_masked(logits, targets.view(Shape{n}), vocab_size, loss_scale / denom,
                               losses, dlogits_);
  return losses;
}

Tensor GptLoss::backward() const {
  DTRAIN_CHECK(dlogits_.defined(), "gpt loss: backward without a training forward");
  return dlogits_;
}

std::vector<int32_t> gpt_generate(GptModel& model, Backend& be, Arena& arena,
                                  std::vector<int32_t> tokens, const SampleOptions& o, Rng& rng) {
  const GptSpec& s = model.spec();
  if (tokens.empty()) user_error("sample: the prompt is empty (give at least one token)");
  for (int32_t t : tokens)
    if (t < 0 || t >= s.vocab_size)
      user_error("sample: prompt token {} is outside the vocabulary [0, {})", t, s.vocab_size);
  if (!(o.temperature >= 0.f)) user_error("sample: temperature must be >= 0, got {}", o.temperature);
  std::vector<float> row(static_cast<size_t>(s.padded_vocab));
  if (o.kv_cache) model.decode_begin(be, 1);
  size_t cached = 0;  // the cache holds tokens[0, cached)
  for (int step = 0; step < o.max_new_tokens; ++step) {
    arena.reset();
    Ctx ctx{be, arena, /*training=*/false, {}, {}};
    const size_t T = std::min(tokens.size(), size_t(s.block_size));
    const size_t start = tokens.size() - T;
    Tensor last;
    // Once the context exceeds block_size the window slides and every position shifts:
    // the cache is invalid, so those steps take the full forward (same cost as before).
    if (o.kv_cache && start == 0) {
      for (; cached < T; ++cached) {
        arena.reset();
        Tensor id = arena.alloc(DType::I32, Shape{1});
        be.copy_from_host(id.data, tokens.data() + start + cached, 4);
        last = model.decode_step(ctx, id, int64_t(cached));
      }
    } else {
      Tensor ids = arena.alloc(DType::I32, Shape{1, int64_t(T)});
      be.copy_from_host(ids.data, tokens.data() + start, T * 4);
      Tensor logits = model.forward(ctx, ids);
      last = logits.slice0(int64_t(T) - 1, int64_t(T));
    }
    copy_to_host_f32(be, arena, last, row);
    const int V = s.vocab_size;
    int32_t next = 0;
    if (o.temperature == 0.f) {
      next = int32_t(std::max_element(row.begin(), row.begin() + V) - row.begin());
    } else {
      std::vector<int32_t> idx(static_cast<size_t>(V));
      std::iota(idx.begin(), idx.end(), 0);
      int k = (o.top_k > 0 && o.top_k < V) ? o.top_k : V;
      if (k < V)
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                          [&](int32_t a, int32_t b) { return row[size_t(a)] > row[size_t(b)] ||
                                                             (row[size_t(a)] == row[size_t(b)] && a < b); });
      float mx = -INFINITY;
      for (int i = 0; i < k; ++i) mx = std::max(mx, row[size_t(idx[size_t(i)])]);
      std::vector<double> p(static_cast<size_t>(k));
      double sum = 0;
      for (int i = 0; i < k; ++i)
        sum += p[size_t(i)] = std::exp(double(row[size_t(idx[size_t(i)])] - mx) / o.temperature);
      double u = rng.uniform_double() * sum;
      int pick = k - 1;
      for (int i = 0; i < k; ++i) {
        if (u < p[size_t(i)]) {
          pick = i;
          break;
        }
        u -= p[size_t(i)];
      }
      next = idx[size_t(pick)];
    }
    tokens.push_back(next);
  }
  arena.reset();
  return tokens;
}

}  // namespace dtrain

#include "models/gpt.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "models/decoder_lm.h"
#include "models/llama.h"
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

void require_positive(std::initializer_list<std::pair<const char*, int>> keys) {
  for (const auto& [key, v] : keys)
    if (v < 1) user_error("model.{}: expected a positive integer, got {}", key, v);
}

void gpt_validate(GptSpec& s) {
  if (s.family == "llama") llama_validate(s);  // fills the shape fields from s.llama
  else if (s.family != "gpt2") user_error("model.family: expected \"gpt2\" or \"llama\", got \"{}\"", s.family);
  require_positive({{"n_layer", s.n_layer}, {"n_head", s.n_head}, {"n_embd", s.n_embd},
                    {"block_size", s.block_size}, {"vocab_size", s.vocab_size}});
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
  if (const MoeConfig& m = s.moe; m.enabled()) {
    if (m.top_k < 1 || m.top_k > m.num_experts)
      user_error("model.num_experts_per_tok = {} must be in [1, model.num_local_experts = {}]", m.top_k, m.num_experts);
    if (m.every < 1) user_error("model.moe_every: expected a positive integer, got {}", m.every);
    if (s.tp_size > 1)
      user_error("parallel.tensor = {} with model.num_local_experts = {}: tensor parallelism of mixture-of-experts "
                 "layers is not implemented (use data parallelism and ZeRO)", s.tp_size, m.num_experts);
    if (s.staged())
      user_error("parallel.pipeline with model.num_local_experts = {}: pipeline stages of a mixture-of-experts model "
                 "are not implemented (its load-balancing loss spans every layer)", m.num_experts);
    if (s.family == "gpt2" && (m.expert_intermediate > 0 || m.shared_intermediate > 0))
      user_error("model.moe_intermediate_size / shared_expert_intermediate_size: GPT-2's experts are its own MLP "
                 "(4 x n_embd, no shared expert); set model.arch = \"llama\" or \"qwen2\"");
  }
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
  const int64_t mlp = (C * 4 * C + 4 * C) + (4 * C * C + C);
  const int64_t block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C;
  const int64_t Lm = s.moe.moe_layers(s.n_layer);  // mixture layers: the router and E MLPs
  return V * C + int64_t(s.block_size) * C + s.n_layer * block + (s.n_layer - Lm) * mlp +
         Lm * (C * s.moe.num_experts + s.moe.num_experts * mlp) + 2 * C;
}

double transformer_forward_flops_per_token(double params, int n_layer, int n_embd, int seq) {
  return 2.0 * params + 4.0 * n_layer * double(n_embd) * double(seq);
}

namespace {

class Gpt final : public DecoderLm<GptModel> {
 public:
  Gpt(const GptSpec& spec, ParamStore& ps)
      : DecoderLm(spec, ps, {"gpt", "block_size"}, spec.n_head, spec.n_embd / spec.n_head) {
    // the full model's init streams: wte 0, wpe 1, block i from 2 + i * per_block, ln_f after
    const ParamDesc te = vocab_desc("transformer.wte.weight", 0.02f, 0);
    if (s_.pp_embed || s_.pp_head) embed_ = head_ = ps.declare(te);  // the LM head is wte
    if (s_.pp_embed) {
      ParamDesc pe = te;
      pe.name = "transformer.wpe.weight";
      pe.shape = Shape{s_.block_size, s_.n_embd};
      pe.layout = Layout::Plain;
      pe.torch_rows = 0;
      pe.tp_dim = -1;
      pe.init_stream = 1;
      pos_ = ps.declare(pe);
    }
    const float proj_std = 0.02f / std::sqrt(2.f * float(s_.n_layer));
    const int64_t after = add_blocks("transformer.h.", 2, [&](ParamStore& p, const std::string& name, int layer) {
      const bool moe = layer < 0 ? s_.moe.enabled() : s_.moe.layer_is_moe(layer);
      return std::make_unique<Block>(p, name, s_.n_embd, s_.n_head, proj_std, s_.tp_size, sp(),
                                     moe ? &s_.moe : nullptr, moe_stats_.get());
    });
    if (s_.pp_head) {
      ps.set_next_init_stream(after);
      norm_ = std::make_unique<LayerNorm>(ps, "transformer.ln_f", s_.n_embd, 1e-5f, sp());
    }
  }

  // Per token: 2 * N (every parameter of the padded flat buffer once) + 4 * L * d * T
  // (attention scores and values over a block_size window); training is 3x (PaLM).
  // A mixture of experts counts the parameters a token uses: its top k expert MLPs of E.
  double forward_flops(int64_t, int64_t) const override {
    const double C = s_.n_embd, mlp = 8 * C * C + 5 * C;
    const double idle = s_.moe.enabled() ? double(s_.moe.moe_layers(s_.n_layer)) * (s_.moe.num_experts - s_.moe.top_k) * mlp : 0;
    return transformer_forward_flops_per_token(double(gpt_param_count(s_, true)) - idle, s_.n_layer, s_.n_embd,
                                               s_.block_size);
  }
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

#pragma once
// GPT-2 (Radford et al. 2019) as Hugging Face's GPT2LMHeadModel: token + position
// embeddings (transformer.wte, transformer.wpe), n_layer pre-LN blocks
// (transformer.h.{i}.ln_1 / attn.c_attn / attn.c_proj / ln_2 / mlp.c_fc / mlp.c_proj, HF
// Conv1D layout: weight [in, out]), final transformer.ln_f, and the LM head tied to wte
// (no separate tensor). The vocabulary is padded to padded_vocab rows inside (llm.c);
// checkpoints hold the vocab_size real rows (Layout::PadRows), padded logits are never
// predicted (softmax_xent_masked) and the padding rows stay zero.
// Init as GPT-2/llm.c: Normal(0, 0.02), residual projections (c_proj) 0.02/sqrt(2*n_layer),
// biases 0, LayerNorm 1/0.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "models/llama_config.h"
#include "models/model.h"
#include "nn/moe.h"

namespace dtrain {

struct GptSpec {
  std::string preset = "tiny";
  // The decoder family: "gpt2" (this file's model) or "llama" (the Llama family, models/llama.h:
  // RMSNorm, rotary positions, SwiGLU, grouped-query attention, optional biases and untied head,
  // with its switches in `llama`, Hugging Face's names). For "llama" gpt_validate fills the
  // shape fields below from `llama` (n_layer = num_hidden_layers, n_head = num_attention_heads,
  // n_embd = hidden_size, block_size = max_position_embeddings, vocab_size), replacing what they
  // held: the code that serves both families (the loss, sampling, pipeline stages) reads them.
  std::string family = "gpt2";
  LlamaConfig llama;
  int n_layer = 2, n_head = 2, n_embd = 64, block_size = 64;
  int vocab_size = 256;
  int padded_vocab = 0;  // 0: vocab_size rounded up to a multiple of 128
  // Tensor parallelism (parallel.tensor, Megatron): the model is one rank's part, its
  // ParamStore set_tensor_parallel(rank, tp_size). Attention heads and MLP units split over
  // the ranks (tp_size divides n_head); the vocabulary (wte and the LM head) too, padded
  // further to a multiple of 128 * tp_size (the universal layout keeps padded_vocab rows).
  int tp_size = 1;
  // Sequence parallelism (parallel.sequence, with tp_size > 1; nn/seq_parallel.h): the layer
  // norms and residual adds run on the rank's block of the B*T token rows (B*T must divide
  // by tp_size); the embedding reduce-scatters to the blocks, ln_f's output is gathered
  // before the LM head, and the layer norms' gradients are summed over the group.
  bool sequence_parallel = false;
  // Pipeline parallelism (parallel.pipeline; session/pipeline.h): the model is one stage (a
  // chunk) of the full one: blocks [pp_first, pp_first + pp_layers) (pp_layers -1: all of
  // them), the embedding (wte, wpe) when pp_embed, ln_f and the LM head (wte, tied) when
  // pp_head. Its parameters keep the full model's names and initial values. A stage without
  // the embedding takes activations [B,T,C] (f32) instead of token ids; one without the head
  // returns them instead of logits, and its backward takes their gradient.
  int pp_first = 0, pp_layers = -1;
  bool pp_embed = true, pp_head = true;
  // Mixture of experts (nn/moe.h; model.num_local_experts > 0): every moe.every-th block's MLP is
  // a mixture (GPT-2: experts of its own MLP; the Llama family: Mixtral's or Qwen2-MoE's).
  MoeConfig moe;
  bool staged() const { return pp_layers >= 0 && !(pp_embed && pp_head && pp_first == 0 && pp_layers == n_layer); }
};
// The rows of wte a rank holds: padded_vocab rounded up to a multiple of 128 * tp_size, over
// tp_size (padded_vocab itself when tp_size is 1). Its logits have that many columns.
int gpt_local_vocab(const GptSpec& spec);

// The parameter the embedding and the LM head share (GPT-2's wte; a Llama's embed_tokens when
// tie_word_embeddings), or "" when the head is its own (an untied Llama): a pipeline's first
// and last stage both hold it and sum its gradient.
std::string gpt_tied_param(const GptSpec& s);

// tiny (2/2/64, block 64, vocab 256), gpt2 (12/12/768, 1024, 50257), gpt2-medium (24/16/1024),
// gpt2-large (36/20/1280), gpt2-xl (48/25/1600). UserError naming model.preset otherwise.
GptSpec gpt_preset(const std::string& name);
// Checks the spec (UserError naming the model.* key) and fills padded_vocab.
void gpt_validate(GptSpec& spec);
// Trainable parameters; padded=false counts the checkpoint (HF) tensors, true the flat buffer.
int64_t gpt_param_count(const GptSpec& spec, bool padded);
// Forward FLOPs per token counted for MFU (PaLM, appendix B): 2 * params + 4 * n_layer *
// n_embd * seq (attention scores and values over the full sequence); training counts 3x
// (6N + 12 L d T). GptModel::forward_flops and plan/layout_planner.h count with it.
double transformer_forward_flops_per_token(double params, int n_layer, int n_embd, int seq);

class GptModel : public Model {
 public:
  virtual const GptSpec& spec() const = 0;
  // x: token ids i32 [B,T], T <= block_size. Returns logits [B*T, padded_vocab] in
  // activation dtype (f32 for now); columns >= vocab_size are meaningless. Tensor parallel:
  // [B*T, gpt_local_vocab] of the rank's vocabulary slice (vocab_parallel.h).
  Tensor forward(Ctx& ctx, const Tensor& x) override = 0;
  // dout: dlogits [B*T, padded_vocab].
  void backward(Ctx& ctx, const Tensor& dout) override = 0;

  // Incremental decoding with a per-layer K/V cache [batch, n_head, block_size, head_dim]
  // held on `be` (inference only). decode_begin (re)allocates the caches; decode_step feeds
  // token ids i32 [batch] at position pos (< block_size; positions 0..pos-1 must have been
  // fed since decode_begin) and returns that position's logits [batch, padded_vocab].
  // A pipeline stage without the embedding: the gradient of its input after backward.
  virtual Tensor input_grad() const = 0;

  virtual void decode_begin(Backend& be, int64_t batch) = 0;
  virtual Tensor decode_step(Ctx& ctx, const Tensor& ids, int64_t pos) = 0;

  // Positions of the tokens of the next forward (and its backward): i32 [B,T] on the device,
  // each in [0, block_size) (GPT-2's learned position rows, the Llama family's rotary angles).
  // The next forward consumes them: a forward without a set_positions before it takes 0..T-1 in
  // every row. With `documents` the rows are packed documents: the positions restart at 0 at
  // each document's first token, and a token attends within its document only (a
  // block-diagonal causal mask; Backend::attention_fwd's doc_pos). Without it, every token sees
  // all the tokens before it in its row, as Hugging Face's position_ids do. A pipeline stage
  // after the first takes them too. The tensor must stay valid until that forward's backward.
  virtual void set_positions(const Tensor& positions, bool documents = false) = 0;

  // A mixture-of-experts model's routing statistics (its auxiliary losses and metrics); null for
  // a dense model.
  virtual MoeStats* moe_stats() { return nullptr; }
};

std::unique_ptr<GptModel> build_gpt(const GptSpec& spec, ParamStore& ps);

// Next-token cross-entropy over the first vocab_size logits (Backend::softmax_xent_masked;
// with Ctx::tp the vocabulary-parallel one over the rank's slice, nn/vocab_parallel.h).
class GptLoss {
 public:
  // logits [N, padded_vocab], targets i32 [N]. Returns per-token losses f32 [N] (device);
  // when ctx.training also dlogits = loss_scale / mean_over * d(sum losses) (mean_over 0: N).
  Tensor forward(Ctx& ctx, const Tensor& logits, const Tensor& targets, int64_t vocab_size,
                 float loss_scale = 1.f, int64_t mean_over = 0);
  Tensor backward() const;

 private:
  Tensor dlogits_;
};

struct SampleOptions {
  int max_new_tokens = 32;
  float temperature = 1.f;  // 0: greedy (argmax)
  int top_k = 0;            // 0: the whole vocabulary
  bool kv_cache = true;     // false: one full forward over the context per new token
};
// Autoregressive sampling from `prompt` (non-empty; the context is cropped to the last
// block_size tokens), batch 1, inference mode. With o.kv_cache each new token costs one
// decode_step (the prompt is fed position by position) while the context fits in
// block_size; once it exceeds block_size the window slides, every position shifts and the
// steps take one full forward over the cropped context, as without the cache. `arena` is
// reset before every step. Returns prompt + generated ids.
std::vector<int32_t> gpt_generate(GptModel& model, Backend& be, Arena& arena,
                                  std::vector<int32_t> prompt, const SampleOptions& o, Rng& rng);

}  // namespace dtrain

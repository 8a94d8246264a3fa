#pragma once
// The decoder-only language model GPT-2 (models/gpt.cpp) and the Llama family (models/llama.cpp)
// both are: the token embedding (GPT-2's with learned positions), a stack of pre-norm decoder
// blocks (nn/decoder_block.h), one ParamStore unit each (ZeRO-3, recompute), the final norm and
// the LM head (the embedding when tied). It runs pipeline stages (GptSpec::pp_*), tensor,
// sequence and vocabulary parallelism, and incremental decoding with a K/V cache per layer. A
// family declares its parameters and layers in its constructor, in its checkpoint's order
// (vocab_desc, add_blocks, norm_), and says in the hooks what else a forward needs.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "models/gpt.h"
#include "nn/decoder_block.h"
#include "nn/vocab_parallel.h"

namespace dtrain {

template <class Interface>  // GptModel, or an interface derived from it (LlamaModel)
class DecoderLm : public Interface {
 public:
  const GptSpec& spec() const override { return s_; }
  Tensor forward(Ctx& ctx, const Tensor& ids) override;
  void backward(Ctx& ctx, const Tensor& dout) override;
  Tensor input_grad() const override { return dx_in_; }
  void decode_begin(Backend& be, int64_t batch) override;
  Tensor decode_step(Ctx& ctx, const Tensor& ids, int64_t pos) override;
  void set_positions(const Tensor& positions, bool documents = false) override {
    next_positions_ = positions;
    next_documents_ = documents;
  }
  MoeStats* moe_stats() override { return moe_stats_.get(); }

 protected:
  // What the messages call the model and the model.* key of its context length ("gpt",
  // "block_size"; "llama", "max_position_embeddings").
  struct Names {
    const char* model;
    const char* length_key;
  };
  // cache_heads, head_dim: a layer's K/V cache [batch, cache_heads, block_size, head_dim]
  DecoderLm(const GptSpec& spec, ParamStore& ps, Names names, int64_t cache_heads, int64_t head_dim);

  // The vocabulary's rows held here [gpt_local_vocab, n_embd] (PadRows; under tensor parallelism
  // the rank's rows of the padded vocabulary), Normal(0, std) from init stream `stream`.
  ParamDesc vocab_desc(const std::string& name, float std, int64_t stream) const;
  // make(ps, name, layer): block `layer` of the full model (-1: a probe counting the parameters of
  // the largest block, a mixture of experts' when the model has one)
  using MakeBlock = std::function<std::unique_ptr<DecoderBlock>(ParamStore&, const std::string&, int)>;
  // The stage's blocks, named prefix + index, one unit each; the full model's block i takes its
  // initial values from the init streams that start at first_stream + i * (the largest block's
  // parameter count). Returns the init stream after the full model's blocks.
  int64_t add_blocks(const std::string& prefix, int64_t first_stream, const MakeBlock& make);

  // Before the blocks of a forward (positions_ holds the forward's positions, undefined for
  // 0..T-1), and before a decode step (Llama: the rotary tables).
  virtual void before_forward(Backend& be) {}
  virtual void before_decode(Backend& be) {}

  bool tp() const { return s_.tp_size > 1; }
  bool sp() const { return s_.tp_size > 1 && s_.sequence_parallel; }

  GptSpec s_;
  ParamStore& ps_;
  int vl_ = 0;                    // vocabulary rows held here (gpt_local_vocab)
  int embed_ = -1;                // the token embedding
  int pos_ = -1;                  // the learned position embedding, if any (GPT-2's wpe)
  int head_ = -1;                 // the LM head: embed_ when tied
  std::unique_ptr<Module> norm_;  // the final norm (a stage with the head)
  Tensor positions_;              // this forward's positions (set_positions), for its backward
  std::unique_ptr<MoeStats> moe_stats_;  // a mixture of experts' (spec.moe.enabled())

 private:
  Tensor forward_from(Ctx& ctx, const Tensor& x);
  Tensor forward_blocks(Ctx& ctx, Tensor x, int64_t B, int64_t T);
  void check_len(int64_t B, int64_t T) const;
  // The positions set for this forward, checked against [B,T]: into positions_ and, with
  // documents, the blocks' attention.
  void take_positions(int64_t B, int64_t T);

  Names names_;
  int64_t cache_heads_, head_dim_;
  VpEmbeddingSaved emb_;  // tensor parallel: the embedding's forward, for its backward
  std::vector<std::unique_ptr<DecoderBlock>> blocks_;
  std::vector<int> units_;        // ParamStore unit of each block
  std::vector<Tensor> block_in_;  // each block's input in the training forward
  Tensor ids_, h_;
  Tensor next_positions_;  // set_positions' tensor, for the next forward
  bool next_documents_ = false;
  Tensor dx_in_;  // a stage without the embedding: its input's gradient
  int64_t B_ = 0, T_ = 0;
  std::vector<Buffer> cache_;  // per layer: K then V, each cache_shape_ in the compute dtype
  Shape cache_shape_;
};

}  // namespace dtrain

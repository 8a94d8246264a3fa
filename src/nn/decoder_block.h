#pragma once
// The pre-norm decoder block GPT-2 (nn/transformer.h: Block) and the Llama family
// (nn/llama_layers.h: LlamaBlock) share: h = x + attn(norm_1(x)); y = h + mlp(norm_2(h)). The
// residual add h is made by norm_2's kernel (forward_add), and the backward sums the residual
// stream's gradient in place through the norms' backward_into. A family supplies its norm,
// attention and MLP, declared in its own parameter order.
#include "nn/module.h"

namespace dtrain {

// A norm over the last axis that takes the residual add into its kernel (GPT-2's LayerNorm, the
// Llama family's RMSNorm): forward_add makes h = a + b (returned in h) and normalises it;
// backward_into sums its input gradient into the residual stream's. Both have the weight
// [channels] (ones, no weight decay, read in f32; tp_partial: sequence parallelism, the rank
// normalises its rows only) and keep the input and its rows' 1/std for the backward.
class ResidualNorm : public Module {
 public:
  virtual Tensor forward_add(Ctx& ctx, const Tensor& a, const Tensor& b, Tensor& h) = 0;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  // the residual stream's sum in the kernel (the backward with accumulate_dx)
  Tensor backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc) override;

 protected:
  ResidualNorm(ParamStore& ps, const std::string& name, int channels, float eps, bool tp_partial);
  // The weight's description (the bias of a LayerNorm starts from it).
  static ParamDesc weight_desc(const std::string& name, int channels, bool tp_partial);
  // y like x, then (when asked) the rows' means and their 1/std rstd_ (f32) for input x.
  Tensor alloc_outputs(Ctx& ctx, const Tensor& x, Tensor* mean = nullptr);
  // forward_add's h = a + b (allocated here), then alloc_outputs for it.
  Tensor alloc_add_outputs(Ctx& ctx, const Tensor& a, const Tensor& b, Tensor& h, Tensor* mean = nullptr);
  // The backend's backward from the saved input into dx (summed into it with accumulate_dx) and
  // the parameter gradients; releases the input.
  virtual void backward_to(Ctx& ctx, const Tensor& dy, Tensor& dx, bool accumulate_dx) = 0;

  ParamStore& ps_;
  std::string name_;
  int c_;
  float eps_;
  int w_;
  Tensor x_, rstd_;
};

// Causal self-attention over x [B,T,C] (sequence parallel: the rank's block of the [B*T, C]
// rows; set_seq_len(T) before each forward says how the gathered rows form sequences), and
// incremental decoding: one new position x [B,1,C] at `pos` attending over the layer's K/V cache
// (its key and value stored there first). set_documents(doc_pos) before a forward packs
// documents into the rows: doc_pos i32 [B,T] is each token's position in its document, and a
// token attends within its document only (Backend::attention_fwd); undefined: one sequence per
// row. It holds for that forward, its recompute and its backward.
class DecoderAttention : public Module {
 public:
  virtual void set_seq_len(int64_t t) = 0;
  void set_documents(const Tensor& doc_pos) { doc_pos_ = doc_pos; }
  virtual Tensor decode(Ctx& ctx, const Tensor& x, Tensor& kcache, Tensor& vcache, int64_t pos) = 0;

 protected:
  Tensor doc_pos_;
};

// backward sums the residual stream's gradient into dy and returns it (an exception to the
// Module rule, like ReLU's inplace: the caller must not read dy afterwards; the decoder models
// pass each block the gradient the block after it returned, which nothing else reads).
class DecoderBlock : public Module {
 public:
  DecoderBlock(const DecoderBlock&) = delete;
  DecoderBlock& operator=(const DecoderBlock&) = delete;
  void set_seq_len(int64_t t) { attn_->set_seq_len(t); }
  void set_documents(const Tensor& doc_pos) { attn_->set_documents(doc_pos); }
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  // Inference only: forward of one new position x [B,1,C] with the layer's K/V cache.
  Tensor decode(Ctx& ctx, const Tensor& x, Tensor& kcache, Tensor& vcache, int64_t pos);

 protected:
  DecoderBlock() = default;
  // The derived block's layers: its members, which it constructs in its parameter order.
  void set_layers(ResidualNorm& norm_1, DecoderAttention& attn, ResidualNorm& norm_2, Module& mlp);

 private:
  ResidualNorm* norm_1_ = nullptr;
  DecoderAttention* attn_ = nullptr;
  ResidualNorm* norm_2_ = nullptr;
  Module* mlp_ = nullptr;
};

}  // namespace dtrain

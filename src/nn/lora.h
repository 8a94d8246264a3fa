#pragma once
// LoRA (Hu et al. 2021) as Hugging Face PEFT's LoraLayer builds it on an nn.Linear or GPT-2's
// Conv1D: y = base(x) + (alpha / r) * lora_B(lora_A(x)), lora_A [r, in] (kaiming-uniform with
// a = sqrt(5), that is U(-1/sqrt(in), 1/sqrt(in)) as nn.Linear), lora_B [out, r] (zeros), so
// training starts from the base model's outputs.
//
// The base model's parameters live in a frozen ParamStore (ParamStore::set_frozen: no gradient
// buffer, no optimizer, never sharded) whose lora() names the trainable store the adapters are
// declared into, under PEFT's names (`base_model.model.<module>.lora_A.weight`); that store is
// what the optimizer, data parallelism, ZeRO and checkpoints see. A layer of the frozen store
// whose module name ends in one of LoraOptions::targets (PEFT's target_modules: "q_proj" takes
// every `....q_proj`) owns a LoraAdapter.
//
// Tensor parallelism (Megatron / NeMo's LoRA): a column-parallel layer's lora_A is replicated
// (its gradient partial: each rank's output columns contribute, ParamDesc::tp_partial) and its
// lora_B cut by output rows like the base weight; a row-parallel layer's lora_A is cut by input
// columns like the base weight and its lora_B replicated, the rank's partial x A^T summed over
// the group in the forward (an all-reduce of [tokens, r]). Not with sequence parallelism.
#include <string>
#include <vector>

#include "nn/module.h"

namespace dtrain {

struct LoraOptions {
  ParamStore* adapters = nullptr;  // the trainable store
  int rank = 8;
  float alpha = 16.f;
  std::vector<std::string> targets;  // module names (the last part of a module path)
  float scaling() const { return alpha / float(rank); }
  // Does the module at `path` (e.g. "model.layers.0.self_attn.q_proj") get an adapter?
  bool targets_module(const std::string& path) const;
};

// PEFT's prefix of an adapter's tensors: PeftModelForCausalLM.base_model (LoraModel).model.
inline constexpr const char* kLoraPrefix = "base_model.model.";
// "base_model.model.<module>.lora_A.weight" / lora_B
std::string lora_param_name(const std::string& module, bool b);

// How the adapter's layer is cut over a tensor-parallel group.
struct LoraCut {
  enum class Kind { None, Column, Row };
  Kind kind = Kind::None;
  int tp_size = 1;
  int tp_blocks = 1;          // the base weight's blocks along the cut axis (c_attn's q, k, v)
  bool replicated = false;    // Column: the layer's part is whole on every rank (Llama's replicated k/v)
};

class LoraAdapter {
 public:
  // in, out: the layer's local features (this rank's part under tensor parallelism)
  LoraAdapter(const LoraOptions& o, const std::string& module, int in, int out, const LoraCut& cut = {});
  // y2 [m, out] += scaling * (x2 [m, in] A^T) B^T. Row-parallel: call it after the base output's
  // sum over the group (the adapter sums its own x A^T). Keeps what the backward needs (the
  // selective recompute's kept arena when set).
  void forward(Ctx& ctx, const Tensor& x2, Tensor& y2);
  // From dy2 [m, out] and the forward's x2: dB += dy^T z, dA += du^T x with du = scaling dy B,
  // and dx2 [m, in] += du A (dx2 in dy's dtype).
  void backward(Ctx& ctx, const Tensor& dy2, const Tensor& x2, Tensor& dx2);
  int a_id() const { return a_; }
  int b_id() const { return b_; }

 private:
  ParamStore& ps_;
  std::string name_;
  int in_, out_, r_;
  float s_;
  LoraCut cut_;
  int a_ = -1, b_ = -1;
  Tensor z_;  // scaling * x A^T [m, r], from the forward
};

// Columns [off, off + part.dim(-1)) of y2 [m, N] += part [m, n] (the parts of a stacked layer's
// output), through a full-width tensor: parts[i] (or undefined: zeros) side by side.
Tensor lora_concat_parts(Ctx& ctx, const std::vector<Tensor>& parts, const std::vector<int>& widths, int64_t m,
                         DType dt);
// The inverse: dy2 [m, N] cut into the parts of widths (an undefined wanted[i]: skipped).
std::vector<Tensor> lora_split_parts(Ctx& ctx, const Tensor& dy2, const std::vector<int>& widths,
                                     const std::vector<bool>& wanted);

}  // namespace dtrain

#pragma once
// Several nn.Linear layers over one input, run as one GEMM: Llama's q_proj | k_proj | v_proj and
// gate_proj | up_proj. Each part keeps its own parameters under its own PyTorch path
// (`<prefix>.<part>.weight` [out_i, in], `.bias` [out_i]), so checkpoints hold Hugging Face's
// tensors; the parts' weights are declared back to back, then their biases, so the flat buffers
// hold the stacked weight [sum out_i, in] (and the stacked bias) as one contiguous tensor: in the
// master, compute and gradient buffers, in every ZeRO-3 unit window (the parts are in one unit)
// and in every tensor-parallel part (the parts are consecutive there too). The output
// y [..., sum out_i] is the parts' outputs side by side per row.
//
// Tensor parallelism: column-parallel only (each part's rows cut over the group, in tp_blocks
// equal blocks each cut in tp_size: out_i is the rank's share; or a part replicated on every
// rank, its gradient partial: ParamDesc::tp_partial); the backward sums the input gradient over
// the group (or, with `sequence`, gathers the input rows in the forward and reduce-scatters the
// input gradient).
// Selective recompute keeps the GEMM's output as Linear does. LoRA adapters are per part (PEFT
// targets q_proj, not the stacked GEMM): their outputs go into the parts' columns.
#include <memory>
#include <string>
#include <vector>

#include "nn/lora.h"
#include "nn/module.h"

namespace dtrain {

struct StackedPart {
  std::string name;  // the part's module name under the prefix ("q_proj")
  int out = 0;       // its output features (this rank's share under tensor parallelism)
  int tp_blocks = 1;        // tensor parallel: the blocks each cut over the ranks
  bool replicated = false;  // tensor parallel: whole on every rank, the gradient summed over them
};

class StackedLinear : public Module {
 public:
  // Weights Normal(0, std) (Hugging Face's Llama init), biases (when `bias`) zero.
  StackedLinear(ParamStore& ps, const std::string& prefix, int in_features, std::vector<StackedPart> parts,
                bool bias, float std, int tp_size = 1, bool sequence = false);
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  int out_features() const { return out_; }
  // parameter ids of part i (bias -1 without biases)
  int weight_id(size_t i) const { return w_.at(i); }
  int bias_id(size_t i) const { return b_.empty() ? -1 : b_.at(i); }

 private:
  // The parts' tensors (ids) as one: f32 master, compute copy or gradient.
  enum class Buf { Compute, Grad };
  Tensor stacked(const std::vector<int>& ids, Buf which) const;
  void lora_forward(Ctx& ctx, const Tensor& x2, Tensor& y2);  // the parts' adapters into y2

  ParamStore& ps_;
  std::string name_;
  int in_, out_ = 0;
  bool cut_ = false, seq_ = false;
  std::vector<int> w_, b_;
  // LoRA (nn/lora.h): part i's adapter when the store's LoRA targets it (else null)
  std::vector<std::shared_ptr<LoraAdapter>> lora_;
  std::vector<int> widths_;  // the parts' output features
  Tensor x_;
  Tensor y_kept_;  // Recompute::Selective: the first forward's output
};

}  // namespace dtrain

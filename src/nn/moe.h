#pragma once
// Mixture-of-experts MLP (Switch / Mixtral / Qwen2-MoE): a router picks each token's top-k experts,
// the token's output is the routed experts' outputs weighted by their gate values. As transformers
// 4.46's MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock:
//   logits = gate(x) (nn.Linear [E, C], no bias); probs = softmax(logits) in f32; the k largest,
//   their weights = probs (divided by their sum when norm_topk_prob); y = sum_j w_j expert_{s_j}(x)
//   (+ shared_expert(x) * sigmoid(shared_expert_gate(x)) with Qwen2-MoE's shared expert).
// Dispatch is dropless by default: tokens are grouped by expert (Backend::moe_route_fwd's plan)
// and each expert runs its own GEMMs over its rows (a loop over the experts; the CPU's is the
// reference). With a capacity factor each expert takes at most ceil(factor * N k / E) of its
// slots, in token order; the others are dropped (counted) and only the residual carries them.
// The routing statistics of every MoE layer of a micro-batch go to the model's MoeStats, which
// makes the load-balancing loss (transformers' load_balancing_loss_func over the layers'
// concatenated router logits) and the router z-loss (ST-MoE) and their gradients.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "nn/module.h"

namespace dtrain {

// The model's MoE switches, named as the recipe (and Hugging Face's configs) name them.
struct MoeConfig {
  int num_experts = 0;             // num_local_experts; 0: dense MLPs (no MoE)
  int top_k = 2;                   // num_experts_per_tok
  int every = 1;                   // moe_every: layer i is MoE when (i + 1) % every == 0 (Qwen2-MoE's
                                   // decoder_sparse_step)
  int expert_intermediate = 0;     // moe_intermediate_size; 0: the dense MLP's width
  int shared_intermediate = 0;     // shared_expert_intermediate_size; 0: no shared expert
  bool norm_topk = true;           // norm_topk_prob (Mixtral: always)
  double aux_loss_coef = 0.001;    // router_aux_loss_coef
  double z_loss_coef = 0.0;        // router_z_loss_coef
  double capacity_factor = 0.0;    // 0: dropless
  bool enabled() const { return num_experts > 0; }
  bool layer_is_moe(int layer) const { return enabled() && (layer + 1) % every == 0; }
  int moe_layers(int n_layer) const;
};

// The routing statistics of a model's MoE layers: per micro-batch (the auxiliary losses and
// their gradients) and per logged step (the metrics).
class MoeStats {
 public:
  MoeStats(const MoeConfig& c, int moe_layers);
  // A micro-batch's forward starts: its sums restart.
  void begin_micro();
  // A layer's training forward (not a recompute's replay): the slots routed to each expert
  // (counts [E]), the column sums of its router probabilities and the sum of lse^2 (stats [E+1]),
  // its tokens, and the slots it dropped.
  void add_layer(const int32_t* counts, const float* stats, int64_t tokens, int64_t dropped);
  // After the micro-batch's forward: its auxiliary loss terms, router_aux_loss_coef * aux +
  // router_z_loss_coef * z (what transformers adds to the loss), and the gradient coefficients the
  // layers' backward uses, for `grad_scale` (the weight of this micro-batch's mean loss in the
  // step's loss, times the fp16 loss scale).
  double finish_micro(float grad_scale);
  // For a layer's backward: d loss / d probs[n, e] from the load-balancing loss (f32 [E]) and the
  // z-loss' factor (d loss / d logits = zscale * 2 lse probs).
  const std::vector<float>& paux() const { return paux_; }
  float zscale() const { return zscale_; }
  int experts() const { return e_; }

  // ---- the step's metrics (since the last take_step) ----
  struct Step {
    std::vector<int64_t> tokens_per_expert;  // slots routed to each expert, over layers and micro-batches
    int64_t dropped = 0;                     // slots dropped by the capacity factor
    double aux_loss = 0;                     // load-balancing loss (without its coefficient), mean over micro-batches
    double z_loss = 0;                       // router z-loss (without its coefficient), mean
    int64_t micro_batches = 0;
  };
  Step take_step();

 private:
  int e_, layers_;
  double aux_coef_, z_coef_;
  std::vector<double> count_, psum_;  // the micro-batch's sums over its layers
  double zsum_ = 0;
  int64_t tokens_ = 0;  // the layers' tokens summed (L N)
  std::vector<float> paux_;
  float zscale_ = 0;
  Step step_;
};

// The MoE MLP replacing a decoder block's MLP. `make_expert(ps, name)` builds one expert (the
// family's MLP: Mixtral's SwiGLU w1/w3/w2, Qwen2-MoE's gate/up/down_proj, GPT-2's c_fc/c_proj)
// under name; experts are named `<name>.experts.<e>`, the router `<name>.gate`, the shared expert
// `<name>.shared_expert` and its gate `<name>.shared_expert_gate` (Qwen2-MoE's).
class MoeMlp : public Module {
 public:
  using MakeExpert = std::function<std::unique_ptr<Module>(ParamStore&, const std::string& name)>;
  // make_shared: the shared expert (when c.shared_intermediate > 0)
  MoeMlp(ParamStore& ps, const std::string& name, int hidden, const MoeConfig& c, float init_std, MoeStats* stats,
         const MakeExpert& make_expert, const MakeExpert& make_shared = nullptr);
  // x [..., C] -> [..., C]
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  ParamStore& ps_;
  std::string name_;
  int c_, e_, k_;
  MoeConfig cfg_;
  MoeStats* stats_;
  Linear gate_;
  std::vector<std::unique_ptr<Module>> experts_;
  std::vector<std::pair<int, int>> expert_params_;  // each expert's parameter ids [first, end)
  std::unique_ptr<Module> shared_;
  std::unique_ptr<Linear> shared_gate_;
  // kept for the backward
  Shape in_shape_;
  Tensor probs_, lse_, sel_, weights_, pos_, ye_;
  Tensor shared_y_, shared_g_;  // the shared expert's output and its gate's sigmoid
  std::vector<int64_t> offset_, kept_;  // each expert's rows in the grouped order, and how many it computed
};

}  // namespace dtrain

#pragma once
// The Module contract (explicit forward/backward, as in Caffe and llm.c).
//
//  * forward(ctx, x) returns y and keeps what backward needs. Tensors it allocates come
//    from ctx.arena and stay valid until arena.reset() after the step. The caller keeps
//    x alive (and unmodified) until backward has run.
//  * backward(ctx, dy) ACCUMULATES parameter grads into the flat grad buffer (the trainer
//    zeroes grads once per optimizer step, so micro-batches add up) and returns dx,
//    freshly allocated from the arena (or a view of dy for pure reshapes). backward never
//    writes into dy (a residual block hands the same dy to two branches), except a
//    module explicitly built in-place (ReLU(true)).
//  * Parameters are declared at construction into a ParamStore under a PyTorch module
//    path; a module reads its tensors from the store at run time (after finalize).
//  * One forward is followed by at most one backward (a module keeps one set of saved
//    tensors).
//  * backward_into(ctx, dy, acc) is backward that ADDS dx into acc (x's shape and dtype)
//    and returns acc: where two branches meet (a residual shortcut, a U-Net skip) the
//    last op of one branch sums in place (convolution and max pooling do; others run
//    backward and an add). On the CPU the result equals backward then add, bit for bit.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"
#include "nn/params.h"
#include "nn/tp.h"

namespace dtrain {

// What happens around a unit (ParamStore::begin_unit: a transformer block, a ResNet stage,
// a U-Net level) in a pass: ZeRO-3 gathers its parameters before and frees them after, and
// reduce-scatters its gradients after its backward (parallel/zero3.h). Models call
// Ctx::unit_begin / unit_end around each unit; nothing happens when Ctx::units is null.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(int unit) = 0;
  virtual void after_forward(int unit) = 0;
  virtual void before_backward(int unit) = 0;
  virtual void after_backward(int unit) = 0;
};

// Activation recomputation per unit (train.recompute; DESIGN: Megatron's full and selective):
//  * None: every activation stays until its backward;
//  * Block: a unit keeps only its input; its forward runs in the scratch arena (dropped),
//    and again just before its backward;
//  * Selective: as Block, but the outputs of GEMMs and convolutions (Linear, Conv2d) are
//    kept from the first forward, so the second recomputes only the element-wise,
//    normalisation and attention ops between them.
// The recomputed values equal the first ones bit for bit: a replay runs the same kernels on
// the same inputs, and under Selective the MLP's GELU is computed from the kept, rounded
// pre-activation in the first forward too (not in CUDA's fused GEMM epilogue, which takes the
// GELU of the unrounded product). So on the CPU every policy gives the losses of None bit for
// bit; on CUDA in 16 bits Selective differs from None by that rounding (<= 1 ulp of the MLP's
// activations), while each policy's gradients are those of the forward it computed.
enum class Recompute { None, Block, Selective };

struct Ctx {
  Backend& be;
  Arena& arena;
  bool training = true;
  // Called by backward right after a parameter's gradient has been accumulated (enqueued
  // on the backend's stream), with the ParamStore id; ps.params()[id].offset/shape give
  // its flat range. Lets data parallelism all-reduce ready buckets during backward.
  std::function<void(int param_id)> grad_ready;
  // Synchronised batch norm (model.sync_bn): sums a small f32 tensor on this backend over
  // all data-parallel ranks, in place. Null: batch statistics stay per rank.
  std::function<void(Tensor& t)> sync_sum;
  UnitHooks* units = nullptr;
  // tensor parallelism (parallel.tensor > 1): this rank's group; null otherwise
  TensorParallelOps* tp = nullptr;
  // recomputation (training only): the policy and the arena a unit's dropped activations use
  Recompute recompute = Recompute::None;
  Arena* scratch = nullptr;
  // set inside a recomputing unit: `keep` is where Linear/Conv2d outputs go under Selective
  // (the step's arena; null otherwise), `replaying` marks the second forward (batch norm
  // leaves its running statistics; Linear/Conv2d return their kept outputs)
  Arena* keep = nullptr;
  bool replaying = false;
  // The unit's forward (ZeRO-3 hooks around it) under the recompute policy. `fwd` must
  // compute the same thing when called again (its inputs stay valid until the backward).
  Tensor unit_forward(int unit, const std::function<Tensor(Ctx&)>& fwd);
  // The unit's backward: hooks, the forward again when the policy dropped its activations,
  // then `bwd`. Returns bwd's result (copied into this arena when recomputed).
  Tensor unit_backward(int unit, const std::function<Tensor(Ctx&)>& fwd, const std::function<Tensor(Ctx&)>& bwd);
  // where a GEMM/convolution output goes: the kept arena under Selective, else `arena`
  Arena& output_arena() { return keep ? *keep : arena; }
  void notify_grad(int param_id) {
    if (grad_ready && param_id >= 0) grad_ready(param_id);
  }
  void unit_begin(int unit, bool backward) {
    if (units) backward ? units->before_backward(unit) : units->before_forward(unit);
  }
  void unit_end(int unit, bool backward) {
    if (units) backward ? units->after_backward(unit) : units->after_forward(unit);
  }
};

class Module {
 public:
  virtual ~Module() = default;
  virtual Tensor forward(Ctx& ctx, const Tensor& x) = 0;
  virtual Tensor backward(Ctx& ctx, const Tensor& dy) = 0;
  virtual Tensor backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc);
  // forward of x = cat(a, b) along the last axis (channels), and its backward writing the
  // two slices of dx into da and db (given, a's and b's shapes). The default concatenates
  // and splits; a convolution on a backend with Op::Conv2dCat never builds the concatenation.
  virtual Tensor forward_cat(Ctx& ctx, const Tensor& a, const Tensor& b);
  virtual void backward_cat(Ctx& ctx, const Tensor& dy, Tensor& da, Tensor& db);
};

// "prefix.name", or "name" when prefix is empty.
inline std::string join_name(const std::string& prefix, const std::string& name) {
  if (prefix.empty()) return name;
  std::string s;  // append, not operator+: avoids GCC 12's false -Wrestrict (PR105329)
  s.reserve(prefix.size() + 1 + name.size());
  s.append(prefix).append(1, '.').append(name);
  return s;
}

class Sequential : public Module {
 public:
  Sequential() = default;
  template <typename M, typename... Args>
  M& add(Args&&... args) {
    auto m = std::make_unique<M>(std::forward<Args>(args)...);
    M& ref = *m;
    mods_.push_back(std::move(m));
    return ref;
  }
  void push(std::unique_ptr<Module> m) { mods_.push_back(std::move(m)); }
  size_t size() const { return mods_.size(); }
  Module& at(size_t i) { return *mods_.at(i); }

  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  Tensor backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc) override;
  // the first module takes the concatenation
  Tensor forward_cat(Ctx& ctx, const Tensor& a, const Tensor& b) override;
  void backward_cat(Ctx& ctx, const Tensor& dy, Tensor& da, Tensor& db) override;

 private:
  std::vector<std::unique_ptr<Module>> mods_;
};

// A parameter-free NHWC layer over one backend op pair: forward y = fwd(x) into a tensor of
// out_shape(x.shape) (x must be 4-D), backward dx = bwd(dy) into a tensor of x's shape.
class NhwcOpModule : public Module {
 public:
  using BackendOp = void (Backend::*)(const Tensor&, Tensor&);
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 protected:
  NhwcOpModule(const char* name, BackendOp fwd, BackendOp bwd)
      : name_(name), fwd_(fwd), bwd_(bwd) {}
  virtual Shape out_shape(const Shape& x) const = 0;

 private:
  const char* name_;  // for messages
  BackendOp fwd_, bwd_;
  Shape in_shape_;
};

}  // namespace dtrain

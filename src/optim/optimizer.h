#pragma once
// Optimizers over a ParamStore's flat buffers (params, grads f32; state f32 flat buffers
// of the same layout), calling Backend::sgd_step / adamw_step once per step with the
// store's segments (weight decay off for biases and norm weights unless
// decay_bias_and_norm).
//
// Sharding (ZeRO-1/2): an optimizer may own only the range [begin, end) of the flat buffer;
// its state then has end - begin elements and it updates only that range. With sharded
// parameters (ZeRO-3, ParamStore::set_sharding) it owns the store's shard buffers: its
// pieces are ParamStore::shard_pieces(), one per unit, and its state has the shard
// buffers' layout (padding included, never updated).
//
// Offload (parallel.offload = "optimizer", ZeRO-Offload; optim/offload.cpp): the f32 master
// copy of the owned elements, their gradients and the optimizer state live in host memory
// (Backend::alloc_host: pinned on CUDA) and the update runs there with the CPU backend's
// kernels (the same math as without offload, bit for bit). The owned elements are cut into
// chunks: chunk k+1's gradients are copied device->host while the host updates chunk k and
// chunk k-1's parameters go host->device (CUDA: copy streams; CPU: the copies are memcpy).
// The device then holds the parameters and gradients only.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/params.h"

namespace dtrain {

struct SgdConfig {
  float momentum = 0.9f, dampening = 0.f, weight_decay = 0.f;
  bool nesterov = false;
  bool decay_bias_and_norm = false;
};

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
  bool decay_bias_and_norm = false;
};

struct OffloadOptions {
  bool enabled = false;
  int64_t chunk_elems = int64_t(4) << 20;  // elements per pipelined chunk (parallel.offload_chunk_mb)
  int host_threads = 0;  // the host update's OpenMP team when the device is not the CPU (0 = every CPU)
};

class Optimizer {
 public:
  Optimizer(ParamStore& ps, bool decay_bias_and_norm, FlatRange range, const OffloadOptions& off = {});
  virtual ~Optimizer();
  // One update with learning rate lr; grads are multiplied by grad_scale first (clip
  // coefficient times 1/loss_scale, 1/accumulation, ...).
  virtual void step(float lr, float grad_scale) = 0;
  virtual std::string kind() const = 0;  // "sgd" | "adamw"

  int64_t steps() const { return steps_; }  // completed steps
  // Bytes of optimizer state this optimizer holds (its range of every state buffer), on the
  // device or (offloaded) on the host.
  int64_t state_bytes() const { return int64_t(states_.size()) * local_ * 4; }
  // ---- offload ----
  bool offloaded() const { return off_ != nullptr; }
  int64_t device_state_bytes() const { return off_ ? 0 : state_bytes(); }
  // Host bytes: the state, the f32 master copy and the gradient staging (0 without offload).
  int64_t host_bytes() const { return off_ ? state_bytes() + 2 * local_ * 4 : 0; }
  // Chunks of the pipelined update (0 without offload). The host master copy is read from
  // the device parameters at the first update (after any import or resume) and is the truth
  // from then on: nothing but step() may change the owned parameters after that.
  int64_t offload_chunks() const;
  int64_t range_begin() const { return begin_; }
  int64_t range_end() const { return end_; }
  // The elements of the flat layout it owns: one piece [begin, end), or (ZeRO-3) a piece per unit.
  const std::vector<FlatPiece>& pieces() const { return pieces_; }
  int64_t owned() const;  // elements in pieces()

  // Checkpoint state: the state buffers as flat f32 tensors named "momentum" (SGD with
  // momentum) or "exp_avg", "exp_avg_sq" (AdamW), each of shape [owned()]: the pieces'
  // elements back to back, plus "step" as an I64 scalar.
  std::vector<ParamStore::Exported> export_state() const;
  // Validates names/dtypes/shapes (UserError naming origin and tensor) before loading.
  void import_state(const TensorLookup& lookup, const std::string& origin);

 protected:
  struct State { std::string name; Buffer buf; };
  void add_state(const std::string& name);  // zero-filled f32 [local_] (offloaded: on the host)
  Tensor state(size_t i) const;
  Tensor params() const;  // the owned range
  Tensor grads() const;
  // The update over params(), grads() and the state (segments relative to them): run on the
  // device, or (offloaded) chunk by chunk on the host (offload.cpp).
  using Update = std::function<void(Backend& be, Tensor& p, const Tensor& g, std::vector<Tensor>& state,
                                    const std::vector<ParamSegment>& segs)>;
  void run_update(const Update& u);
  struct Offload;  // offload.cpp
  void enable_offload(const OffloadOptions& o);  // constructor, before any state is added
  Allocator& host_allocator() const;
  void run_offloaded(const Update& u);
  void state_to_host(void* dst, const void* src, size_t bytes) const;
  void state_from_host(void* dst, const void* src, size_t bytes);

  ParamStore& ps_;
  Backend& be_;
  int64_t begin_, end_;
  std::vector<FlatPiece> pieces_;
  int64_t local_ = 0;               // elements of params(), grads() and each state buffer
  std::vector<ParamSegment> segs_;  // relative to params()
  std::unique_ptr<Offload> off_;    // before states_: their host memory comes from it
  std::vector<State> states_;
  int64_t steps_ = 0;
};

// An Optimizer with its configuration (the derived constructor checks it).
template <typename Config>
class ConfiguredOptimizer : public Optimizer {
 protected:
  ConfiguredOptimizer(ParamStore& ps, const Config& c, FlatRange range, const OffloadOptions& off)
      : Optimizer(ps, c.decay_bias_and_norm, range, off), c_(c) {}
  Config c_;
};

class Sgd : public ConfiguredOptimizer<SgdConfig> {
 public:
  Sgd(ParamStore& ps, const SgdConfig& c, FlatRange range = {}, const OffloadOptions& off = {});
  void step(float lr, float grad_scale) override;
  std::string kind() const override { return "sgd"; }
};

class AdamW : public ConfiguredOptimizer<AdamWConfig> {
 public:
  AdamW(ParamStore& ps, const AdamWConfig& c, FlatRange range = {}, const OffloadOptions& off = {});
  void step(float lr, float grad_scale) override;
  std::string kind() const override { return "adamw"; }
};

// torch.nn.utils.clip_grad_norm_: total_norm = ||flat_grads * grad_scale||_2,
// coef = min(1, max_norm / (total_norm + 1e-6)). Multiply the step's grad_scale by the
// returned coef. max_norm <= 0 disables clipping (coef 1, norm still reported).
float clip_coef(Backend& be, const Tensor& flat_grads, float max_norm, float* total_norm,
                float grad_scale = 1.f);
// Same from a norm computed elsewhere (e.g. sum of squares all-reduced over shards).
float clip_coef_from_norm(double total_norm, float max_norm);

}  // namespace dtrain

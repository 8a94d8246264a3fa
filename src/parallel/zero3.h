#pragma once
// ZeRO-3 / FSDP over the data-parallel group: parameters, gradients and optimizer state are
// sharded per unit (ParamStore::begin_unit: a transformer block, a ResNet stage, a U-Net
// level). Each rank stores shard_size(u) = ceil(numel(u) / world) elements of every unit
// (ParamStore::set_sharding); the optimizer updates only those (Optimizer over the shard
// buffers).
//
// In a pass over the model (the models call Ctx::unit_begin / unit_end around each unit):
//  * before a unit's forward, its full parameters are all-gathered into a window the
//    ParamStore resolves param(id) through (and cast to the compute dtype under mixed
//    precision); after it, the window is released (evictable: the backward reuses it if no
//    other unit took it, as FSDP's last unit is not resharded);
//  * the next unit's all-gather is launched as soon as the current one is in place
//    (forward and backward prefetch, on the communicator's thread/stream);
//  * before a unit's backward it is gathered again and gets a zeroed gradient window; after
//    it, the window is reduce-scattered (average over the group) asynchronously and added
//    into the rank's gradient shard once done (micro-batches accumulate there);
//  * root units (the parameters outside every unit: embeddings, stem, heads) are gathered
//    for the whole pass by begin_pass and reduce-scattered by end_pass.
// Windows: two parameter slots and two gradient slots of the largest unit, plus one of each
// per root unit, allocated once (the steady-state step allocates nothing).
//
// Hybrid sharding (parallel.shard_group_size, FSDP's HYBRID_SHARD / ZeRO++ hpZ): the
// communicator given is the rank's shard group (S consecutive ranks: the ParamStore is
// sharded over S), and `replicate` the ranks holding the same shards in the other groups.
// All-gathers and reduce-scatters stay within the shard group; each reduced gradient piece
// is then all-reduced (average) over the replicate group before it is added into the
// gradient shard, so the gradient is the average over every rank.
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "nn/module.h"
#include "nn/params.h"

namespace dtrain::parallel {

class Zero3 final : public UnitHooks {
 public:
  // `ps` must be sharded over comm.size() ranks with rank comm.rank() and finalized.
  // `replicate`: hybrid sharding's replicate group (null: `comm` is the whole data-parallel
  // group).
  Zero3(comm::Communicator& comm, ParamStore& ps, comm::Communicator* replicate = nullptr);
  ~Zero3() override;

  // Before a forward (training: a micro-batch's forward and backward; evaluation: forward
  // only): gathers the root units. Collective.
  void begin_pass(bool training);
  // After the backward (training) or the forward: reduce-scatters the root units' gradients,
  // waits for every outstanding reduce-scatter and releases every window. Collective.
  // Returns the seconds spent waiting.
  double end_pass();

  void before_forward(int unit) override;
  void after_forward(int unit) override;
  void before_backward(int unit) override;
  void after_backward(int unit) override;

  // Squared L2 norm of the whole reduced gradient times scale^2 (the shards' squares summed
  // over the shard group: the replicas hold the same shards). Collective.
  double grad_sq_norm(double scale);
  // Every parameter in the flat layout, on the host (for checkpoints). Collective.
  std::vector<float> gather_full();

  // Bytes this rank holds: its shards (parameters + gradients) and the windows.
  int64_t shard_bytes() const;
  int64_t window_bytes() const;
  // The ranks the parameters are sharded over, and how many copies of the shards there are.
  int shard_group_size() const { return world_; }
  int replicas() const { return replicate_ ? replicate_->size() : 1; }

 private:
  struct Slot {
    Buffer params, cparams, grads, reduced;  // params/grads [world * max shard], reduced [max shard]
    int unit = -1;                            // whose parameters it holds (or is gathering)
    bool attached = false, cast = false;
    std::shared_ptr<comm::Work> gather;       // pending all-gather into params
    int grad_unit = -1;                       // whose gradients `reduced` receives
    std::shared_ptr<comm::Work> scatter;      // pending reduce-scatter of grads
  };
  Slot make_slot(int64_t shard) const;
  Slot& slot_of(int unit);  // the root's own slot, or one of the two shared ones
  void launch_gather(Slot& s, int unit);
  void ready(Slot& s, int unit, bool with_grads);  // gathered, cast, attached
  void prefetch(int unit);
  void launch_scatter(Slot& s, int unit);  // the unit's gradient window, reduce-scattered
  void finish_scatter(Slot& s);  // waits (and averages over the replicas), adds into the gradient shard
  void sync_host();               // CPU: the backend's writes are done before Gloo reads
  int next_unit(int unit, int dir) const;  // the next non-root unit in pass order, or -1

  comm::Communicator& comm_;
  comm::Communicator* replicate_;  // hybrid sharding only
  ParamStore& ps_;
  Backend& be_;
  int world_;                     // the shard group's size
  int global_rank_ = 0;           // for the failpoint
  std::vector<Slot> shared_;      // 2 slots for non-root units
  std::vector<Slot> roots_;       // per unit id: a slot for root units, empty otherwise
  std::vector<int> root_ids_;
  bool training_ = false;
  int64_t passes_ = 0;            // training passes begun (failpoint zero3.kill_in_gather)
  int last_shared_ = 0;           // the shared slot used most recently
  Buffer norm_buf_;
};

}  // namespace dtrain::parallel

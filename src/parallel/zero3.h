#pragma once
// ZeRO-3 / FSDP over the data-parallel group: parameters, gradients and optimizer state are
// sharded per unit (ParamStore::begin_unit: a transformer block, a ResNet stage, a U-Net
// level). Each rank stores shard_size(u) = ceil(numel(u) / world) elements of every unit
// (ParamStore::set_sharding); the optimizer updates only those (Optimizer over the shard
// buffers).
//
// In a pass over the model (the models call Ctx::unit_begin / unit_end around each unit):
//  * before a unit's forward, its full parameters are all-gathered into a window the
//    ParamStore resolves param(id) through; after it, the window is released (evictable: the
//    backward reuses it if no other unit took it, as FSDP's last unit is not resharded).
//    Mixed precision (FSDP's MixedPrecision(param_dtype)): each rank casts its f32 shard to
//    the compute dtype BEFORE the all-gather, so the wire carries 16 bits (the bits a cast
//    of the gathered f32 would give: the cast is per element); the parameters layers read
//    in f32 (ParamDesc::read_f32: norm weights and biases) are all-gathered in f32 besides,
//    packed (each rank's pieces of them, padded to the largest rank's count);
//  * the next unit's all-gather is launched as soon as the current one is in place
//    (forward and backward prefetch, on the communicator's thread/stream);
//  * before a unit's backward it is gathered again and gets a zeroed gradient window; after
//    it, the window is reduce-scattered (average over the group) asynchronously and added
//    into the rank's gradient shard once done (micro-batches accumulate there). With
//    reduce_dtype bf16 (parallel.reduce_dtype, FSDP's reduce_dtype) the f32 window is cast
//    to bf16 and reduce-scattered in bf16 (comm/communicator.h's order), the result widened
//    to f32 before it is added;
//  * root units (the parameters outside every unit: embeddings, stem, heads) are gathered
//    for the whole pass by begin_pass and reduce-scattered by end_pass.
// Windows: two parameter slots and two gradient slots of the largest unit, plus one of each
// per root unit, allocated once (the steady-state step allocates nothing).
// Traffic: traffic() counts the bytes of the pass collectives' tensors (the gathered windows
// in their dtype, the reduce-scattered gradient windows); gather_full's (checkpoints) not.
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
  // `reduce_dtype`: F32 or BF16, the dtype the gradient windows are reduce-scattered in.
  Zero3(comm::Communicator& comm, ParamStore& ps, comm::Communicator* replicate = nullptr,
        DType reduce_dtype = DType::F32);
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
  DType reduce_dtype() const { return reduce_dtype_; }

  // Bytes of the collectives of the passes so far (see the header comment).
  struct Traffic {
    int64_t allgather = 0;      // every pass all-gather: the windows and the f32 packs
    int64_t allgather_f32 = 0;  // of which the packs of read_f32 parameters (mixed precision)
    int64_t reduce_scatter = 0;
  };
  const Traffic& traffic() const { return traffic_; }

  // A read_f32 run of a unit: `count` elements at `at` of the unit's window, its piece of a
  // rank's pack at `packed`.
  struct Run {
    int64_t at = 0, count = 0, packed = 0;
  };
  // [rank]: the read_f32 runs of unit u in each rank's piece.
  static std::vector<std::vector<Run>> f32_runs(const ParamStore& ps, int u, int world);

 private:
  struct Slot {
    Buffer params, cparams, grads, reduced;  // params/grads [world * max shard], reduced [max shard]
    Buffer grads16, reduced16;               // reduce_dtype bf16: the bf16 casts of grads, reduced
    Buffer pack;                             // mixed: [world * max pack] f32 of read_f32 parameters
    int unit = -1;                            // whose parameters it holds (or is gathering)
    bool attached = false;
    bool master = false;                      // params hold the f32 gather (gather_full)
    std::shared_ptr<comm::Work> gather;       // pending all-gather into params (mixed: cparams)
    std::shared_ptr<comm::Work> gather32;     // mixed: pending all-gather of the f32 pack
    int grad_unit = -1;                       // whose gradients `reduced` receives
    std::shared_ptr<comm::Work> scatter;      // pending reduce-scatter of grads
  };
  Slot make_slot(int64_t shard, int64_t pack) const;
  void wait_gather(Slot& s);  // both all-gathers; unpacks the f32 pack into params
  Slot& slot_of(int unit);  // the root's own slot, or one of the two shared ones
  void launch_gather(Slot& s, int unit, bool master = false);  // master: the f32 shard
  void ready(Slot& s, int unit, bool with_grads);  // gathered, cast, attached
  void prefetch(int unit);
  void launch_scatter(Slot& s, int unit);  // the unit's gradient window, reduce-scattered
  void finish_scatter(Slot& s);  // waits (and averages over the replicas), adds into the gradient shard
  int next_unit(int unit, int dir) const;  // the next non-root unit in pass order, or -1

  comm::Communicator& comm_;
  comm::Communicator* replicate_;  // hybrid sharding only
  ParamStore& ps_;
  Backend& be_;
  int world_;                     // the shard group's size
  DType reduce_dtype_;
  bool gather16_ = false;         // mixed precision: gather the compute-dtype cast
  std::vector<std::vector<std::vector<Run>>> runs_;  // [unit][rank]: read_f32 runs (gather16_)
  std::vector<int64_t> pack_;     // [unit]: the largest rank's read_f32 element count
  Traffic traffic_;
  int global_rank_ = 0;           // for the failpoint
  std::vector<Slot> shared_;      // 2 slots for non-root units
  std::vector<Slot> roots_;       // per unit id: a slot for root units, empty otherwise
  std::vector<int> root_ids_;
  bool training_ = false;
  int64_t passes_ = 0;            // training passes begun (failpoint zero3.kill_in_gather)
  int last_shared_ = 0;           // the shared slot used most recently
  Buffer norm_buf_;
};

// The f32 elements per rank that Zero3 all-gathers besides the 16-bit window for unit `u`
// sharded over `world` (mixed precision): the largest rank's count of read_f32 elements.
int64_t zero3_f32_pack(const ParamStore& ps, int u, int world);

}  // namespace dtrain::parallel

#pragma once
// The memory a rank of a training run will hold, predicted before it runs (`dtrain plan`).
//
// The model's state follows the code's allocation rules exactly (each rule names the code it
// mirrors in memory_plan.cpp): the flat parameter / gradient / 16-bit buffers of the
// ParamStore, the optimizer's state over its range (ZeRO-1/2: shard_range of rank 0, the
// largest), ZeroSharder's padded all-gather / reduce-scatter buffer, ZeRO-3's per-unit shards
// (ceil(numel / N) elements each) and Zero3's windows, DataParallel's flags, the loss slots and
// the staged input batch; every allocation rounded as the target device's allocator rounds it
// (what Backend::alloc_counts counts).
//
// Activations are measured, not modelled: the activation arena's high-water mark of one real
// forward + backward (and of one evaluation batch, forward only) at a small batch on the CPU
// (ActivationProfile, measured by plan/memory_probe.h), scaled linearly to the recipe's
// per-rank batch; the arena's blocks follow from the marks (arena_blocks). Under
// train.recompute a second arena, the scratch arena, holds the recomputed unit's activations.
//
// A plan has one row per layout: each parallel.zero stage (one row for a single process) times
// each activation variant (train.recompute's choices, when the recipe schema has the key).
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "nn/params.h"
#include "config/config.h"

namespace dtrain {

// How the target device's allocator rounds a request (CPU: 256-byte aligned blocks; CUDA:
// the caching allocator's 512 B / 2 MiB granularity). 0 stays 0 (a Buffer of 0 bytes
// allocates nothing).
enum class AllocRounding { Cpu, Cuda };
int64_t alloc_bytes(int64_t requested, AllocRounding r);

// An arena's blocks over a sequence of passes (core/buffer.h: a first block of 64 MiB, each
// further block as large as the last, and after a pass that needed more than one block, one
// block of the high-water mark so far rounded up to 1 MiB). `marks`: each pass's high-water
// mark (the training step, then an evaluation). Blocks are assumed to fill up completely (a
// tensor that does not fit a block's rest leaves it unused: up to one block more).
struct ArenaBlocks {
  std::vector<int64_t> peaks;  // per pass: the most the blocks held during it (allocator-rounded)
  int64_t steady = 0;          // what they hold after the last pass
  int64_t peak() const;        // over every pass
};
ArenaBlocks arena_blocks(const std::vector<int64_t>& marks, AllocRounding r);

// The state a rank holds (bytes, each allocation rounded), by kind.
struct StateBytes {
  int64_t params = 0;        // f32 master weights (ZeRO-3: the rank's unit shards)
  int64_t compute_copy = 0;  // the 16-bit copy under mixed precision (ZeRO-0/1/2)
  int64_t buffers = 0;       // non-trained state (BatchNorm running statistics)
  int64_t grads = 0;         // f32 gradients (ZeRO-3: the rank's shards)
  int64_t optimizer = 0;     // optimizer state over the rank's range (or shards)
  int64_t comm = 0;          // ZeRO-1/2: padded all-gather / reduce-scatter buffer and a shard;
                             // ZeRO-3: the all-gather / reduce-scatter windows
  int64_t small = 0;         // data-parallel flags, gradient-norm scalars, loss slots
  // parallel.offload = "optimizer": host memory (not in total()): the optimizer state (then
  // 0 above), the f32 master copy of the rank's range and its gradient staging
  int64_t host = 0;
  // lora.enabled: the frozen base model (its f32 weights and, under mixed precision, its 16-bit
  // copy; no gradients, no optimizer state, never sharded); `params` etc. are then the adapters'
  int64_t frozen = 0;
  int64_t total() const { return params + compute_copy + buffers + grads + optimizer + comm + small + frozen; }
};

// The state of rank 0 (the largest) for parallel.zero = `zero` over `world` ranks; world 1 is
// one process without data parallelism (parallel.zero has no effect there). `ps` holds the
// model's declared parameters and units (finalized or not, unsharded), `cfg` the recipe
// (precision.dtype, optim.*, train.grad_accum). ZeRO-3 shards over `shard_group` ranks
// (hybrid sharding, parallel.shard_group_size resolved; 0 = world).
StateBytes predict_state(const ParamStore& ps, const Config& cfg, int zero, int world, AllocRounding r,
                         int shard_group = 0);

// The elements of each ZeRO-3 window slot and of a rank's shard buffers (Zero3's
// constructor, ParamStore::set_sharding): shard(u) = ceil(numel(u) / world).
int64_t zero3_shard_elements(const ParamStore& ps, int world);
int64_t zero3_window_bytes(const ParamStore& ps, int world, DType compute, AllocRounding r,
                           DType reduce = DType::F32);

// One activation variant, measured at `batch` samples per rank on the CPU.
struct ActivationProfile {
  std::string recompute;           // train.recompute's value; "" when the schema has no such key
  int64_t batch = 1;               // the batch it was measured at
  int64_t train_high_water = 0;    // arena high-water mark of one forward + backward
  int64_t scratch_high_water = 0;  // the recompute scratch arena's (train.recompute != none)
  int64_t eval_high_water = 0;     // of one evaluation batch (eval.batch_size = batch); 0 = none
  int64_t input_bytes = 0, label_bytes = 0;  // the staged training batch (inputs, labels)
};

// A layout's predicted bytes per rank (and, with dtrain plan --measure, the measured peak).
struct PlanRow {
  int zero = 0;  // -1: one process (no data parallelism)
  int shard_group = 0;  // ZeRO-3: the ranks the parameters are sharded over (hybrid: < world)
  std::string recompute;
  StateBytes state;
  int64_t activations = 0;       // training step: the arenas' high water at the recipe's batch
  int64_t scratch_activations = 0;  // of which in the recompute scratch arena
  int64_t eval_activations = 0;  // evaluation pass at eval.batch_size (0: no evaluation data)
  int64_t arena = 0;             // the arenas' peak allocation: the step's arena and the scratch
                                 // arena during the first step, or during the evaluation after it
  int64_t arena_steady = 0;      // what they hold after those passes
  int64_t inputs = 0;            // staged training batch buffers
  int64_t total() const { return state.total() + arena + inputs; }
  int64_t measured = -1;         // Backend::alloc_counts().peak_bytes after one step and one
                                 // evaluation batch (dtrain plan --measure); -1 = not measured
};

struct MemoryPlan {
  std::string title;  // "" or what the plan is of ("LoRA", "full fine-tuning")
  std::string recipe, model, optimizer, precision, device;
  int world = 1;
  int64_t num_params = 0;
  int64_t frozen_params = 0;  // lora.enabled: the frozen model's parameters
  int units = 0, root_units = 0;
  int64_t batch = 0, grad_accum = 1, eval_batch = 0;
  std::vector<ActivationProfile> profiles;
  std::vector<PlanRow> rows;
};

// Rows for every zero stage (one for world 1) times every profile. `device` names the target
// ("cpu" | "cuda"), which also picks the rounding. parallel.shard_group_size applies to the
// ZeRO-3 rows (UserError when it does not divide `world`); the other stages' rows are
// without it (the trainer takes it with ZeRO-3 only).
// `frozen`: lora.enabled's frozen base model (Runtime::base), whose bytes every row adds; `ps` is
// then the adapters.
MemoryPlan make_memory_plan(const ParamStore& ps, const Config& cfg, int world, const std::string& device,
                            const std::vector<ActivationProfile>& profiles, const ParamStore* frozen = nullptr);

// The plan as a table (MiB per kind, total in MiB and bytes; measured peak and relative error
// where measured) with its footnotes, and as JSON (every quantity in bytes).
std::string memory_plan_table(const MemoryPlan& p);
nlohmann::json memory_plan_json(const MemoryPlan& p);

}  // namespace dtrain

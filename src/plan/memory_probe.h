#pragma once
// What `dtrain plan` runs to ground its memory predictions (plan/memory_plan.h):
//  * measure_activations: one real forward + backward (and one evaluation batch) at a small
//    batch on the CPU: the activation arena's high-water marks;
//  * measure_ranks: one real training step per rank, ranks as threads of this process over
//    Gloo on the CPU, with the backend's measured peak allocation.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "plan/memory_plan.h"
#include "session/runtime.h"

namespace dtrain {

// The recipe as it runs here, on the CPU (run.device = "cpu", train.cuda_graph = false).
Config cpu_recipe(const Config& cfg);

// train.recompute's choices (one row of a plan each).
std::vector<std::string> recompute_choices(const Config& cfg);

// On the CPU at `batch` samples per rank (train.batch_size = eval.batch_size = batch,
// grad_accum 1), train.recompute = `recompute` unless "": the arenas' high-water marks (the
// step's and the recompute scratch arena) of one real forward + backward on the recipe's first training batch, and of one evaluation batch
// when the recipe has evaluation data; the staged batch's sizes. Reads the recipe's data
// (synthetic data: made up).
ActivationProfile measure_activations(const Config& cfg, const std::string& recompute, int64_t batch = 1);

// One rank's measured allocation (Backend::alloc_counts().peak_bytes).
struct RankMemory {
  int64_t after_attach = 0;      // once the session and data parallelism exist: the model's state
  int64_t after_steps = 0;       // after the training steps (and the evaluation batch)
  int64_t arena_high_water = 0;  // the activation arena's high-water mark
  int64_t scratch_high_water = 0;  // the recompute scratch arena's (0 without train.recompute)
};

// `world` ranks as threads of this process (each its own CPU session, store client and Gloo
// communicator) with parallel.zero = `zero` train `steps` steps and then, when steps > 0,
// evaluate one batch where the trainer would (rank 0; under ZeRO-3 every rank); world 1 is one
// session without data parallelism. train.recompute = `recompute` unless "". Rank order.
std::vector<RankMemory> measure_ranks(const Config& cfg, int zero, int world, const std::string& recompute,
                                      int steps = 1);

}  // namespace dtrain

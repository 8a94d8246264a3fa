#pragma once
// Pipeline parallelism's schedules (parallel.pipeline = P, parallel.schedule,
// parallel.virtual_stages = V): pure functions of the shape that give each pipeline rank
// the ordered list of forward and backward passes it runs in one optimizer step, with no
// processes involved (tests check the orderings; train/pipeline.cpp executes them).
//
// The model's n_layer transformer blocks are cut into P*V consecutive pieces ("virtual
// stages"); virtual stage k = c*P + r is chunk c of pipeline rank r (V = 1: rank r holds
// stage r). The embedding sits on virtual stage 0, ln_f and the (tied) head on the last.
// A step runs the M = train.grad_accum micro-batches through them:
//  * GPipe (Huang et al. 2019): every forward, then every backward.
//  * 1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r runs min(P-r-1, M) warm-up
//    forwards, then alternates one forward and one backward, then drains the backwards; at
//    most P-r micro-batches are in flight on rank r.
//  * interleaved 1F1B (Megatron-LM, Narayanan et al. 2021; V > 1): as Megatron's
//    forward_backward_pipelining_with_interleaving: virtual micro-batch k of rank r is
//    micro-batch (k / (P*V))*P + k % P of chunk (k % (P*V)) / P (backwards: chunk V-1-that),
//    with (P-r-1)*2 + (V-1)*P warm-up forwards. Needs M divisible by P.
// Bubble (idle time over compute time, Narayanan et al.): (P-1)/M, interleaved (P-1)/(V*M).
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::parallel {

enum class PipeSchedule { OneFOneB, GPipe, Interleaved };

struct PipeAction {
  enum Kind { Forward, Backward };
  Kind kind = Forward;
  int micro = 0;  // micro-batch, 0..M-1
  int chunk = 0;  // model chunk of this rank, 0..V-1 (virtual stage chunk*P + rank)
  bool operator==(const PipeAction&) const = default;
};

// "1f1b" | "gpipe" -> the schedule (V > 1 with 1f1b: Interleaved). UserError naming
// parallel.schedule otherwise, or gpipe with V > 1.
PipeSchedule parse_pipe_schedule(const std::string& name, int virtual_stages);

// Rank `rank`'s actions in one step (P ranks, M micro-batches, V chunks per rank). Every
// (micro, chunk) appears once as a forward and once as a backward, the forward first.
// Checks its arguments (internal: RuntimeFault); the config checks are check_pipeline's.
std::vector<PipeAction> pipeline_actions(PipeSchedule kind, int P, int rank, int M, int V = 1);

// Theory: (P-1)/M, interleaved (P-1)/(V*M).
double pipeline_bubble_theory(PipeSchedule kind, int P, int M, int V = 1);

// The blocks of each of the S = P*V virtual stages: `given` when not empty (its sum must
// be n_layer, each entry >= 1, S entries: UserError naming parallel.stage_layers), else
// balanced by cost: every block costs 1, the embedding `embed_cost` blocks (on stage 0),
// ln_f + head + loss `head_cost` blocks (on the last), cut so the most expensive stage is
// as cheap as possible (each stage at least one block; UserError when n_layer < S).
std::vector<int> pipeline_stage_layers(int n_layer, int S, const std::vector<int64_t>& given, double embed_cost,
                                       double head_cost);

}  // namespace dtrain::parallel

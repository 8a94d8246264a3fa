#pragma once
// Pipeline parallelism's schedules (parallel.pipeline = P, parallel.schedule,
// parallel.virtual_stages = V): pure functions of the shape that give each pipeline rank
// the ordered list of forward and backward passes it runs in one optimizer step, with no
// processes involved (tests check the orderings; session/pipeline.cpp executes them).
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

// The forwards rank `rank` runs before its first backward (GPipe: all M).
int pipeline_warmup(PipeSchedule kind, int P, int rank, int M, int V = 1);

// The step's point-to-point plan under NCCL's rules (a communicator runs its operations in
// order; sends and receives pair up by their order between two ranks; a receive holds the
// stream until its send arrives). As Megatron's schedules: the warm-up forwards one by one,
// the steady state's forward and backward back to back, the drain's backwards one by one;
// before each such step one group posts the previous step's outputs (sends) with this step's
// inputs (receives), and a last group sends the last step's outputs. Every rank's groups,
// played by those rules, neither hang nor pair two different messages
// (tests/parallel/test_pipeline_schedule.cpp plays every schedule that way).
struct PipeMessage {
  enum Kind { Activations, Gradients };
  bool send = false;
  int peer = 0;  // pipeline rank
  Kind kind = Activations;
  int stage = 0;  // the virtual stage it goes into (activations: the next one; gradients: the previous one)
  int micro = 0;
  // The same words on both sides: "activations of micro-batch 2 for virtual stage 1".
  std::string what() const;
  bool operator==(const PipeMessage&) const = default;
};
struct PipeStep {
  std::vector<PipeMessage> group;  // posted together, before the actions
  std::vector<int> actions;        // indices into pipeline_actions(...); none in the last step
};
std::vector<PipeStep> pipeline_p2p_plan(PipeSchedule kind, int P, int rank, int M, int V = 1);

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

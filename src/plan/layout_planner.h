#pragma once
// `dtrain plan RECIPE --gpus N`: which 3D-parallel layouts of a GPT fit on N GPUs, and how
// fast each would train (docs/scaling.md, "Layout planner", states every equation).
//
// A layout is (dp, tp, pp, v, zero, recompute, mbs): data, tensor (Megatron, with sequence
// parallelism) and pipeline (1F1B, v interleaved chunks per stage) parallel sizes with
// dp * tp * pp = N, the ZeRO stage over the dp group, activation recompute (none | selective
// | full, Korthikanti et al. 2022) and the micro-batch size. Ranks are ordered tp fastest,
// then dp, then pp (Megatron-LM's order): a tp group sits inside a node, a dp group spans
// nodes once tp * dp > gpus_per_node, and pipeline neighbours then sit in different nodes.
//
// Memory per GPU (bytes): the state of the stage's parameters under ZeRO (bf16 weights,
// fp32 gradients, fp32 master + optimizer state), the activations of the micro-batches in
// flight on pipeline stage 0, the LM head's logits on the last stage, and a fixed reserve.
// Time per step: the GEMM, attention and memory-bound (elementwise) time of one micro-batch
// on one stage, its tensor-parallel all-reduces (alpha-beta, not overlapped), the pipeline
// bubble (P-1)/V micro-batch slots, point-to-point sends, the dp group's gradient reduction
// and parameter gathers (overlapped with backward as stated), and the optimizer step.
// Pure arithmetic: no devices, no processes.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtrain {
struct GptSpec;  // models/gpt.h
}

namespace dtrain::parallel {

// The model, as plain numbers (a GPT recipe's shape is made by cli/plan.cpp from GptSpec).
struct ModelShape {
  std::string name;
  int n_layer = 0, n_embd = 0, n_head = 0, kv_heads = 0;  // kv_heads: grouped-query attention (= n_head for GPT)
  int ffn_hidden = 0;     // MLP width (GPT: 4 * n_embd)
  int ffn_mats = 2;       // weight matrices in the MLP: 2 (GELU), 3 (SwiGLU)
  int64_t vocab = 0;      // rows of the embedding / LM head (padded)
  int seq = 0;            // tokens per sequence
  bool tied_head = true;  // LM head shares the token embedding (GPT-2); false: a separate matrix (Llama)
  int64_t layer_params = 0;  // trainable parameters of one transformer block
  int64_t embed_params = 0;  // token (+ learned position) embeddings
  int64_t head_params = 0;   // untied LM head (0 when tied), final norm
  int64_t params() const { return embed_params + head_params + n_layer * layer_params; }
};

// GPT-2 layout (learned positions, GELU MLP 4x, biases, tied head) with these sizes; the
// parameter count is models/gpt.h's gpt_param_count (padded vocabulary).
ModelShape gpt_shape(const std::string& name, int n_layer, int n_embd, int n_head, int seq, int vocab);
// Llama 3 8B (32 layers, 4096 wide, 32 heads, 8 KV heads, SwiGLU 14336, vocabulary 128256,
// untied head) at sequence length `seq`.
ModelShape llama3_8b_shape(int seq);
// The shape of a recipe's model (models/gpt.h's GptSpec, validated here): GPT-2 as gpt_shape; the
// Llama family (family "llama": Llama, Qwen2) with its key/value heads, SwiGLU width
// (intermediate_size), no position embedding, a tied or untied head, the biases and head_dim as
// its parameter count (llama_param_count, padded vocabulary) has them.
ModelShape model_shape(const std::string& name, const GptSpec& spec);

// Training FLOPs per token counted for MFU: 3 x models/gpt.h's transformer_forward_flops_per_token
// (6 N + 12 L d T, PaLM appendix B).
double model_flops_per_token(const ModelShape& m);

// One GPU kind. Sources of each number in layout_planner.cpp.
struct GpuSpec {
  std::string name;
  double peak_flops = 0;      // dense bf16 FLOP/s
  double hbm_bytes = 0;       // device memory
  double hbm_bytes_per_s = 0; // memory bandwidth
  double intra_bytes_per_s = 0, inter_bytes_per_s = 0;  // per-GPU bus bandwidth (busbw) in / across nodes
  double gemm_max_eff = 0;    // best achieved fraction of peak on large bf16 GEMMs
};
// h100 | h200 | a100 (80 GB) | a100-40gb | l40s; UserError naming --gpu otherwise.
GpuSpec gpu_spec(const std::string& name);
std::vector<std::string> gpu_names();

struct Cluster {
  GpuSpec gpu;
  int gpus = 0, gpus_per_node = 8;
  double intra_alpha_s = 5e-6, inter_alpha_s = 10e-6;
};

struct TrainShape {
  int64_t global_batch = 0;   // sequences per optimizer step
  int optimizer_states = 2;   // fp32 states per parameter besides the master copy (AdamW: 2)
  int max_mbs = 16;           // micro-batch sizes tried: 1, 2, 4, ... up to this
};

enum class Recompute { None, Selective, Full };
const char* recompute_name(Recompute r);

struct Layout {
  int dp = 1, tp = 1, pp = 1, v = 1, zero = 0;
  Recompute recompute = Recompute::None;
  int mbs = 1;
};

// Memory of one GPU (bytes): the larger of pipeline stage 0 and the last stage.
struct MemoryBreakdown {
  double weights = 0, grads = 0, optimizer = 0;  // bf16 weights, fp32 grads, fp32 master + states
  double zero_buffers = 0;  // ZeRO-3: two gathered layers' bf16 weights (prefetch)
  double activations = 0;   // in-flight micro-batches (+ the recomputed layer, + logits on the last stage)
  double reserve = 0;       // CUDA context, NCCL buffers, allocator fragmentation
  double total() const { return weights + grads + optimizer + zero_buffers + activations + reserve; }
};

struct StepTime {
  double compute = 0;     // M micro-batches on the slowest stage: GEMMs, attention, elementwise (recompute included)
  double tp_comm = 0;     // tensor-parallel all-reduces / reduce-scatters (not overlapped)
  double bubble = 0;      // (P-1)/V micro-batch slots of the slowest stage
  double p2p = 0;         // pipeline sends on the critical path
  double dp_comm = 0;     // gradient reduction + ZeRO gathers, before overlap
  double dp_exposed = 0;  // what the overlap leaves
  double optimizer = 0;   // the optimizer step over the rank's shard (memory-bound)
  double total() const { return compute + tp_comm + bubble + p2p + dp_exposed + optimizer; }
};

struct Evaluated {
  Layout layout;
  int micro_batches = 0;       // per optimizer step per pipeline (global_batch / (dp * mbs))
  MemoryBreakdown mem;
  StepTime time;
  double tokens_per_s_per_gpu = 0, mfu = 0;
  std::string reason;          // empty: feasible; else the first constraint it fails (a short key)
  std::string excluded;        // and the same in words, with the numbers
};

// Bytes of one GPU for this layout (no constraint checked).
MemoryBreakdown layout_memory(const ModelShape& m, const Cluster& c, const TrainShape& t, const Layout& l);
// Step time for this layout (no constraint checked).
StepTime layout_time(const ModelShape& m, const Cluster& c, const TrainShape& t, const Layout& l);
// (P - 1) / (V * M): the share of a pipeline flush left idle, relative to the M micro-batches.
double bubble_fraction(int pp, int v, int micro_batches);
// Memory and time, tokens/s/GPU and MFU, and the first constraint it fails (in the order of
// docs/scaling.md: dp*tp*pp = N, tp divides heads, tp <= gpus_per_node, pp divides layers,
// interleaving, global batch, ZeRO, memory).
Evaluated evaluate(const ModelShape& m, const Cluster& c, const TrainShape& t, const Layout& l);

struct Plan {
  ModelShape model;
  Cluster cluster;
  TrainShape train;
  std::vector<Evaluated> feasible;  // fastest first
  std::vector<Evaluated> excluded;  // in enumeration order
};
// Every layout: tp and pp over the divisors of N, v in {1, 2, 4, 8}, zero 0-3, the three
// recompute choices, mbs in 1, 2, 4, ... max_mbs. UserError naming the option for N outside
// [1, 2^20], a global batch or max_mbs outside [1, 2^30], gpus_per_node < 1, a bandwidth <= 0,
// or more than 2 million layouts to evaluate (N with very many divisors).
Plan plan_layouts(const ModelShape& m, const Cluster& c, const TrainShape& t);

// The ranked table (top K), the exclusions counted by reason (and each one listed when
// show_excluded), and the same as JSON.
std::string plan_table(const Plan& p, int top, bool show_excluded);
nlohmann::json plan_json(const Plan& p, int top);

// A published training run and the planner's prediction for its layout.
struct PublishedCase {
  std::string name, source;
  ModelShape model;
  Cluster cluster;
  TrainShape train;
  Layout layout;             // the layout the run used
  double published_step_s = 0;  // seconds per optimizer step, from the publication
  double predicted_step_s = 0;  // layout_time(...).total()
  double published_mfu = 0, predicted_mfu = 0;
  double published_mem_gib = 0;  // peak memory per GPU where published (0: not published)
  double predicted_mem_gib = 0;  // layout_memory(...).total(), the reserve included
  double relative_error() const { return (predicted_step_s - published_step_s) / published_step_s; }
};
// Megatron-LM GPT-3 175B on 1024 A100s; torchtitan Llama 3 8B on 8 H100s; llm.c GPT-2 1.5B
// on 8 H100s (docs/scaling.md gives each source).
std::vector<PublishedCase> published_cases();
std::string published_table(const std::vector<PublishedCase>& cases);

}  // namespace dtrain::parallel

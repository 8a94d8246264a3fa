// Every parallelism rule of a recipe (session/layout.h): each names the keys and the numbers
// in a UserError; resolve_layout runs them all and reports every failure at once.
#include <fmt/format.h>

#include "core/error.h"
#include "models/gpt.h"
#include "session/layout.h"

namespace dtrain {

int resolve_shard_group_size(const Config& cfg, int world) {
  const int s = int(cfg.parallel.shard_group_size);
  const int zero = int(cfg.parallel.zero);
  if (s == 0 || s == world) return world;
  if (world % s != 0)
    user_error("{}: parallel.shard_group_size = {} must divide the world size {} (shard groups of consecutive "
               "ranks; 0 = all ranks)",
               cfg.source(), s, world);
  if (zero != 3)
    user_error("{}: parallel.shard_group_size = {} (of {} ranks) needs parallel.zero = 3, but parallel.zero is {} "
               "(hybrid sharding shards ZeRO-3's parameters within each group; set it to 0)",
               cfg.source(), s, world, zero);
  return s;
}

DType resolve_reduce_dtype(const Config& cfg) {
  if (cfg.parallel.reduce_dtype != "bf16") return DType::F32;
  const int64_t zero = cfg.parallel.zero;
  if (zero != 3)
    user_error("{}: parallel.reduce_dtype = \"bf16\" needs parallel.zero = 3, but parallel.zero is {} (the bf16 "
               "reduction is ZeRO-3's reduce-scatter of the gradient windows; use \"f32\")",
               cfg.source(), zero);
  return DType::BF16;
}

parallel::CompressionOptions resolve_grad_compression(const Config& cfg) {
  parallel::CompressionOptions o;
  o.kind = parallel::parse_grad_compression(cfg.parallel.grad_compression);
  o.powersgd_rank = int(cfg.parallel.powersgd_rank);
  o.powersgd_start_step = cfg.parallel.powersgd_start_step;
  o.seed = uint64_t(cfg.run.seed);
  if (o.powersgd_rank < 1)
    user_error("{}: parallel.powersgd_rank = {}: expected a rank >= 1", cfg.source(), o.powersgd_rank);
  if (o.kind == parallel::GradCompression::None) return o;
  const std::string name = parallel::grad_compression_name(o.kind);
  if (const int64_t zero = cfg.parallel.zero; zero >= 2)
    user_error("{}: parallel.grad_compression = \"{}\" does not work with parallel.zero = {} (it compresses the "
               "bucket all-reduce of stages 0 and 1; ZeRO-2/3 reduce-scatter the gradients): set parallel.zero to "
               "0 or 1, or parallel.grad_compression = \"none\"",
               cfg.source(), name, zero);
  for (const int64_t* size : {&cfg.parallel.tensor, &cfg.parallel.pipeline})
    if (*size > 1)
      user_error("{}: parallel.grad_compression = \"{}\" does not work with {} = {} yet (set "
                 "parallel.grad_compression = \"none\")",
                 cfg.source(), name, cfg.key_of(*size), *size);
  if (o.kind == parallel::GradCompression::PowerSGD && cfg.precision.dtype == "fp16")
    user_error("{}: parallel.grad_compression = \"powersgd\" does not work with precision.dtype = \"fp16\" (a step "
               "whose gradients overflow would leave inf/nan in the error feedback): use bf16 or fp32",
               cfg.source());
  return o;
}

int check_tensor_parallel(const Config& cfg, int world) {
  const int t = int(cfg.parallel.tensor);
  const bool sequence = cfg.parallel.sequence;
  if (sequence && t == 1)
    user_error("{}: parallel.sequence = true needs parallel.tensor > 1 (it shards the activations between the "
               "tensor-parallel layers over the tensor group), got parallel.tensor = 1", cfg.source());
  if (t == 1) return 1;
  if (world % t != 0)
    user_error("{}: parallel.tensor = {} must divide the world size {} (world = data x tensor ranks)", cfg.source(), t,
               world);
  auto refuse = [&](const std::string& what) {
    user_error("{}: parallel.tensor = {} does not work with {} yet (set parallel.tensor = 1)", cfg.source(), t, what);
  };
  if (cfg.model.kind != "gpt") refuse(fmt::format("model.kind = \"{}\" (tensor parallelism is GPT's)", cfg.model.kind));
  if (cfg.train.cuda_graph) refuse("train.cuda_graph = true");
  if (cfg.parallel.offload != "none") refuse(fmt::format("parallel.offload = \"{}\"", cfg.parallel.offload));
  GptSpec spec = gpt_spec_from(cfg);
  spec.tp_size = t;
  spec.sequence_parallel = sequence;
  gpt_validate(spec);  // T must divide model.n_head (and model.block_size under parallel.sequence)
  return t;
}

PipelineLayout check_pipeline(const Config& cfg, int world) {
  PipelineLayout l;
  const int P = int(cfg.parallel.pipeline);
  const int V = int(cfg.parallel.virtual_stages);
  const std::vector<int64_t> given = cfg.parallel.stage_layers;
  if (P == 1) {
    if (V != 1 || !given.empty())
      user_error("{}: parallel.virtual_stages = {} / parallel.stage_layers need parallel.pipeline > 1 (got "
                 "parallel.pipeline = 1)", cfg.source(), V);
    return l;
  }
  const int T = int(cfg.parallel.tensor);
  if (world % (P * T) != 0)
    user_error("{}: parallel.pipeline = {} x parallel.tensor = {} must divide the world size {} (world = pipeline x "
               "data x tensor)", cfg.source(), P, T, world);
  auto refuse = [&](const std::string& what) {
    user_error("{}: parallel.pipeline = {} does not work with {} (set parallel.pipeline = 1)", cfg.source(), P, what);
  };
  if (cfg.model.kind != "gpt") refuse(fmt::format("model.kind = \"{}\" (pipeline parallelism is GPT's)", cfg.model.kind));
  if (cfg.train.recompute != "none")
    refuse(fmt::format("train.recompute = \"{}\" (every stage already runs its forward again before its backward)",
                       cfg.train.recompute));
  if (cfg.train.cuda_graph) refuse("train.cuda_graph = true");
  if (cfg.parallel.offload != "none") refuse(fmt::format("parallel.offload = \"{}\"", cfg.parallel.offload));
  if (cfg.parallel.reduce_dtype != "f32") refuse(fmt::format("parallel.reduce_dtype = \"{}\"", cfg.parallel.reduce_dtype));
  if (cfg.parallel.sequence) refuse("parallel.sequence = true");
  l.stages = P;
  l.virtual_stages = V;
  l.schedule = parallel::parse_pipe_schedule(cfg.parallel.schedule, V);
  const int M = int(cfg.train.grad_accum);
  GptSpec spec = gpt_spec_from(cfg);
  if (l.schedule == parallel::PipeSchedule::Interleaved) {
    if (M % P != 0)
      user_error("{}: parallel.virtual_stages = {} (interleaved 1F1B) needs train.grad_accum = {} divisible by "
                 "parallel.pipeline = {}", cfg.source(), V, M, P);
    if (given.empty() && spec.n_layer % (P * V) != 0)
      user_error("{}: parallel.virtual_stages = {} (interleaved 1F1B) needs model.n_layer = {} divisible by "
                 "parallel.pipeline x parallel.virtual_stages = {} (or set parallel.stage_layers)",
                 cfg.source(), V, spec.n_layer, P * V);
  }
  // costs in blocks: the embedding is a gather (cheap); ln_f + the head + the loss cost a
  // GEMM of C x vocabulary per token against a block's 12 C^2 (attention besides)
  const double head = double(spec.padded_vocab) / (12.0 * spec.n_embd);
  l.layers = parallel::pipeline_stage_layers(spec.n_layer, P * V, given, 0.0, head);
  l.tied = gpt_tied_param(spec);
  return l;
}

}  // namespace dtrain

#pragma once
// A Runtime is what a Task works on: the recipe, the backend and its scratch arena, the
// parameters and the model, the loss scaler, the input geometry and this process's place
// among the ranks. The Session (session/session.h) is a Runtime plus the task, optimizer and
// schedule; tasks see only the Runtime, so session/task.h never needs session/session.h.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"
#include "models/model.h"
#include "nn/lora.h"
#include "nn/params.h"
#include "nn/tp.h"
#include "optim/loss_scaler.h"
#include "config/config.h"
#include "session/pipeline_layout.h"

namespace dtrain {

class Pipeline;
class GptModel;

struct Runtime {
  explicit Runtime(const Config& c);  // out of line: Pipeline is incomplete here
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  ~Runtime();

  Config cfg;
  std::unique_ptr<Backend> be;
  std::unique_ptr<Arena> arena;
  // train.recompute: where a recomputing unit's activations live (reset per unit)
  std::unique_ptr<Arena> scratch_arena;
  Recompute recompute = Recompute::None;
  // The trainable parameters: what the optimizer, data parallelism, ZeRO and checkpoints see.
  // Without LoRA the model's own; with lora.enabled the adapters (nn/lora.h), the model's own
  // parameters then frozen in `base` (model.init_from's weights, read again on resume).
  ParamStore params;
  std::unique_ptr<ParamStore> base;
  LoraOptions lora;
  // The store the model declares its layers into: `base` under LoRA, else `params`.
  ParamStore& model_params() { return base ? *base : params; }
  const ParamStore& model_params() const { return base ? *base : params; }
  std::unique_ptr<Model> model;
  // precision.dtype = "fp16": dynamic loss scaling (disabled: scale 1 for fp32 and bf16)
  LossScaler scaler;
  // data.kind = "synthetic": one random batch per stream made once and kept on the device,
  // so a benchmark measures compute alone (as the PyTorch twins do)
  std::map<uint64_t, std::pair<Buffer, Buffer>> synthetic;  // stream -> (inputs, labels)
  // input geometry (NHWC) and classes (GPT: the vocabulary)
  int64_t height = 0, width = 0, channels = 0, num_classes = 0;
  // data parallelism: this process's rank among `world` (train data and synthetic batches
  // are per rank; 1 outside distributed runs)
  int rank = 0, world = 1;
  // ZeRO-3 during an evaluation: the hooks every Ctx a task makes must carry (Ctx::units)
  UnitHooks* units = nullptr;
  // tensor parallelism (parallel.tensor): this rank's place in its group and the group's
  // collectives, which every Ctx a task makes must carry (Ctx::tp; null when tp_size is 1)
  int tp_rank = 0, tp_size = 1;
  TensorParallelOps* tp = nullptr;
  // pipeline parallelism (parallel.pipeline, session/pipeline.h): this rank's stage of pp_size;
  // `model` is its chunk 0, pp_more its other chunks (interleaved); `pipe` runs them
  int pp_rank = 0, pp_size = 1;
  PipelineLayout pipe_layout;
  std::vector<std::unique_ptr<Model>> pp_more;
  std::unique_ptr<Pipeline> pipe;
  // GPT: where checkpoints copy the tokenizer files from (data/tokenizer.h tokenizer_files);
  // "" = beside the token shards (data.path)
  std::string vocab_dir;

  // f64 [1] device scalars holding loss sums: slot i takes micro-batch i of a step (read
  // once, at the end of the step); evaluation reuses slot 0 between steps. Made at the
  // first use and grown only when more slots are asked for.
  Tensor loss_slot(int64_t i);
  // slots [0, n) on the host (synchronises)
  std::vector<double> read_loss_slots(int64_t n);

 private:
  Buffer loss_slots_;
};

// Copies `bytes` from the host into `buf` on s's device, growing it when too small (the
// address then changes, and a CUDA graph that read the old one is re-captured), and returns
// the view [dtype, shape]. Tasks stage training batches this way: fixed device addresses.
Tensor stage_upload(Backend& be, Buffer& buf, const void* src, DType dtype, const Shape& shape);

// lora.enabled: makes the frozen `base` store, which the model is built into, and attaches the
// adapters' options (before Task::build_model; tensor parallelism already set on `params`).
void prepare_lora(Runtime& s);
// After build_model: the frozen store in the compute dtype, allocated and seeded (model.init_from
// then overwrites it); UserError when lora.target_modules matched no layer of the model.
// Without a backend (a declared-only runtime) the store is not allocated.
void finalize_lora(Runtime& s, DType compute);

// "fp32" | "bf16" | "fp16" -> the dtype layers compute in.
DType compute_dtype_of(const std::string& precision);
// x (a float input batch) in the runtime's compute dtype: x itself, or a cast copy from the arena.
Tensor to_compute(Runtime& s, const Tensor& x);

}  // namespace dtrain

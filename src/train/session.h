#pragma once
// A Session is everything a recipe builds before the first step: backend, parameter
// store, model, optimizer, schedule and data loaders. train, eval and bench share it.
#include <map>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "data/image_loader.h"
#include "core/buffer.h"
#include "models/model.h"
#include "nn/params.h"
#include "obs/step_timer.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/config.h"
#include "train/step_graph.h"
#include "train/task.h"

namespace dtrain {

using data::ImageBatch;
using data::ImageLoader;
using data::ImageLoaderOptions;
using data::LoaderState;

struct Session {
  explicit Session(const Config& c) : cfg(c) {}
  Config cfg;
  std::unique_ptr<Backend> be;
  std::unique_ptr<Arena> arena;
  // times the step's phases in the backend's stream order (CUDA: events, reused every step)
  std::unique_ptr<StepTimer> timer;
  ParamStore params;
  std::unique_ptr<Model> model;
  std::unique_ptr<Optimizer> opt;
  std::unique_ptr<LrSchedule> schedule;
  // precision.dtype = "fp16": dynamic loss scaling (disabled: scale 1 for fp32 and bf16)
  LossScaler scaler;
  // data, loss and metrics of the model family (ResNet: classify, GPT: lm, U-Net: segment)
  std::unique_ptr<Task> task;
  // classification only (other tasks own their loaders)
  std::unique_ptr<ImageLoader> train_data;  // null for synthetic data
  // data.kind = "synthetic": one random batch made once and kept on the device, so a
  // benchmark measures compute alone (as the PyTorch twins do)
  std::map<uint64_t, std::pair<Buffer, Buffer>> synthetic;  // stream -> (images, labels)
  std::unique_ptr<ImageLoader> eval_data;   // null when there is no eval split
  // input geometry (NHWC) and classes
  int64_t height = 0, width = 0, channels = 0, num_classes = 0;
  int64_t steps_per_epoch = 0;  // optimizer steps per epoch
  int64_t total_steps = 0;
  // data parallelism: this process's rank among `world` (train data and synthetic batches
  // are per rank; 1 outside distributed runs)
  int rank = 0, world = 1;
  // CPU threads of this process (comm::cpu_threads: run.threads, else OMP_NUM_THREADS, else
  // its share of the affinity mask) and where the count came from; 0 and "" on a CUDA device
  int cpu_threads = 0;
  std::string cpu_threads_source;
  // data parallelism, rank 0 only: every rank's cpu_threads (index = rank), gathered at the
  // start; checkpoints record them (state.json "cpu_threads")
  std::vector<int> rank_cpu_threads;
  // GPT: where checkpoints copy GPT-2's vocabulary from (vocab.json + merges.txt or
  // encoder.json + vocab.bpe); "" = beside the token shards (data.path)
  std::string vocab_dir;
  // train.cuda_graph: per micro-batch CUDA graphs of forward + loss + backward (train/step_graph.h)
  std::unique_ptr<StepGraphs> graphs;

  // f64 [1] device scalars holding loss sums: slot i takes micro-batch i of a step (read
  // once, at the end of the step); evaluation reuses slot 0 between steps. Made at the
  // first use and grown only when more slots are asked for.
  Tensor loss_slot(int64_t i);
  // slots [0, n) on the host (synchronises)
  std::vector<double> read_loss_slots(int64_t n);

  ~Session();

 private:
  Buffer loss_slots_;
};

// Copies `bytes` from the host into `buf` on s's device, growing it when too small (the
// address then changes, and a CUDA graph that read the old one is re-captured), and returns
// the view [dtype, shape]. Tasks stage training batches this way: fixed device addresses.
Tensor stage_upload(Backend& be, Buffer& buf, const void* src, DType dtype, const Shape& shape);

struct SessionOptions {
  bool with_train_data = true;
  bool with_eval_data = true;
  bool with_optimizer = true;
  // data parallelism: the train loader reads this rank's part of every epoch
  int rank = 0, world_size = 1;
  // ZeRO: the optimizer owns only rank `rank`'s shard_range of the flat buffer
  bool shard_optimizer = false;
  int device_index = 0;  // CUDA device (the local rank under a launcher)
};

// "fp32" | "bf16" | "fp16" -> the dtype layers compute in.
DType compute_dtype_of(const std::string& precision);
// x (a float input batch) in the session's compute dtype: x itself, or a cast copy from the arena.
Tensor to_compute(Session& s, const Tensor& x);

// Builds a session from a validated config. Throws UserError for bad combinations.
std::unique_ptr<Session> make_session(const Config& cfg, const SessionOptions& o);

}  // namespace dtrain

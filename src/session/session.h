#pragma once
// A Session is everything a recipe builds before the first step: backend, parameter
// store, model, task (with its data loaders), optimizer and schedule. train, eval and
// bench share it.
#include <memory>

#include "data/image_loader.h"
#include "obs/step_timer.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "session/runtime.h"
#include "session/step_graph.h"
#include "session/task.h"

namespace dtrain {

using data::ImageBatch;
using data::ImageLoader;
using data::ImageLoaderOptions;
using data::LoaderState;

// A Runtime (session/runtime.h: config, backend, arena, parameters, model, loss scaler,
// geometry, rank) plus what only the training loop needs; tasks see the Runtime alone.
struct Session : Runtime {
  explicit Session(const Config& c) : Runtime(c) {}
  ~Session();
  // times the step's phases in the backend's stream order (CUDA: events, reused every step)
  std::unique_ptr<StepTimer> timer;
  std::unique_ptr<Optimizer> opt;
  std::unique_ptr<LrSchedule> schedule;
  // data, loss and metrics of the model family (ResNet: classify, GPT: lm, U-Net: segment)
  std::unique_ptr<Task> task;
  int64_t steps_per_epoch = 0;  // optimizer steps per epoch
  int64_t total_steps = 0;
  // CPU threads of this process (comm::cpu_threads: run.threads, else OMP_NUM_THREADS, else
  // its share of the affinity mask) and where the count came from; 0 and "" on a CUDA device
  int cpu_threads = 0;
  std::string cpu_threads_source;
  // data parallelism, rank 0 only: every rank's cpu_threads (index = rank), gathered at the
  // start; checkpoints record them (state.json "cpu_threads")
  std::vector<int> rank_cpu_threads;
  // train.cuda_graph: per micro-batch CUDA graphs of forward + loss + backward (session/step_graph.h)
  std::unique_ptr<StepGraphs> graphs;
};

struct SessionOptions {
  bool with_train_data = true;
  bool with_eval_data = true;
  bool with_optimizer = true;
  // data parallelism: the train loader reads this rank's part of every epoch
  int rank = 0, world_size = 1;
  // ZeRO: the optimizer owns only rank `rank`'s shard_range of the flat buffer
  bool shard_optimizer = false;
  // ZeRO-3: the ParamStore keeps rank `rank`'s shard of every unit (ParamStore::set_sharding);
  // the optimizer then owns the shard buffers. shard_group_size S (hybrid sharding; 0 =
  // world_size): sharded over the S consecutive ranks of its shard group, as rank rank % S
  bool shard_params = false;
  int shard_group_size = 0;
  int device_index = 0;  // CUDA device (the local rank under a launcher)
  // tensor parallelism: the model is part tp_rank of tp_size (ParamStore::set_tensor_parallel);
  // rank/world_size above are then the data-parallel ones
  int tp_rank = 0, tp_size = 1;
  // pipeline parallelism: this rank's stage of pp_size (rank/world_size: the data-parallel ones)
  // and the stages' shape (ParallelLayout::pipe)
  int pp_rank = 0, pp_size = 1;
  PipelineLayout pipe;
};

// Builds a session from a validated config. Throws UserError for bad combinations.
std::unique_ptr<Session> make_session(const Config& cfg, const SessionOptions& o);

// The recipe's model (parameters, buffers and units declared; the compute dtype set), with no
// backend and nothing allocated; reads no data (plans, checkpoint readers).
std::unique_ptr<Runtime> declare_model(const Config& cfg);

}  // namespace dtrain

#include "session/session.h"

#include <algorithm>
#include <cmath>

#include "comm/env.h"
#include "core/log.h"
#include "parallel/zero.h"
#include "obs/step_timer.h"
#include "session/step_graph.h"

namespace dtrain {

Session::~Session() = default;

std::unique_ptr<Session> make_session(const Config& cfg, const SessionOptions& opt) {
  auto s = std::make_unique<Session>(cfg);
  s->rank = opt.rank;
  s->world = opt.world_size;
  s->tp_rank = opt.tp_rank;
  s->tp_size = opt.tp_size;
  s->pp_rank = opt.pp_rank;
  s->pp_size = opt.pp_size;
  s->pipe_layout = opt.pipe;
  DTRAIN_CHECK(opt.pp_size == 1 || opt.pipe.stages == opt.pp_size, "session: {} pipeline stages without their layout",
               opt.pp_size);
  // ---- data (the task of model.kind) ----
  s->task = make_task(*s, opt.with_train_data, opt.with_eval_data, opt.rank, opt.world_size);

  // ---- backend, model, parameters ----
  const comm::CpuThreads threads = comm::cpu_threads(int(cfg.run.threads), std::string(cfg.key_of(cfg.run.threads)));
  s->be = make_backend(cfg.run.device, opt.device_index, threads.threads,
                       BackendOptions{cfg.precision.tf32, cfg.run.cudnn_benchmark});
  if (s->be->device().is_cpu()) {
    s->cpu_threads = threads.threads;
    s->cpu_threads_source = threads.source;
  }
  s->arena = std::make_unique<Arena>(*s->be);
  const std::string rc = cfg.train.recompute;
  s->recompute = rc == "block" ? Recompute::Block : rc == "selective" ? Recompute::Selective : Recompute::None;
  if (s->recompute != Recompute::None) s->scratch_arena = std::make_unique<Arena>(*s->be);
  s->timer = std::make_unique<StepTimer>(*s->be);
  if (opt.tp_size > 1) s->params.set_tensor_parallel(opt.tp_rank, opt.tp_size);
  prepare_lora(*s);  // lora.enabled: the model into a frozen store, the adapters into s->params
  s->task->build_model(*s);
  // Mixed precision (DESIGN: Precision): f32 master weights, grads and optimizer state;
  // layers compute on a bf16/fp16 cast copy of the weights; fp16 adds dynamic loss scaling.
  const DType compute = compute_dtype_of(cfg.precision.dtype);
  s->params.set_compute_dtype(compute);
  finalize_lora(*s, compute);
  s->scaler = LossScaler(compute == DType::F16, cfg.precision.loss_scale, cfg.precision.growth_interval);
  if (opt.shard_params) {
    const int group = opt.shard_group_size > 0 ? opt.shard_group_size : opt.world_size;
    s->params.set_sharding(opt.rank % group, group);
  }
  s->params.finalize(*s->be);
  s->params.initialize(uint64_t(cfg.run.seed));

  // ---- schedule and optimizer ----
  if (cfg.train.cuda_graph) {
    // the recipe's own rules (offload, recompute, fp16) are config_cross_check's, data
    // parallelism's the layout's (session/layout.h); the device is known only here
    DTRAIN_CHECK(opt.world_size == 1, "session: train.cuda_graph with {} data ranks", opt.world_size);
    if (!s->be->can_capture())
      user_error("{}: train.cuda_graph = true needs a CUDA device, but this run is on the {} backend "
                 "(run.device = \"{}\"; set train.cuda_graph = false)",
                 cfg.source(), s->be->name(), cfg.run.device);
    s->graphs = std::make_unique<StepGraphs>();
  }
  const int64_t accum = cfg.train.grad_accum;
  if (s->task->batches_per_epoch() > 0) {
    s->steps_per_epoch = std::max<int64_t>(1, s->task->batches_per_epoch() / accum);
  } else {
    s->steps_per_epoch = 1000;  // synthetic data has no epochs; nominal
  }
  const int64_t max_steps = cfg.train.max_steps;
  s->total_steps = max_steps > 0 ? max_steps
                                 : int64_t(std::ceil(cfg.train.epochs * double(s->steps_per_epoch)));
  if (s->total_steps <= 0)
    user_error("{}: train.epochs = {} gives no training step (set train.max_steps or more epochs)", cfg.source(),
               cfg.train.epochs);
  if (opt.with_optimizer) {
    FlatRange range;
    if (opt.shard_optimizer) range = parallel::shard_range(s->params.num_params(), opt.rank, opt.world_size);
    const bool decay_all = cfg.optim.decay_bias_and_norm;
    OffloadOptions off;
    off.enabled = cfg.parallel.offload == "optimizer";
    off.chunk_elems = std::max<int64_t>(1, int64_t(cfg.parallel.offload_chunk_mb * double(1 << 20) / 4));
    off.host_threads = threads.threads;
    if (cfg.optim.name == "sgd") {
      SgdConfig c;
      c.momentum = float(cfg.optim.momentum);
      c.nesterov = cfg.optim.nesterov;
      c.dampening = float(cfg.optim.dampening);
      c.weight_decay = float(cfg.optim.weight_decay);
      c.decay_bias_and_norm = decay_all;
      s->opt = std::make_unique<Sgd>(s->params, c, range, off);
    } else {
      AdamWConfig c;
      c.beta1 = float(cfg.optim.beta1);
      c.beta2 = float(cfg.optim.beta2);
      c.eps = float(cfg.optim.eps);
      c.weight_decay = float(cfg.optim.weight_decay);
      c.decay_bias_and_norm = decay_all;
      s->opt = std::make_unique<AdamW>(s->params, c, range, off);
    }
    std::vector<int64_t> milestones = cfg.schedule.milestones;
    s->schedule = std::make_unique<LrSchedule>(
        parse_lr_kind(cfg.schedule.kind, std::string(cfg.key_of(cfg.schedule.kind))), cfg.optim.lr, s->total_steps, cfg.schedule.warmup_steps,
        cfg.schedule.warmup_start_factor, cfg.schedule.step_size, cfg.schedule.gamma, milestones,
        cfg.schedule.min_lr);
  }
  return s;
}

std::unique_ptr<Runtime> declare_model(const Config& cfg) {
  auto rt = std::make_unique<Runtime>(cfg);
  std::unique_ptr<Task> task = make_task(*rt, false, false, 0, 1);
  prepare_lora(*rt);
  task->build_model(*rt);
  rt->params.set_compute_dtype(compute_dtype_of(cfg.precision.dtype));
  finalize_lora(*rt, compute_dtype_of(cfg.precision.dtype));
  return rt;
}

}  // namespace dtrain

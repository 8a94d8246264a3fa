#include "session/step.h"

#include <cmath>
#include <limits>

#include "core/clock.h"
#include "core/failpoint.h"
#include "obs/step_timer.h"
#include "parallel/data_parallel.h"
#include "parallel/tensor_parallel.h"
#include "session/pipeline.h"
#include "session/step_graph.h"

namespace dtrain {

namespace {

// failpoint step.grad_overflow=RANK:STEP: an inf in this rank's reduced gradients at step
// STEP (numbered from 1, as the logs number steps)
void inject_overflow(Session& s, const Tensor& reduced, int64_t step) {
  // the global rank: the mesh is pipeline x data x tensor, tensor innermost
  const int global = (s.pp_rank * s.world + s.rank) * s.tp_size + s.tp_rank;
  if (!failpoint::hits(failpoint::Point::GradOverflow, global, step) || reduced.numel() == 0) return;
  const float inf = std::numeric_limits<float>::infinity();
  s.be->copy_from_host(reduced.data, &inf, sizeof inf);
}

// fp16: are this rank's reduced gradients (its shard under ZeRO-2/3) finite? (true otherwise)
bool local_grads_finite(Session& s, parallel::DataParallel* dp, int64_t step) {
  const Tensor reduced = dp ? dp->reduced_grads() : s.params.flat_grads();
  inject_overflow(s, reduced, step + 1);
  return !s.scaler.enabled() || reduced.numel() == 0 || s.be->all_finite(reduced);
}

// Tensor parallelism: the stop request and the overflow verdict agreed over the tensor group
// as well (after the data group's and, in a pipeline, the stages' agreement).
void agree_tensor_axis(Session& s, bool* stop, bool& finite) {
  if (!s.tp) return;
  const parallel::TpFlags f = parallel::tp_agree(*s.tp, *s.be, *s.arena, {stop && *stop, !finite});
  if (stop) *stop = f.stop;
  finite = !f.nonfinite;
}

// The step under pipeline parallelism (session/pipeline.h): the schedule's passes, the
// data-parallel reduction, the tied embedding's gradients summed over the first and last
// stage, the loss and the stop flag summed over the stages (the last holds the loss), then
// the data-parallel agreement, clipping over every stage and each stage's optimizer.
StepStats pipeline_step(Session& s, int64_t step, double lr, parallel::DataParallel* dp, bool* stop) {
  StepStats st;
  StepTimer& tm = *s.timer;
  tm.start();
  Backend& be = *s.be;
  Pipeline& pipe = *s.pipe;
  s.params.refresh_compute();
  s.params.zero_grads();
  const int64_t accum = s.cfg.train.grad_accum;
  s.loss_slot(accum - 1);
  const int zero = dp ? dp->zero_stage() : 0;
  // no hooks: the buckets are reduced after the last backward (ZeRO-3: each action's pass
  // reduce-scatters its units, Pipeline::train)
  if (dp && zero < 3) dp->begin_micro(true);
  PipeTimes times;
  tm.begin(Phase::Forward);  // the whole schedule (forwards and backwards interleave): forward_s
  st.samples = pipe.train(s, *s.task, accum, st.t, times, step, dp);
  tm.end(Phase::Forward);
  // the tied wte: ZeRO-2 sums it before the reduce-scatter (the two stages' shards of it lie at
  // other offsets), ZeRO-3 from the all-gathered shards, the others after the all-reduce
  if (zero == 2) pipe.sum_tied_grads(s.params, *s.arena);
  if (dp) {
    tm.wait_device();
    st.sync_s += dp->reduce_grads();
  }
  if (zero != 2) pipe.sum_tied_grads(s.params, *s.arena, zero == 3 ? &dp->state_comm() : nullptr);
  double loss_sum = 0;
  if (pipe.last())
    for (double v : s.read_loss_slots(accum)) loss_sum += v;
  bool finite = local_grads_finite(s, dp, step);
  // loss, stop, overflow, idle and busy time over the stages (one small all-reduce)
  std::vector<double> v = {loss_sum, stop && *stop ? 1.0 : 0.0, finite ? 0.0 : 1.0, times.idle_s, times.busy_s};
  pipe.sum_over_stages(be, v);
  loss_sum = v[0];
  if (stop) *stop = v[1] > 0;
  finite = v[2] == 0;
  st.pp_idle_s = v[3];
  st.pp_busy_s = v[4];
  st.pp_bubble_theory = pipe.bubble_theory(accum);
  st.local_samples = st.samples;
  double samples_all = double(st.samples);
  if (dp) {
    auto ts = Clock::now();
    const parallel::StepFlags f = dp->agree({loss_sum, double(st.samples), stop && *stop, !finite});
    loss_sum = f.loss_sum;
    samples_all = f.samples;
    if (stop) *stop = f.stop;
    finite = !f.nonfinite;
    st.sync_s += seconds_since(ts);
  }
  agree_tensor_axis(s, stop, finite);
  const float inv_scale = 1.f / s.scaler.scale();
  st.loss_scale = s.scaler.scale();
  auto finish = [&] {
    st.samples = int64_t(samples_all);
    st.loss = loss_sum / samples_all;
    tm.finish();
    st.t.forward_s = tm.seconds(Phase::Forward);
    st.t.optimizer_s = tm.seconds(Phase::Optimizer);
    st.t.total_s = tm.total_s();
    return st;
  };
  if (!s.scaler.update(finite)) {  // fp16 overflow on some rank: no update anywhere, scale halved
    st.skipped = true;
    return finish();
  }
  tm.begin(Phase::Optimizer);
  float grad_scale = 1.f;
  const double max_norm = s.cfg.train.clip_grad_norm;
  if (max_norm > 0) {
    const double norm =
        pipe.grad_norm(s.params, s.tp, *s.arena, inv_scale, zero >= 2 ? dp->sharded_grads() : parallel::ShardedGrads{});
    grad_scale = clip_coef_from_norm(norm, float(max_norm));
    st.grad_norm = float(norm);
  }
  s.opt->step(float(lr), grad_scale * inv_scale);
  tm.end(Phase::Optimizer);
  if (dp) {
    tm.wait_device();
    st.sync_s += dp->gather_params();
  }
  if (zero == 2) pipe.copy_tied_weights(s.params);
  return finish();
}

}  // namespace

StepStats train_step(Session& s, int64_t step, double lr, parallel::DataParallel* dp, bool* stop) {
  if (s.pipe) return pipeline_step(s, step, lr, dp, stop);
  StepStats st;
  StepTimer& tm = *s.timer;  // device phases in stream order; data and sync on the host clock
  tm.start();
  Backend& be = *s.be;
  s.params.refresh_compute();  // mixed precision: the compute copy follows the master weights
  s.params.zero_grads();       // (ZeRO-3: the rank's gradient shard)
  const int64_t accum = s.cfg.train.grad_accum;
  s.loss_slot(accum - 1);  // every slot exists before the first is written
  for (int64_t micro = 0; micro < accum; ++micro) {
    const StagedBatch sb = s.task->stage_batch(s, uint64_t(micro * s.world + s.rank), st.t);
    Tensor loss_sum = s.loss_slot(micro);
    const bool last_micro = micro + 1 == accum;
    if (dp) dp->begin_micro(last_micro);
    // device work only from here to the end of backward: a CUDA graph may capture it
    auto body = [&] {
      Ctx ctx{be, *s.arena, true, {}, {}};
      ctx.recompute = s.recompute;
      ctx.scratch = s.scratch_arena.get();
      ctx.tp = s.tp;
      if (dp) {
        ctx.sync_sum = dp->sync_sum();
        ctx.grad_ready = dp->grad_hook();
        ctx.units = dp->unit_hooks();
      }
      tm.begin(Phase::Forward);
      Tensor dout = s.task->forward_loss(s, ctx, accum, loss_sum);
      tm.end(Phase::Forward);
      tm.begin(Phase::Backward);
      s.model->backward(ctx, dout);
      tm.end(Phase::Backward);
    };
    if (s.graphs)
      s.graphs->run(be, tm, s.params, micro, {sb.x, sb.y}, body);
    else
      body();
    if (dp) st.sync_s += dp->end_micro();
    if (dp && last_micro) {
      tm.wait_device();  // the collectives wait for the gradients anyway; sync counts from here
      st.sync_s += dp->reduce_grads();
    }
    st.samples += sb.units;
    s.arena->reset();
    if (s.scratch_arena) s.scratch_arena->reset();
  }
  // gradients partial per tensor-parallel rank (ParamDesc::tp_partial), summed over the group:
  // the layer norms' under sequence parallelism, and a Llama's replicated key/value heads'
  // (k_proj / v_proj) with or without it (ZeRO-2/3: those in the rank's reduced shards). Nothing
  // is partial otherwise (GPT-2 without sequence parallelism): the call returns at once.
  const parallel::ShardedGrads shards = dp && s.tp ? dp->sharded_grads() : parallel::ShardedGrads{};
  if (s.tp) parallel::tp_sum_partial_grads(*s.tp, s.params, *s.arena, shards);
  // The micro-batches' loss sums stayed on the device: one read (data parallel: before the
  // agreement below; otherwise at the end of the step, where the host waits anyway).
  double loss_sum = 0;
  auto read_loss = [&] {
    for (double v : s.read_loss_slots(accum)) loss_sum += v;
  };
  bool finite = local_grads_finite(s, dp, step);
  st.local_samples = st.samples;
  double samples_all = double(st.samples);
  if (dp) {  // loss, samples, stop and overflow agreed over ranks (one small all-reduce)
    read_loss();
    auto ts = Clock::now();
    const parallel::StepFlags f = dp->agree({loss_sum, double(st.samples), stop && *stop, !finite});
    loss_sum = f.loss_sum;
    samples_all = f.samples;
    if (stop) *stop = f.stop;
    finite = !f.nonfinite;
    st.sync_s += seconds_since(ts);
  }
  if (s.tp) {  // and over the tensor group (the loss is already the same on its ranks)
    auto ts = Clock::now();
    agree_tensor_axis(s, stop, finite);
    st.sync_s += seconds_since(ts);
  }
  const float inv_scale = 1.f / s.scaler.scale();
  st.loss_scale = s.scaler.scale();
  auto finish = [&] {
    if (!dp) read_loss();  // data parallel: read before the agreement above
    st.samples = int64_t(samples_all);
    st.loss = loss_sum / samples_all;
    tm.finish();  // waits for the end of the step on the device
    st.t.forward_s = tm.seconds(Phase::Forward);
    st.t.backward_s = tm.seconds(Phase::Backward);
    st.t.optimizer_s = tm.seconds(Phase::Optimizer);
    st.t.total_s = tm.total_s();
    return st;
  };
  if (!s.scaler.update(finite)) {
    // fp16 overflow: no update this step (params, optimizer state and its step count
    // unchanged, as GradScaler skips optimizer.step()); the scale was halved.
    st.skipped = true;
    return finish();
  }
  tm.begin(Phase::Optimizer);
  float grad_scale = 1.f;
  const double max_norm = s.cfg.train.clip_grad_norm;
  if (max_norm > 0) {
    const double norm = s.tp   ? parallel::tp_grad_norm(*s.tp, s.params, *s.arena, inv_scale, shards)
                        : dp ? dp->grad_norm(inv_scale)
                             : parallel::full_grad_norm(be, s.params.flat_grads(), inv_scale);
    grad_scale = clip_coef_from_norm(norm, float(max_norm));
    st.grad_norm = float(norm);
  }
  s.opt->step(float(lr), grad_scale * inv_scale);
  tm.end(Phase::Optimizer);
  if (dp) {
    tm.wait_device();  // the all-gather sends the updated shard
    st.sync_s += dp->gather_params();
  }
  return finish();
}

EvalStats evaluate(Session& s, parallel::DataParallel* dp) {
  s.params.refresh_compute();
  if (!dp || !dp->unit_hooks()) return s.task->evaluate(s);
  // ZeRO-3: every rank evaluates (the units are gathered collectively), rank 0 reports
  dp->begin_eval();
  s.units = dp->unit_hooks();
  EvalStats ev = s.task->evaluate(s);
  s.units = nullptr;
  dp->end_eval();
  return ev;
}

}  // namespace dtrain

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

// Gradients partial per tensor-parallel rank (ParamDesc::tp_partial), summed over the group
// after the data-parallel reduction: the layer norms' under sequence parallelism, and a Llama's
// replicated key/value heads' (k_proj / v_proj) with or without it (ZeRO-2/3: those in the
// rank's reduced shards). Nothing is partial otherwise (GPT-2 without sequence parallelism):
// the call returns at once. Returns where the reduced gradients are (for a tensor-parallel norm).
parallel::ShardedGrads sum_tensor_partials(Session& s, parallel::DataParallel* dp) {
  const parallel::ShardedGrads shards = dp && s.tp ? dp->sharded_grads() : parallel::ShardedGrads{};
  if (s.tp) parallel::tp_sum_partial_grads(*s.tp, s.params, *s.arena, shards);
  return shards;
}

// The end of every step, plain or pipelined: the agreement and the update.
struct StepTail {
  Session& s;
  parallel::DataParallel* dp;
  StepTimer& tm;
  StepStats& st;

  // Loss, samples, stop and overflow agreed over the data-parallel ranks (one small
  // all-reduce), then stop and overflow over the tensor group (the loss is already the same
  // on its ranks). `samples_all`: this rank's samples in, the job's out.
  void agree(double& loss_sum, double& samples_all, bool& finite, bool* stop) {
    if (dp) {
      auto ts = Clock::now();
      const parallel::StepFlags f = dp->agree({loss_sum, samples_all, stop && *stop, !finite});
      loss_sum = f.loss_sum;
      samples_all = f.samples;
      if (stop) *stop = f.stop;
      finite = !f.nonfinite;
      st.sync_s += seconds_since(ts);
    }
    if (s.tp) {
      auto ts = Clock::now();
      agree_tensor_axis(s, stop, finite);
      st.sync_s += seconds_since(ts);
    }
  }

  // fp16: a step some rank overflowed in updates nothing anywhere (params, optimizer state
  // and its step count unchanged, as GradScaler skips optimizer.step()); the scale is halved.
  // Otherwise clipping by `norm(1 / scale)` (train.clip_grad_norm), the optimizer and ZeRO's
  // gather of the updated shards. False: skipped.
  template <class Norm>
  bool update(double lr, bool finite, Norm norm) {
    const float inv_scale = 1.f / s.scaler.scale();
    st.loss_scale = s.scaler.scale();
    if (!s.scaler.update(finite)) {
      st.skipped = true;
      return false;
    }
    tm.begin(Phase::Optimizer);
    float grad_scale = 1.f;
    const double max_norm = s.cfg.train.clip_grad_norm;
    if (max_norm > 0) {
      const double n = norm(inv_scale);
      grad_scale = clip_coef_from_norm(n, float(max_norm));
      st.grad_norm = float(n);
    }
    s.opt->step(float(lr), grad_scale * inv_scale);
    tm.end(Phase::Optimizer);
    if (dp) {
      tm.wait_device();  // the all-gather sends the updated shard
      st.sync_s += dp->gather_params();
    }
    return true;
  }

  StepStats finish(double loss_sum, double samples_all) {
    st.samples = int64_t(samples_all);
    st.loss = loss_sum / samples_all;
    tm.finish();  // waits for the end of the step on the device
    st.t.forward_s = tm.seconds(Phase::Forward);
    st.t.backward_s = tm.seconds(Phase::Backward);
    st.t.optimizer_s = tm.seconds(Phase::Optimizer);
    st.t.total_s = tm.total_s();
    return st;
  }
};

// The step under pipeline parallelism (session/pipeline.h): the schedule's passes, the
// data-parallel reduction with the tied embedding's gradients summed over the first and last
// stage, the loss and the stop flag summed over the stages (the last holds the loss), then
// the step's agreement, clipping over every stage and each stage's optimizer.
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
  // no hooks: the gradients are reduced after the last backward (ZeRO-3: each action's pass
  // reduce-scatters its units, Pipeline::train)
  if (dp) dp->expect_reduction();
  PipeTimes times;
  tm.begin(Phase::Forward);  // the whole schedule (forwards and backwards interleave): forward_s
  st.samples = pipe.train(s, *s.task, accum, st.t, times, step, dp);
  tm.end(Phase::Forward);
  if (dp) tm.wait_device();
  st.sync_s += pipe.reduce_grads(s.params, *s.arena, dp);
  sum_tensor_partials(s, dp);  // a Qwen2's key/value head replicated over the tensor group
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
  StepTail tail{s, dp, tm, st};
  tail.agree(loss_sum, samples_all, finite, stop);
  const parallel::ShardedGrads shards = dp ? dp->sharded_grads() : parallel::ShardedGrads{};
  if (tail.update(lr, finite, [&](float inv) { return pipe.grad_norm(s.params, s.tp, *s.arena, inv, shards); }))
    pipe.after_update(s.params, dp);
  return tail.finish(loss_sum, samples_all);
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
  const parallel::ShardedGrads shards = sum_tensor_partials(s, dp);
  // The micro-batches' loss sums stayed on the device: one read (data parallel: before the
  // agreement; otherwise at the end of the step, where the host waits anyway).
  double loss_sum = 0;
  auto read_loss = [&] {
    for (double v : s.read_loss_slots(accum)) loss_sum += v;
  };
  bool finite = local_grads_finite(s, dp, step);
  st.local_samples = st.samples;
  double samples_all = double(st.samples);
  if (dp) read_loss();
  StepTail tail{s, dp, tm, st};
  tail.agree(loss_sum, samples_all, finite, stop);
  tail.update(lr, finite, [&](float inv) {
    return s.tp ? parallel::tp_grad_norm(*s.tp, s.params, *s.arena, inv, shards)
           : dp ? dp->grad_norm(inv)
                : parallel::full_grad_norm(be, s.params.flat_grads(), inv);
  });
  if (!dp) read_loss();
  return tail.finish(loss_sum, samples_all);
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

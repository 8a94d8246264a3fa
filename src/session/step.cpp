#include "session/step.h"

#include "obs/step_timer.h"
#include "parallel/data_parallel.h"
#include "parallel/step_sync.h"
#include "session/pipeline.h"
#include "session/step_graph.h"

namespace dtrain {

namespace {

// Everything after the last backward, for either kind of step (parallel/step_sync.h).
StepStats finish_step(Session& s, int64_t step, double lr, parallel::DataParallel* dp, bool* stop, StepStats st,
                      const parallel::StepLocal& mine) {
  parallel::StepGroups g{dp, s.tp, s.pipe ? &s.pipe->sync() : nullptr};
  // the global rank: the mesh is pipeline x data x tensor, tensor innermost
  const int global = (s.pp_rank * s.world + s.rank) * s.tp_size + s.tp_rank;
  parallel::StepSync sync(s.params, *s.arena, s.scaler, *s.opt, *s.timer, g, {s.cfg.train.clip_grad_norm, global});
  const parallel::StepEnd e = sync.finish(step, lr, mine);
  if (stop) *stop = e.stop;
  st.samples = int64_t(e.samples);
  st.loss = e.loss_sum / e.samples;
  st.grad_norm = e.grad_norm;
  st.sync_s += e.sync_s;
  st.loss_scale = e.loss_scale;
  st.skipped = e.skipped;
  st.pp_idle_s = e.pp_idle_s;
  st.pp_busy_s = e.pp_busy_s;
  StepTimer& tm = *s.timer;
  tm.finish();  // waits for the end of the step on the device
  st.t.forward_s = tm.seconds(Phase::Forward);
  st.t.backward_s = tm.seconds(Phase::Backward);
  st.t.optimizer_s = tm.seconds(Phase::Optimizer);
  st.t.total_s = tm.total_s();
  return st;
}

// The micro-batches' loss sums, read from the device (synchronises).
double read_loss(Session& s, int64_t accum) {
  double sum = 0;
  for (double v : s.read_loss_slots(accum)) sum += v;
  return sum;
}

// The step under pipeline parallelism (session/pipeline.h): the schedule's passes; the last
// stage holds the loss. No hooks: the gradients are reduced after the last backward (ZeRO-3:
// each action's pass reduce-scatters its units, Pipeline::train).
StepStats pipeline_step(Session& s, int64_t step, double lr, parallel::DataParallel* dp, bool* stop) {
  StepStats st;
  StepTimer& tm = *s.timer;
  tm.start();
  Pipeline& pipe = *s.pipe;
  s.params.refresh_compute();
  s.params.zero_grads();
  const int64_t accum = s.cfg.train.grad_accum;
  s.loss_slot(accum - 1);
  if (dp) dp->expect_reduction();
  PipeTimes times;
  tm.begin(Phase::Forward);  // the whole schedule (forwards and backwards interleave): forward_s
  st.samples = pipe.train(s, *s.task, accum, st.t, times, step, dp);
  tm.end(Phase::Forward);
  st.pp_bubble_theory = pipe.bubble_theory(accum);
  st.local_samples = st.samples;
  const bool last = pipe.last();
  return finish_step(s, step, lr, dp, stop, st,
                     {[&] { return last ? read_loss(s, accum) : 0.0; }, double(st.samples), stop && *stop,
                      times.idle_s, times.busy_s});
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
    if (dp) dp->begin_micro(micro + 1 == accum);
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
    st.samples += sb.units;
    s.arena->reset();
    if (s.scratch_arena) s.scratch_arena->reset();
  }
  st.local_samples = st.samples;
  return finish_step(s, step, lr, dp, stop, st, {[&] { return read_loss(s, accum); }, double(st.samples), stop && *stop});
}

EvalStats evaluate(Session& s, parallel::DataParallel* dp) {
  s.params.refresh_compute();
  if (!dp || !dp->shards_params()) return s.task->evaluate(s);
  // ZeRO-3: every rank evaluates (the units are gathered collectively), rank 0 reports
  dp->begin_eval();
  s.units = dp->unit_hooks();
  EvalStats ev = s.task->evaluate(s);
  s.units = nullptr;
  dp->end_eval();
  return ev;
}

}  // namespace dtrain

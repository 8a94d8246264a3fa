#include "parallel/step_sync.h"

#include <limits>

#include "core/clock.h"
#include "core/failpoint.h"

namespace dtrain::parallel {

StepSync::StepSync(ParamStore& ps, Arena& arena, LossScaler& scaler, Optimizer& opt, StepTimer& tm, StepGroups g,
                   StepSyncOptions o)
    : ps_(ps), arena_(arena), scaler_(scaler), opt_(opt), tm_(tm), g_(g), o_(o) {}

// fp16: are this rank's reduced gradients (its shard under ZeRO-2/3) finite? (true otherwise)
// failpoint step.grad_overflow=RANK:STEP puts an inf in them at step STEP (numbered from 1,
// as the logs number steps).
bool StepSync::local_grads_finite(int64_t step) {
  const Tensor reduced = g_.dp ? g_.dp->reduced_grads() : ps_.flat_grads();
  Backend& be = ps_.backend();
  if (failpoint::hits(failpoint::Point::GradOverflow, o_.global_rank, step + 1) && reduced.numel() > 0) {
    const float inf = std::numeric_limits<float>::infinity();
    be.copy_from_host(reduced.data, &inf, sizeof inf);
  }
  return !scaler_.enabled() || reduced.numel() == 0 || be.all_finite(reduced);
}

// Loss, samples, stop and overflow agreed over the data-parallel ranks (one small all-reduce),
// then stop and overflow over the tensor group (the loss is already the same on its ranks).
// A pipeline's stages agreed before (PipelineSync::sum, with their times).
void StepSync::agree(StepEnd& e, bool& finite) {
  if (g_.dp) {
    const auto ts = Clock::now();
    const StepFlags f = g_.dp->agree({e.loss_sum, e.samples, e.stop, !finite});
    e.loss_sum = f.loss_sum;
    e.samples = f.samples;
    e.stop = f.stop;
    finite = !f.nonfinite;
    e.sync_s += seconds_since(ts);
  }
  if (g_.tp) {
    const auto ts = Clock::now();
    const TpFlags f = tp_agree(*g_.tp, ps_.backend(), arena_, {e.stop, !finite});
    e.stop = f.stop;
    finite = !f.nonfinite;
    e.sync_s += seconds_since(ts);
  }
}

double StepSync::grad_norm(double inv_scale, const ShardedGrads& shards) {
  if (g_.stages) return g_.stages->grad_norm(ps_, g_.tp, arena_, inv_scale, shards);
  if (g_.tp) return tp_grad_norm(*g_.tp, ps_, arena_, inv_scale, shards);
  if (g_.dp) return g_.dp->grad_norm(inv_scale);
  return full_grad_norm(ps_.backend(), ps_.flat_grads(), inv_scale);
}

// fp16: a step some rank overflowed in updates nothing anywhere (params, optimizer state and
// its step count unchanged, as GradScaler skips optimizer.step()); the scale is halved.
// Otherwise clipping by the norm (train.clip_grad_norm), the optimizer and ZeRO's gather of
// the updated shards. False: skipped.
bool StepSync::update(StepEnd& e, double lr, bool finite, const ShardedGrads& shards) {
  const float inv_scale = 1.f / scaler_.scale();
  e.loss_scale = scaler_.scale();
  if (!scaler_.update(finite)) {
    e.skipped = true;
    return false;
  }
  tm_.begin(Phase::Optimizer);
  float grad_scale = 1.f;
  if (o_.clip_grad_norm > 0) {
    const double n = grad_norm(inv_scale, shards);
    grad_scale = clip_coef_from_norm(n, float(o_.clip_grad_norm));
    e.grad_norm = float(n);
  }
  opt_.step(float(lr), grad_scale * inv_scale);
  tm_.end(Phase::Optimizer);
  if (g_.dp) {
    tm_.wait_device();  // the all-gather sends the updated shard
    e.sync_s += g_.dp->gather_params();
  }
  return true;
}

StepEnd StepSync::finish(int64_t step, double lr, const StepLocal& mine) {
  StepEnd e;
  DataParallel* dp = g_.dp;
  if (dp) tm_.wait_device();  // the collectives wait for the gradients anyway; sync counts from here
  if (g_.stages) e.sync_s += g_.stages->reduce(ps_, arena_, dp);
  else if (dp) e.sync_s += dp->reduce_grads();
  // Gradients partial per tensor-parallel rank (ParamDesc::tp_partial), summed over the group
  // after the data-parallel reduction: the layer norms' under sequence parallelism, and a
  // Llama's replicated key/value heads' (ZeRO-2/3: those in the rank's reduced shards).
  const ShardedGrads shards = dp ? dp->sharded_grads() : ShardedGrads{};
  if (g_.tp) tp_sum_partial_grads(*g_.tp, ps_, arena_, shards);
  // The micro-batches' loss sums stayed on the device: one read (before an agreement that
  // needs it; otherwise at the end of the step, where the host waits anyway).
  const bool read_early = dp || g_.stages;
  if (read_early) e.loss_sum = mine.read_loss();
  bool finite = local_grads_finite(step);
  e.samples = mine.samples;
  e.stop = mine.stop;
  if (g_.stages) {
    // loss (the last stage's), stop, overflow, idle and busy time over the stages (one small
    // all-reduce)
    std::vector<double> v = {e.loss_sum, e.stop ? 1.0 : 0.0, finite ? 0.0 : 1.0, mine.idle_s, mine.busy_s};
    g_.stages->sum(ps_.backend(), v);
    e.loss_sum = v[0];
    e.stop = v[1] > 0;
    finite = v[2] == 0;
    e.pp_idle_s = v[3];
    e.pp_busy_s = v[4];
  }
  agree(e, finite);
  if (update(e, lr, finite, shards) && g_.stages) g_.stages->after_update(ps_, dp);
  if (!read_early) e.loss_sum = mine.read_loss();
  return e;
}

}  // namespace dtrain::parallel

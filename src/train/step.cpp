#include "train/step.h"

#include <chrono>
#include <cmath>

#include "core/clock.h"
#include "core/rng.h"
#include "data/image_loader.h"
#include "dist/data_parallel.h"
#include "obs/step_timer.h"
#include "train/step_graph.h"

namespace dtrain {

void next_train_batch(Session& s, ImageBatch& b, uint64_t synthetic_seed) {
  if (s.train_data) {
    s.train_data->next(b);
    return;
  }
  const int64_t n = s.cfg.i("train.batch_size");
  b.n = n;
  b.h = s.height;
  b.w = s.width;
  b.c = s.channels;
  b.images.resize(size_t(n * s.height * s.width * s.channels));
  b.labels.resize(size_t(n));
  Rng r(synthetic_seed, stream_id(0x53594e));
  for (auto& v : b.images) v = r.uniform() * 2.f - 1.f;
  for (auto& l : b.labels) l = int32_t(r.below(uint64_t(s.num_classes)));
}

StepStats train_step(Session& s, int64_t step, double lr, DistStep* d) {
  StepStats st;
  StepTimer& tm = *s.timer;  // device phases in stream order; data and sync on the host clock
  tm.start();
  Backend& be = *s.be;
  s.params.refresh_compute();  // mixed precision: the compute copy follows the master weights
  Tensor grads = s.params.flat_grads();
  be.fill(grads, 0.f);
  const int64_t accum = s.cfg.i("train.grad_accum");
  s.loss_slot(accum - 1);  // every slot exists before the first is written
  for (int64_t micro = 0; micro < accum; ++micro) {
    const StagedBatch sb = s.task->stage_batch(s, uint64_t(micro * s.world + s.rank), st.t);
    Tensor loss_sum = s.loss_slot(micro);
    const bool last_micro = micro + 1 == accum;
    if (d && d->buckets) d->buckets->begin_step(last_micro);
    // device work only from here to the end of backward: a CUDA graph may capture it
    auto body = [&] {
      Ctx ctx{be, *s.arena, true, {}, {}};
      if (d && d->sync_bn) ctx.sync_sum = [d](Tensor& t) { d->comm->allreduce(t, dist::ReduceOp::Sum); };
      if (d && d->buckets) ctx.grad_ready = d->buckets->hook();
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
    if (d && last_micro) {
      tm.wait_device();  // the collectives wait for the gradients anyway; sync counts from here
      if (d->buckets) st.sync_s += d->buckets->finish();
      if (d->zero_stage == 2) st.sync_s += d->zero->reduce_scatter_grads();
    }
    st.samples += sb.units;
    s.arena->reset();
  }
  // The micro-batches' loss sums stayed on the device; one read (data parallel: before the
  // all-reduce below; otherwise at the end of the step, where the host waits anyway).
  double loss_sum = 0;
  auto read_loss = [&] {
    for (double v : s.read_loss_slots(accum)) loss_sum += v;
  };
  // fp16: are this rank's (reduced) gradients finite? ZeRO-2 reduced only this rank's shard.
  bool finite = true;
  if (s.scaler.enabled()) {
    if (d && d->zero_stage == 2) {
      FlatRange r = d->zero->range();
      Tensor shard = grads.slice0(r.begin, r.end);
      finite = shard.numel() == 0 || be.all_finite(shard);
    } else {
      finite = be.all_finite(grads);
    }
  }
  // loss, samples, the stop flag and non-finite gradients summed over ranks (one small all-reduce)
  st.local_samples = st.samples;
  double samples_all = double(st.samples);
  if (d) {
    read_loss();
    auto ts = Clock::now();
    float v[4] = {float(loss_sum), float(st.samples), d->stop ? 1.f : 0.f, finite ? 0.f : 1.f};
    Buffer& buf = d->scratch(be);
    be.copy_from_host(buf.data(), v, sizeof v);
    Tensor t = buf.tensor(DType::F32, Shape{3});
    d->comm->allreduce(t, dist::ReduceOp::Sum);
    be.copy_to_host(v, buf.data(), sizeof v);
    loss_sum = v[0];
    samples_all = v[1];
    d->stop = v[2] > 0;
    finite = !(v[3] > 0);
    st.sync_s += seconds_since(ts);
  }
  const float inv_scale = 1.f / s.scaler.scale();
  st.loss_scale = s.scaler.scale();
  auto finish = [&] {
    if (!d) read_loss();  // data parallel: read before the all-reduce above
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
  const double max_norm = s.cfg.f("train.clip_grad_norm");
  if (max_norm > 0) {
    float norm = 0;
    if (d && d->zero_stage == 2) {
      // only this rank's shard of the gradient is reduced: norm from the shards' squares
      FlatRange r = d->zero->range();
      std::vector<float> g(size_t(r.end - r.begin));
      if (!g.empty()) be.copy_to_host(g.data(), static_cast<float*>(grads.data) + r.begin, g.size() * sizeof(float));
      double sq = 0;
      for (float x : g) sq += double(x) * double(x);
      sq *= double(inv_scale) * double(inv_scale);
      float v = float(sq);
      Buffer& buf = d->scratch(be);
      be.copy_from_host(buf.data(), &v, sizeof v);
      Tensor t = buf.tensor(DType::F32, Shape{1});
      d->comm->allreduce(t, dist::ReduceOp::Sum);
      be.copy_to_host(&v, buf.data(), sizeof v);
      norm = float(std::sqrt(double(v)));
      grad_scale = clip_coef_from_norm(norm, float(max_norm));
    } else {
      grad_scale = clip_coef(be, grads, float(max_norm), &norm, inv_scale);
    }
    st.grad_norm = norm;
  }
  s.opt->step(float(lr), grad_scale * inv_scale);
  tm.end(Phase::Optimizer);
  if (d && d->zero) {
    tm.wait_device();  // the all-gather sends the updated shard
    st.sync_s += d->zero->allgather_params();
  }
  return finish();
}

EvalStats evaluate(Session& s) {
  s.params.refresh_compute();
  return s.task->evaluate(s);
}

}  // namespace dtrain

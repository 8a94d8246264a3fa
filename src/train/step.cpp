#include "train/step.h"

#include <chrono>
#include <cmath>

#include "core/rng.h"
#include "data/image_loader.h"
#include "dist/data_parallel.h"

namespace dtrain {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct DeviceBatch {
  Tensor x, y;
};

DeviceBatch upload(Session& s, const ImageBatch& b) {
  DeviceBatch d;
  d.x = s.arena->alloc(DType::F32, Shape{b.n, b.h, b.w, b.c});
  d.y = s.arena->alloc(DType::I32, Shape{b.n});
  s.be->copy_from_host(d.x.data, b.images.data(), d.x.nbytes());
  s.be->copy_from_host(d.y.data, b.labels.data(), d.y.nbytes());
  return d;
}

// Sum of per-sample losses, in a fixed order (deterministic).
double host_sum(Session& s, const Tensor& losses, std::vector<float>& tmp) {
  tmp.resize(size_t(losses.numel()));
  s.be->copy_to_host(tmp.data(), losses.data, losses.nbytes());
  double sum = 0;
  for (float v : tmp) sum += v;
  return sum;
}
}  // namespace

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

namespace {
// The batch of a training micro-batch on the device: from the loader, or a synthetic batch.
// Synthetic batches are made once per stream and kept on the device (benchmarks measure
// compute alone, as the PyTorch twins do); stream = micro * world + rank, so N ranks with
// grad_accum A see the batches of one process with grad_accum A * N.
DeviceBatch training_batch(Session& s, ImageBatch& batch, uint64_t stream) {
  const uint64_t seed = uint64_t(s.cfg.i("run.seed"));
  if (s.train_data) {
    next_train_batch(s, batch, seed);
    return upload(s, batch);
  }
  const int64_t n = s.cfg.i("train.batch_size");
  Shape xs{n, s.height, s.width, s.channels};
  auto& slot = s.synthetic[stream];
  if (!slot.first.data()) {
    next_train_batch(s, batch, stream_id(seed, stream));
    slot.first = Buffer(*s.be, size_t(xs.numel()) * 4);
    slot.second = Buffer(*s.be, size_t(n) * 4);
    s.be->copy_from_host(slot.first.data(), batch.images.data(), size_t(xs.numel()) * 4);
    s.be->copy_from_host(slot.second.data(), batch.labels.data(), size_t(n) * 4);
  }
  batch.n = n;
  return DeviceBatch{slot.first.tensor(DType::F32, xs), slot.second.tensor(DType::I32, Shape{n})};
}
}  // namespace

StepStats train_step(Session& s, int64_t step, double lr, DistStep* d) {
  StepStats st;
  auto t0 = Clock::now();
  Backend& be = *s.be;
  Tensor grads = s.params.flat_grads();
  be.fill(grads, 0.f);
  const int64_t accum = s.cfg.i("train.grad_accum");
  const float smoothing = float(s.cfg.f("train.label_smoothing"));
  ImageBatch batch;
  std::vector<float> tmp;
  double loss_sum = 0;
  for (int64_t micro = 0; micro < accum; ++micro) {
    auto td = Clock::now();
    DeviceBatch db = training_batch(s, batch, uint64_t(micro * s.world + s.rank));
    st.t.data_s += since(td);

    auto tf = Clock::now();
    Ctx ctx{be, *s.arena, true};
    Tensor logits = s.model->forward(ctx, db.x);
    Tensor losses = s.arena->alloc(DType::F32, Shape{batch.n});
    Tensor dlogits = s.arena->alloc(DType::F32, logits.shape);
    // mean over the global batch of the step: every micro-batch contributes 1/(n*accum)
    be.softmax_xent(logits, db.y, smoothing, 1.0f / float(batch.n * accum), losses, dlogits);
    loss_sum += host_sum(s, losses, tmp);
    st.t.forward_s += since(tf);

    auto tb = Clock::now();
    const bool last_micro = micro + 1 == accum;
    if (d && d->buckets) {
      d->buckets->begin_step(last_micro);
      ctx.grad_ready = d->buckets->hook();
    }
    s.model->backward(ctx, dlogits);
    be.synchronize();
    st.t.backward_s += since(tb);
    if (d && last_micro) {
      if (d->buckets) st.sync_s += d->buckets->finish();
      if (d->zero_stage == 2) st.sync_s += d->zero->reduce_scatter_grads();
    }
    st.samples += batch.n;
    s.arena->reset();
  }
  // loss, samples and the stop flag summed over ranks (one small all-reduce)
  double samples_all = double(st.samples);
  if (d) {
    auto ts = Clock::now();
    float v[3] = {float(loss_sum), float(st.samples), d->stop ? 1.f : 0.f};
    Buffer buf(be, sizeof v);
    be.copy_from_host(buf.data(), v, sizeof v);
    Tensor t = buf.tensor(DType::F32, Shape{3});
    d->comm->allreduce(t, dist::ReduceOp::Sum);
    be.copy_to_host(v, buf.data(), sizeof v);
    loss_sum = v[0];
    samples_all = v[1];
    d->stop = v[2] > 0;
    st.sync_s += since(ts);
  }
  auto to = Clock::now();
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
      float v = float(sq);
      Buffer buf(be, sizeof v);
      be.copy_from_host(buf.data(), &v, sizeof v);
      Tensor t = buf.tensor(DType::F32, Shape{1});
      d->comm->allreduce(t, dist::ReduceOp::Sum);
      be.copy_to_host(&v, buf.data(), sizeof v);
      norm = float(std::sqrt(double(v)));
      grad_scale = clip_coef_from_norm(norm, float(max_norm));
    } else {
      grad_scale = clip_coef(be, grads, float(max_norm), &norm);
    }
    st.grad_norm = norm;
  }
  s.opt->step(float(lr), grad_scale);
  be.synchronize();
  if (d && d->zero) st.sync_s += d->zero->allgather_params();
  st.t.optimizer_s = since(to);
  st.samples = int64_t(samples_all);
  st.loss = loss_sum / samples_all;
  st.t.total_s = since(t0);
  return st;
}

EvalStats evaluate(Session& s) {
  EvalStats ev;
  if (!s.eval_data) return ev;
  Backend& be = *s.be;
  ImageLoader& L = *s.eval_data;
  L.restore(LoaderState{0, 0});
  int64_t batches = L.batches_per_epoch();
  const int64_t max_batches = s.cfg.i("eval.max_batches");
  if (max_batches > 0) batches = std::min(batches, max_batches);
  ImageBatch batch;
  std::vector<float> tmp, logits_h;
  double loss_sum = 0;
  int64_t correct = 0;
  for (int64_t i = 0; i < batches; ++i) {
    L.next(batch);
    DeviceBatch d = upload(s, batch);
    Ctx ctx{be, *s.arena, false};
    Tensor logits = s.model->forward(ctx, d.x);
    Tensor losses = s.arena->alloc(DType::F32, Shape{batch.n});
    Tensor none;
    be.softmax_xent(logits, d.y, 0.f, 1.f, losses, none);
    loss_sum += host_sum(s, losses, tmp);
    logits_h.resize(size_t(logits.numel()));
    be.copy_to_host(logits_h.data(), logits.data, logits.nbytes());
    const int64_t C = logits.shape[1];
    for (int64_t r = 0; r < batch.n; ++r) {
      const float* row = logits_h.data() + r * C;
      int64_t best = 0;
      for (int64_t c = 1; c < C; ++c)
        if (row[c] > row[best]) best = c;
      correct += best == batch.labels[size_t(r)];
    }
    ev.samples += batch.n;
    s.arena->reset();
  }
  if (ev.samples) {
    ev.loss = loss_sum / double(ev.samples);
    ev.accuracy = double(correct) / double(ev.samples);
  }
  return ev;
}

}  // namespace dtrain

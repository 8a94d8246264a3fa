#include "train/step.h"

#include <chrono>

#include "core/rng.h"
#include "data/image_loader.h"

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
// The batch of a training micro-batch on the device: from the loader, or the synthetic
// batch (made once, then reused).
DeviceBatch training_batch(Session& s, ImageBatch& batch, uint64_t seed) {
  if (s.train_data) {
    next_train_batch(s, batch, seed);
    return upload(s, batch);
  }
  const int64_t n = s.cfg.i("train.batch_size");
  Shape xs{n, s.height, s.width, s.channels};
  if (!s.synthetic_x.data()) {
    next_train_batch(s, batch, seed);
    s.synthetic_x = Buffer(*s.be, size_t(xs.numel()) * 4);
    s.synthetic_y = Buffer(*s.be, size_t(n) * 4);
    s.be->copy_from_host(s.synthetic_x.data(), batch.images.data(), size_t(xs.numel()) * 4);
    s.be->copy_from_host(s.synthetic_y.data(), batch.labels.data(), size_t(n) * 4);
  }
  batch.n = n;
  return DeviceBatch{s.synthetic_x.tensor(DType::F32, xs), s.synthetic_y.tensor(DType::I32, Shape{n})};
}
}  // namespace

StepStats train_step(Session& s, int64_t step, double lr) {
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
    DeviceBatch d = training_batch(s, batch, stream_id(uint64_t(s.cfg.i("run.seed")), uint64_t(step), uint64_t(micro)));
    st.t.data_s += since(td);

    auto tf = Clock::now();
    Ctx ctx{be, *s.arena, true};
    Tensor logits = s.model->forward(ctx, d.x);
    Tensor losses = s.arena->alloc(DType::F32, Shape{batch.n});
    Tensor dlogits = s.arena->alloc(DType::F32, logits.shape);
    // mean over the global batch of the step: every micro-batch contributes 1/(n*accum)
    be.softmax_xent(logits, d.y, smoothing, 1.0f / float(batch.n * accum), losses, dlogits);
    loss_sum += host_sum(s, losses, tmp);
    st.t.forward_s += since(tf);

    auto tb = Clock::now();
    s.model->backward(ctx, dlogits);
    be.synchronize();
    st.t.backward_s += since(tb);
    st.samples += batch.n;
    s.arena->reset();
  }
  auto to = Clock::now();
  float grad_scale = 1.f;
  const double max_norm = s.cfg.f("train.clip_grad_norm");
  if (max_norm > 0) {
    float norm = 0;
    grad_scale = clip_coef(be, grads, float(max_norm), &norm);
    st.grad_norm = norm;
  }
  s.opt->step(float(lr), grad_scale);
  be.synchronize();
  st.t.optimizer_s = since(to);
  st.loss = loss_sum / double(st.samples);
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

// ClassifyTask: ResNet image classification (webdataset or synthetic images).
#include <chrono>

#include "core/clock.h"
#include "core/rng.h"
#include "models/resnet.h"
#include "obs/step_timer.h"
#include "train/loader_options.h"
#include "train/session.h"
#include "train/step.h"
#include "train/task.h"

namespace dtrain {

namespace {

// The next training batch: from the loader, or a synthetic one from `synthetic_seed`.
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

std::unique_ptr<ImageLoader> make_loader(const Config& cfg, const std::string& split, bool training, int rank,
                                         int world) {
  ImageLoaderOptions o;
  fill_loader_options(o, cfg, split, training, rank, world);
  o.num_classes_expected = int(cfg.i("model.num_classes"));
  o.channels_expected = int(cfg.i("model.in_channels"));
  return std::make_unique<ImageLoader>(o);
}

// The batch of a training micro-batch on the device: from the loader (staged into the
// task's buffers x_buf / y_buf), or a synthetic batch. Synthetic batches are made once per
// stream and kept on the device (benchmarks measure compute alone, as the PyTorch twins
// do); stream = micro * world + rank, so N ranks with grad_accum A see the batches of one
// process with grad_accum A * N.
DeviceBatch training_batch(Session& s, ImageBatch& batch, uint64_t stream, Buffer& x_buf, Buffer& y_buf) {
  const uint64_t seed = uint64_t(s.cfg.i("run.seed"));
  if (s.train_data) {
    next_train_batch(s, batch, seed);
    return DeviceBatch{stage_upload(*s.be, x_buf, batch.images.data(), DType::F32, Shape{batch.n, batch.h, batch.w, batch.c}),
                       stage_upload(*s.be, y_buf, batch.labels.data(), DType::I32, Shape{batch.n})};
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

class ClassifyTask : public Task {
 public:
  TaskKind kind() const override { return TaskKind::Classify; }

  EvalReport report(const EvalStats& ev) const override {
    EvalReport r;
    const std::string top5 = ev.accuracy_top5 >= 0 ? fmt::format(" | top-5 {:.2f}%", 100 * ev.accuracy_top5) : "";
    r.line = fmt::format("test loss {:.4f} | test accuracy {:.2f}%{} | {} samples", ev.loss, 100 * ev.accuracy, top5,
                         ev.samples);
    r.summary = fmt::format("test accuracy {:.2f}% | test loss {:.4f}", 100 * ev.accuracy, ev.loss);
    r.fields["eval_accuracy"] = ev.accuracy;
    r.scalars.emplace_back("eval/accuracy", ev.accuracy);
    if (ev.accuracy_top5 >= 0) {
      r.fields["eval_accuracy_top5"] = ev.accuracy_top5;
      r.scalars.emplace_back("eval/accuracy_top5", ev.accuracy_top5);
    }
    r.end_fields["eval_accuracy"] = ev.accuracy;
    r.gauge = "accuracy";
    r.gauge_value = ev.accuracy;
    r.best = {"eval_accuracy", ev.accuracy, true};
    return r;
  }

  void build_model(Session& s) override {
    const Config& cfg = s.cfg;
    ResNetSpec spec;
    spec.depth = int(cfg.i("model.depth"));
    spec.width = int(cfg.i("model.width"));
    spec.stem = cfg.s("model.stem");
    spec.num_classes = int(cfg.i("model.num_classes"));
    spec.in_channels = int(cfg.i("model.in_channels"));
    spec.zero_init_residual = cfg.b("model.zero_init_residual");
    s.model = build_resnet(spec, s.params);
  }

  StagedBatch stage_batch(Session& s, uint64_t stream, StepTimes& t) override {
    auto td = Clock::now();
    staged_ = training_batch(s, batch_, stream, x_buf_, y_buf_);
    t.data_s += seconds_since(td);
    return StagedBatch{staged_.x.dim(0), staged_.x, staged_.y};
  }

  Tensor forward_loss(Session& s, Ctx& ctx, int64_t accum, Tensor& loss_sum) override {
    Backend& be = *s.be;
    const int64_t n = staged_.x.dim(0);
    const float smoothing = float(s.cfg.f("train.label_smoothing"));
    Tensor logits = s.model->forward(ctx, to_compute(s, staged_.x));
    Tensor losses = s.arena->alloc(DType::F32, Shape{n});
    Tensor dlogits = s.arena->alloc(logits.dtype, logits.shape);
    // mean over the global batch of the step: every micro-batch contributes 1/(n*accum)
    // (times the fp16 loss scale; 1 otherwise)
    be.softmax_xent(logits, staged_.y, smoothing, s.scaler.scale() / float(n * accum), losses, dlogits);
    be.sum_into(losses, 1.0, loss_sum, false);
    return dlogits;
  }

  bool has_eval() const override { return eval_ != nullptr; }

  EvalStats evaluate(Session& s) override {
    EvalStats ev;
    if (!s.eval_data) return ev;
    Backend& be = *s.be;
    ImageLoader& L = *s.eval_data;
    L.restore(LoaderState{0, 0});
    int64_t batches = L.batches_per_epoch();
    const int64_t max_batches = s.cfg.i("eval.max_batches");
    if (max_batches > 0) batches = std::min(batches, max_batches);
    ImageBatch batch;
    std::vector<float> logits_h;
    double loss_sum = 0;
    int64_t correct = 0, correct5 = 0, classes = 0;
    for (int64_t i = 0; i < batches; ++i) {
      L.next(batch);
      DeviceBatch d = upload(s, batch);
      Ctx ctx{be, *s.arena, false, {}, {}};
      Tensor logits = s.model->forward(ctx, to_compute(s, d.x));
      Tensor losses = s.arena->alloc(DType::F32, Shape{batch.n});
      Tensor none;
      be.softmax_xent(logits, d.y, 0.f, 1.f, losses, none);
      loss_sum += s.be->sum(losses);
      copy_to_host_f32(be, *s.arena, logits, logits_h);
      const int64_t C = classes = logits.shape[1];
      for (int64_t r = 0; r < batch.n; ++r) {
        // the label's rank: logits above it, and equal ones before it (ties go to the lower
        // class, as the top-1 prediction is the first maximum)
        const float* row = logits_h.data() + r * C;
        const int64_t y = batch.labels[size_t(r)];
        int64_t rank = 0;
        for (int64_t c = 0; c < C; ++c) rank += row[c] > row[y] || (row[c] == row[y] && c < y);
        correct += rank == 0;
        correct5 += rank < 5;
      }
      ev.samples += batch.n;
      s.arena->reset();
    }
    if (ev.samples) {
      ev.loss = loss_sum / double(ev.samples);
      ev.accuracy = double(correct) / double(ev.samples);
      if (classes > 5) ev.accuracy_top5 = double(correct5) / double(ev.samples);
    }
    return ev;
  }

  bool data_state(LoaderState& st, uint64_t&) const override {
    if (!train_) return false;
    st = train_->state();
    return true;
  }
  void restore_data(const LoaderState& st, uint64_t) override {
    if (train_) train_->restore(st);
  }
  int64_t batches_per_epoch() const override { return train_ ? train_->batches_per_epoch() : 0; }

  ImageLoader* train_ = nullptr;
  ImageLoader* eval_ = nullptr;

 private:
  ImageBatch batch_;
  DeviceBatch staged_;
  Buffer x_buf_, y_buf_;  // the loader's batches on the device (fixed addresses)
};

}  // namespace

std::unique_ptr<Task> make_classify_task(Session& s, bool with_train_data, bool with_eval_data, int rank,
                                         int world) {
  const Config& cfg = s.cfg;
  auto t = std::make_unique<ClassifyTask>();
  const std::string data_kind = cfg.s("data.kind");
  s.channels = cfg.i("model.in_channels");
  s.num_classes = cfg.i("model.num_classes");
  if (data_kind == "webdataset") {
    if (with_train_data) s.train_data = make_loader(cfg, cfg.s("data.train_split"), true, rank, world);
    if (with_eval_data) s.eval_data = make_loader(cfg, cfg.s("data.eval_split"), false, 0, 1);
    ImageLoader* any = s.train_data ? s.train_data.get() : s.eval_data.get();
    if (any) {
      s.height = any->height();
      s.width = any->width();
    }
  } else if (data_kind == "synthetic") {
    s.height = cfg.i("data.synthetic_height");
    s.width = cfg.i("data.synthetic_width");
  } else {
    user_error("{}: data.kind = \"{}\" does not fit model.kind = \"resnet\" (expected webdataset or synthetic)",
               cfg.source(), data_kind);
  }
  const std::vector<double> mean = cfg.fv("data.mean"), stdv = cfg.fv("data.std");
  if (!mean.empty() && int64_t(mean.size()) != s.channels)
    user_error("{}: data.mean has {} values, expected {} (model.in_channels)", cfg.source(), mean.size(), s.channels);
  if (!stdv.empty() && int64_t(stdv.size()) != s.channels)
    user_error("{}: data.std has {} values, expected {} (model.in_channels)", cfg.source(), stdv.size(), s.channels);
  t->train_ = s.train_data.get();
  t->eval_ = s.eval_data.get();
  return t;
}

}  // namespace dtrain

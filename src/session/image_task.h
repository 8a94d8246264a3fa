#pragma once
// ImageTask: what the image tasks share (ClassifyTask: ResNet, labels [N]; SegmentTask:
// U-Net, masks [N,H,W]). Their loader (data::ImageLoader or data::SegLoader, alike but for
// the labels), the staging of training batches into buffers the task keeps (fixed device
// addresses), the synthetic batches (data.kind = "synthetic"), the data position and the
// evaluation loop; a task adds its model, its loss, its per-batch scores and its report.
#include <algorithm>
#include <memory>
#include <vector>

#include "core/clock.h"
#include "core/progress.h"
#include "core/rng.h"
#include "session/runtime.h"
#include "session/task.h"

namespace dtrain {

template <class Loader, class Batch>
class ImageTask : public Task {
 public:
  bool has_eval() const override { return eval_ != nullptr; }

  // The batch of a training micro-batch on the device: from the loader (staged into
  // x_buf_ / y_buf_), or a synthetic batch. Synthetic batches are made once per stream and
  // kept on the device (benchmarks measure compute alone, as the PyTorch twins do); stream
  // = micro * world + rank, so N ranks with grad_accum A see the batches of one process
  // with grad_accum A * N.
  StagedBatch stage_batch(Runtime& s, uint64_t stream, StepTimes& t) override {
    auto td = Clock::now();
    if (train_) {
      train_->next(batch_);
      const Batch& b = batch_;
      staged_.x = stage_upload(*s.be, x_buf_, b.images.data(), DType::F32, Shape{b.n, b.h, b.w, b.c});
      staged_.y = stage_upload(*s.be, y_buf_, b.labels.data(), DType::I32, label_shape(b.n, b.h, b.w));
    } else {
      staged_ = synthetic_batch(s, stream);
    }
    t.data_s += seconds_since(td);
    return StagedBatch{staged_.x.dim(0), staged_.x, staged_.y};
  }

  // Every batch of the eval split (at most eval.max_batches): the loss (summed over the
  // samples by eval_loss) and the task's scores of the logits on the host.
  EvalStats evaluate(Runtime& s) override {
    EvalStats ev;
    if (!eval_) return ev;
    eval_->restore(LoaderState{0, 0});
    int64_t batches = eval_->batches_per_epoch();
    const int64_t max_batches = s.cfg.eval.max_batches;
    if (max_batches > 0) batches = std::min(batches, max_batches);
    begin_eval(s);
    Batch b;
    std::vector<float> logits_h;
    double loss_sum = 0;
    Progress progress("eval", batches, "batches");  // a line on a terminal (or every 10 s) on long evaluations
    for (int64_t i = 0; i < batches; ++i, progress.add(1)) {
      eval_->next(b);
      Tensor x = s.arena->alloc(DType::F32, Shape{b.n, b.h, b.w, b.c});
      Tensor y = s.arena->alloc(DType::I32, label_shape(b.n, b.h, b.w));
      s.be->copy_from_host(x.data, b.images.data(), x.nbytes());
      s.be->copy_from_host(y.data, b.labels.data(), y.nbytes());
      Ctx ctx{*s.be, *s.arena, false, {}, {}};
      ctx.units = s.units;
      Tensor logits = s.model->forward(ctx, to_compute(s, x));
      loss_sum += eval_loss(s, logits, y, b.n);
      copy_to_host_f32(*s.be, *s.arena, logits, logits_h);
      score(b, logits, logits_h);
      ev.samples += b.n;
      s.arena->reset();
    }
    if (ev.samples) {
      ev.loss = loss_sum / double(ev.samples);
      end_eval(ev);
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

  // Sets the runtime's geometry: model.in_channels and model.num_classes; the image size of
  // the loaders (either; data.synthetic_height/width when there is none).
  void set_geometry(Runtime& s) const {
    const Config& cfg = s.cfg;
    s.channels = cfg.model.in_channels;
    s.num_classes = cfg.model.num_classes;
    const Loader* any = train_ ? train_.get() : eval_.get();
    if (any) {
      s.height = any->height();
      s.width = any->width();
    } else if (cfg.data.kind == "synthetic") {
      s.height = cfg.data.synthetic_height;
      s.width = cfg.data.synthetic_width;
    }
  }

  std::unique_ptr<Loader> train_, eval_;  // null: no training data (synthetic) / no eval split

 protected:
  struct DeviceBatch {
    Tensor x, y;
  };
  // The labels of n images of h x w: one per image, or one per pixel.
  virtual Shape label_shape(int64_t n, int64_t h, int64_t w) const = 0;
  // The random numbers of synthetic stream `stream` (run.seed = seed).
  virtual Rng synthetic_rng(uint64_t seed, uint64_t stream) const = 0;
  virtual void begin_eval(Runtime& s) = 0;
  // The loss of one evaluation batch of n samples, summed over them.
  virtual double eval_loss(Runtime& s, const Tensor& logits, const Tensor& y, int64_t n) = 0;
  // Scores the batch's logits (logits_h: on the host, f32).
  virtual void score(const Batch& b, const Tensor& logits, const std::vector<float>& logits_h) = 0;
  // The metrics of the evaluation (samples and loss are set).
  virtual void end_eval(EvalStats& ev) = 0;

  DeviceBatch staged_;  // the micro-batch staged last

 private:
  // Uniform images in [-1, 1] and uniform labels, made once per stream.
  DeviceBatch synthetic_batch(Runtime& s, uint64_t stream) {
    const int64_t n = s.cfg.train.batch_size;
    const Shape xs{n, s.height, s.width, s.channels}, ys = label_shape(n, s.height, s.width);
    auto& slot = s.synthetic[stream];
    if (!slot.first.data()) {
      Rng r = synthetic_rng(uint64_t(s.cfg.run.seed), stream);
      std::vector<float> img(size_t(xs.numel()));
      std::vector<int32_t> labels(size_t(ys.numel()));
      for (auto& v : img) v = r.uniform() * 2.f - 1.f;
      for (auto& v : labels) v = int32_t(r.below(uint64_t(s.num_classes)));
      slot.first = Buffer(*s.be, img.size() * 4);
      slot.second = Buffer(*s.be, labels.size() * 4);
      s.be->copy_from_host(slot.first.data(), img.data(), img.size() * 4);
      s.be->copy_from_host(slot.second.data(), labels.data(), labels.size() * 4);
    }
    return DeviceBatch{slot.first.tensor(DType::F32, xs), slot.second.tensor(DType::I32, ys)};
  }

  Batch batch_;
  Buffer x_buf_, y_buf_;  // the loader's batches on the device (fixed addresses)
};

}  // namespace dtrain

// SegmentTask: U-Net semantic segmentation on WebDataset shards with KEY.mask.png, or on
// random images and masks (data.kind = "synthetic", benchmarks).
// Loss per micro-batch = mean pixel cross-entropy + train.dice_weight * soft Dice loss
// (Backend::softmax_dice, smooth 1). Metrics: loss, mean IoU, mean Dice, per-class IoU.
#include <algorithm>
#include <cmath>
#include <chrono>

#include "core/clock.h"
#include "core/rng.h"
#include "data/seg_loader.h"
#include "models/unet.h"
#include "nn/seg_metrics.h"
#include "obs/step_timer.h"
#include "train/loader_options.h"
#include "train/session.h"
#include "train/step.h"
#include "train/task.h"

namespace dtrain {

namespace {

constexpr float kDiceSmooth = 1.f;

std::unique_ptr<data::SegLoader> make_seg_loader(const Config& cfg, const std::string& split, bool training,
                                                 int rank, int world) {
  data::SegLoaderOptions o;
  fill_loader_options(o, cfg, split, training, rank, world);
  o.num_classes = int(cfg.i("model.num_classes"));
  return std::make_unique<data::SegLoader>(o);
}

class SegmentTask : public Task {
 public:
  TaskKind kind() const override { return TaskKind::Segment; }

  EvalReport report(const EvalStats& ev) const override {
    EvalReport r;
    std::string per_class;
    nlohmann::json ious = nlohmann::json::array();
    for (size_t k = 0; k < ev.class_iou.size(); ++k) {
      const double v = ev.class_iou[k];
      per_class += fmt::format("{}{:.3f}", k ? " " : "", v);
      ious.push_back(std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr));
      if (std::isfinite(v)) r.scalars.emplace_back(fmt::format("eval/iou_class_{}", k), v);
    }
    r.line = fmt::format("val loss {:.4f} | mIoU {:.4f} | mDice {:.4f} | IoU per class [{}] | {} samples", ev.loss,
                         ev.mean_iou, ev.mean_dice, per_class, ev.samples);
    r.summary = fmt::format("val mIoU {:.4f} | val mDice {:.4f} | val loss {:.4f}", ev.mean_iou, ev.mean_dice, ev.loss);
    r.fields["eval_miou"] = ev.mean_iou;
    r.fields["eval_dice"] = ev.mean_dice;
    r.fields["eval_pixel_accuracy"] = ev.pixel_accuracy;
    r.fields["eval_class_iou"] = ious;
    r.scalars.emplace_back("eval/miou", ev.mean_iou);
    r.scalars.emplace_back("eval/dice", ev.mean_dice);
    r.end_fields["eval_miou"] = ev.mean_iou;
    r.end_fields["eval_dice"] = ev.mean_dice;
    r.gauge = "miou";
    r.gauge_value = ev.mean_iou;
    r.best = {"eval_miou", ev.mean_iou, true};
    return r;
  }

  void build_model(Session& s) override {
    const Config& cfg = s.cfg;
    UNetSpec spec;
    spec.depth = cfg.is_set("model.depth") ? int(cfg.i("model.depth")) : 4;
    spec.base_channels = int(cfg.i("model.base_channels"));
    spec.in_channels = int(cfg.i("model.in_channels"));
    spec.num_classes = int(cfg.i("model.num_classes"));
    spec.upsample = cfg.s("model.upsample");
    s.model = build_unet(spec, s.params);
  }

  struct Dev {
    Tensor x, y;
  };
  Dev upload(Session& s, const data::SegBatch& b) {
    Dev d;
    d.x = s.arena->alloc(DType::F32, Shape{b.n, b.h, b.w, b.c});
    d.y = s.arena->alloc(DType::I32, Shape{b.n, b.h, b.w});
    s.be->copy_from_host(d.x.data, b.images.data(), d.x.nbytes());
    s.be->copy_from_host(d.y.data, b.labels.data(), d.y.nbytes());
    return d;
  }

  // loss_sum (f64 [1] on the device) = units * (CE mean over pixels + w * Dice) of one batch,
  // without synchronising; dlogits (when dout) scaled by `scale`.
  void loss(Session& s, const Tensor& logits, const Tensor& y, float scale, double units, Tensor& loss_sum,
            Tensor* dout) {
    Backend& be = *s.be;
    const int64_t K = logits.shape[logits.ndim() - 1];
    const int64_t P = logits.numel() / K;
    Tensor flat = logits.view(Shape{P, K});
    Tensor yflat = y.view(Shape{P});
    Tensor losses = s.arena->alloc(DType::F32, Shape{P});
    Tensor dce, ddice;
    if (dout) {
      dce = s.arena->alloc(logits.dtype, Shape{P, K});
      ddice = s.arena->alloc(logits.dtype, logits.shape);
    }
    be.softmax_xent(flat, yflat, 0.f, scale / float(P), losses, dce);
    be.sum_into(losses, units / double(P), loss_sum, false);
    const float w = float(s.cfg.f("train.dice_weight"));
    if (w > 0) {
      Tensor dice = s.arena->alloc(DType::F32, Shape{1});
      be.softmax_dice(logits, y, kDiceSmooth, scale * w, dice, ddice);
      be.sum_into(dice, units * double(w), loss_sum, true);
      if (dout) {
        Tensor dflat = ddice.view(Shape{P, K});
        be.add(dce, dflat, dce);
      }
    }
    if (dout) *dout = dce.view(logits.shape);
  }

  // data.kind = "synthetic": uniform random images and a random class per pixel, made once
  // per stream (micro * world + rank) and kept on the device (benchmarks measure compute).
  Dev synthetic_batch(Session& s, uint64_t stream) {
    const int64_t n = s.cfg.i("train.batch_size"), h = s.height, w = s.width, c = s.channels;
    auto& slot = s.synthetic[stream];
    if (!slot.first.data()) {
      Rng r(stream_id(uint64_t(s.cfg.i("run.seed")), stream, 0x534547));
      std::vector<float> img(size_t(n * h * w * c));
      std::vector<int32_t> mask(size_t(n * h * w));
      for (auto& v : img) v = r.uniform() * 2.f - 1.f;
      for (auto& v : mask) v = int32_t(r.below(uint64_t(s.num_classes)));
      slot.first = Buffer(*s.be, img.size() * 4);
      slot.second = Buffer(*s.be, mask.size() * 4);
      s.be->copy_from_host(slot.first.data(), img.data(), img.size() * 4);
      s.be->copy_from_host(slot.second.data(), mask.data(), mask.size() * 4);
    }
    batch_.n = n;
    return Dev{slot.first.tensor(DType::F32, Shape{n, h, w, c}), slot.second.tensor(DType::I32, Shape{n, h, w})};
  }

  StagedBatch stage_batch(Session& s, uint64_t stream, StepTimes& t) override {
    auto td = Clock::now();
    if (train_) {
      train_->next(batch_);
      const data::SegBatch& b = batch_;
      staged_.x = stage_upload(*s.be, x_buf_, b.images.data(), DType::F32, Shape{b.n, b.h, b.w, b.c});
      staged_.y = stage_upload(*s.be, y_buf_, b.labels.data(), DType::I32, Shape{b.n, b.h, b.w});
    } else {
      staged_ = synthetic_batch(s, stream);
    }
    t.data_s += seconds_since(td);
    return StagedBatch{staged_.x.dim(0), staged_.x, staged_.y};
  }

  Tensor forward_loss(Session& s, Ctx& ctx, int64_t accum, Tensor& loss_sum) override {
    Tensor logits = s.model->forward(ctx, to_compute(s, staged_.x));
    Tensor dout;
    loss(s, logits, staged_.y, s.scaler.scale() / float(accum), double(staged_.x.dim(0)), loss_sum, &dout);
    return dout;
  }

  bool has_eval() const override { return eval_ != nullptr; }

  EvalStats evaluate(Session& s) override {
    EvalStats ev;
    if (!eval_) return ev;
    eval_->restore(LoaderState{0, 0});
    int64_t batches = eval_->batches_per_epoch();
    const int64_t max_batches = s.cfg.i("eval.max_batches");
    if (max_batches > 0) batches = std::min(batches, max_batches);
    SegConfusion conf(int(s.cfg.i("model.num_classes")));
    data::SegBatch b;
    std::vector<float> logits_h;
    double loss_sum = 0;
    for (int64_t i = 0; i < batches; ++i) {
      eval_->next(b);
      Dev d = upload(s, b);
      Ctx ctx{*s.be, *s.arena, false, {}, {}};
      Tensor logits = s.model->forward(ctx, to_compute(s, d.x));
      Tensor acc = s.loss_slot(0);
      loss(s, logits, d.y, 1.f, double(b.n), acc, nullptr);
      loss_sum += s.read_loss_slots(1)[0];
      copy_to_host_f32(*s.be, *s.arena, logits, logits_h);
      conf.add_logits(logits_h.data(), b.labels.data(), b.n * b.h * b.w);
      ev.samples += b.n;
      s.arena->reset();
    }
    if (ev.samples) {
      ev.loss = loss_sum / double(ev.samples);
      SegScores sc = seg_scores(conf);
      ev.mean_iou = sc.mean_iou;
      ev.mean_dice = sc.mean_dice;
      ev.pixel_accuracy = sc.pixel_accuracy;
      ev.accuracy = sc.pixel_accuracy;
      ev.class_iou = sc.iou;
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

  std::unique_ptr<data::SegLoader> train_, eval_;

 private:
  data::SegBatch batch_;
  Dev staged_;
  Buffer x_buf_, y_buf_;  // the loader's batches on the device (fixed addresses)
};

}  // namespace

std::unique_ptr<Task> make_segment_task(Session& s, bool with_train_data, bool with_eval_data, int rank,
                                        int world) {
  const Config& cfg = s.cfg;
  const bool synthetic = cfg.s("data.kind") == "synthetic";
  if (cfg.s("data.kind") != "webdataset" && !synthetic)
    user_error("{}: data.kind = \"{}\" does not fit model.kind = \"unet\" (expected webdataset with KEY.mask.png, "
               "or synthetic)",
               cfg.source(), cfg.s("data.kind"));
  if (synthetic) {
    with_train_data = with_eval_data = false;
    s.height = cfg.i("data.synthetic_height");
    s.width = cfg.i("data.synthetic_width");
  }
  auto t = std::make_unique<SegmentTask>();
  if (with_train_data) t->train_ = make_seg_loader(cfg, cfg.s("data.train_split"), true, rank, world);
  if (with_eval_data) {
    const std::string split = cfg.is_set("data.eval_split") ? cfg.s("data.eval_split") : "val";
    t->eval_ = make_seg_loader(cfg, split, false, 0, 1);
  }
  data::SegLoader* any = t->train_ ? t->train_.get() : t->eval_.get();
  s.channels = cfg.i("model.in_channels");
  s.num_classes = cfg.i("model.num_classes");
  if (any) {
    s.height = any->height();
    s.width = any->width();
    if (any->channels() != s.channels)
      user_error("{}: model.in_channels = {} but the images of {} have {} channels", cfg.source(), s.channels,
                 cfg.s("data.path"), any->channels());
  }
  return t;
}

}  // namespace dtrain

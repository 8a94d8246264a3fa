// SegmentTask: U-Net semantic segmentation on WebDataset shards with KEY.mask.png, or on
// random images and masks (data.kind = "synthetic", benchmarks).
// Loss per micro-batch = mean pixel cross-entropy + train.dice_weight * soft Dice loss
// (Backend::softmax_dice, smooth 1). Metrics: loss, mean IoU, mean Dice, per-class IoU.
#include <cmath>

#include "data/seg_loader.h"
#include "models/unet.h"
#include "nn/seg_metrics.h"
#include "session/image_task.h"
#include "session/loader_options.h"

namespace dtrain {

namespace {

constexpr float kDiceSmooth = 1.f;

std::unique_ptr<data::SegLoader> make_seg_loader(const Config& cfg, const std::string& split, bool training,
                                                 int rank, int world) {
  data::SegLoaderOptions o;
  fill_loader_options(o, cfg, split, training, rank, world);
  o.num_classes = int(cfg.model.num_classes);
  return std::make_unique<data::SegLoader>(o);
}

class SegmentTask : public ImageTask<data::SegLoader, data::SegBatch> {
 public:
  TaskKind kind() const override { return TaskKind::Segment; }

  void build_model(Runtime& s) override {
    const Config& cfg = s.cfg;
    UNetSpec spec;
    spec.depth = cfg.given(cfg.model.depth) ? int(cfg.model.depth) : 4;
    spec.base_channels = int(cfg.model.base_channels);
    spec.in_channels = int(cfg.model.in_channels);
    spec.num_classes = int(cfg.model.num_classes);
    spec.upsample = cfg.model.upsample;
    s.model = build_unet(spec, s.params);
  }

  Tensor forward_loss(Runtime& s, Ctx& ctx, int64_t accum, Tensor& loss_sum) override {
    Tensor logits = s.model->forward(ctx, to_compute(s, staged_.x));
    Tensor dout;
    loss(s, logits, staged_.y, s.scaler.scale() / float(accum), double(staged_.x.dim(0)), loss_sum, &dout);
    return dout;
  }

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
    r.line = fmt::format("{} loss {:.4f} | mIoU {:.4f} | mDice {:.4f} | IoU per class [{}] | {} samples", eval_split,
                         ev.loss, ev.mean_iou, ev.mean_dice, per_class, ev.samples);
    r.summary = fmt::format("{0} mIoU {1:.4f} | {0} mDice {2:.4f} | {0} loss {3:.4f}", eval_split, ev.mean_iou,
                            ev.mean_dice, ev.loss);
    r.headline("miou", ev.mean_iou);
    r.fields["eval_dice"] = ev.mean_dice;
    r.fields["eval_pixel_accuracy"] = ev.pixel_accuracy;
    r.fields["eval_class_iou"] = ious;
    r.scalars.emplace_back("eval/dice", ev.mean_dice);
    r.end_fields["eval_dice"] = ev.mean_dice;
    r.best = {"eval_miou", ev.mean_iou, true};
    return r;
  }

 protected:
  Shape label_shape(int64_t n, int64_t h, int64_t w) const override { return Shape{n, h, w}; }
  Rng synthetic_rng(uint64_t seed, uint64_t stream) const override { return Rng(stream_id(seed, stream, 0x534547)); }

  void begin_eval(Runtime& s) override { conf_ = SegConfusion(int(s.cfg.model.num_classes)); }

  double eval_loss(Runtime& s, const Tensor& logits, const Tensor& y, int64_t n) override {
    Tensor acc = s.loss_slot(0);
    loss(s, logits, y, 1.f, double(n), acc, nullptr);
    return s.read_loss_slots(1)[0];
  }

  void score(const data::SegBatch& b, const Tensor&, const std::vector<float>& logits_h) override {
    conf_.add_logits(logits_h.data(), b.labels.data(), b.n * b.h * b.w);
  }

  void end_eval(EvalStats& ev) override {
    SegScores sc = seg_scores(conf_);
    ev.mean_iou = sc.mean_iou;
    ev.mean_dice = sc.mean_dice;
    ev.pixel_accuracy = sc.pixel_accuracy;
    ev.accuracy = sc.pixel_accuracy;
    ev.class_iou = sc.iou;
  }

 private:
  // loss_sum (f64 [1] on the device) = units * (CE mean over pixels + w * Dice) of one batch,
  // without synchronising; dlogits (when dout) scaled by `scale`.
  void loss(Runtime& s, const Tensor& logits, const Tensor& y, float scale, double units, Tensor& loss_sum,
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
    const float w = float(s.cfg.train.dice_weight);
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

  SegConfusion conf_{1};
};

}  // namespace

std::unique_ptr<Task> make_segment_task(Runtime& s, bool with_train_data, bool with_eval_data, int rank,
                                        int world) {
  const Config& cfg = s.cfg;
  const bool synthetic = cfg.data.kind == "synthetic";
  if (cfg.data.kind != "webdataset" && !synthetic)
    user_error("{}: data.kind = \"{}\" does not fit model.kind = \"unet\" (expected webdataset with KEY.mask.png, "
               "or synthetic)",
               cfg.source(), cfg.data.kind);
  if (synthetic) with_train_data = with_eval_data = false;
  auto t = std::make_unique<SegmentTask>();
  if (with_train_data) t->train_ = make_seg_loader(cfg, cfg.data.train_split, true, rank, world);
  if (with_eval_data) {
    const std::string split = cfg.given(cfg.data.eval_split) ? cfg.data.eval_split : "val";
    t->eval_split = split;
    t->eval_ = make_seg_loader(cfg, split, false, 0, 1);
  }
  t->set_geometry(s);
  const data::SegLoader* any = t->train_ ? t->train_.get() : t->eval_.get();
  if (any && any->channels() != s.channels)
    user_error("{}: model.in_channels = {} but the images of {} have {} channels", cfg.source(), s.channels,
               cfg.data.path, any->channels());
  return t;
}

}  // namespace dtrain

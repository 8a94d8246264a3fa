// ClassifyTask: ResNet image classification (webdataset or synthetic images).
#include "models/resnet.h"
#include "session/image_task.h"
#include "session/loader_options.h"

namespace dtrain {

namespace {

using data::ImageBatch;
using data::ImageLoader;

std::unique_ptr<ImageLoader> make_loader(const Config& cfg, const std::string& split, bool training, int rank,
                                         int world) {
  data::ImageLoaderOptions o;
  fill_loader_options(o, cfg, split, training, rank, world);
  o.num_classes_expected = int(cfg.model.num_classes);
  o.channels_expected = int(cfg.model.in_channels);
  return std::make_unique<ImageLoader>(o);
}

class ClassifyTask : public ImageTask<ImageLoader, ImageBatch> {
 public:
  TaskKind kind() const override { return TaskKind::Classify; }

  void build_model(Runtime& s) override {
    const Config& cfg = s.cfg;
    ResNetSpec spec;
    spec.depth = int(cfg.model.depth);
    spec.width = int(cfg.model.width);
    spec.stem = cfg.model.stem;
    spec.num_classes = int(cfg.model.num_classes);
    spec.in_channels = int(cfg.model.in_channels);
    spec.zero_init_residual = cfg.model.zero_init_residual;
    s.model = build_resnet(spec, s.params);
  }

  Tensor forward_loss(Runtime& s, Ctx& ctx, int64_t accum, Tensor& loss_sum) override {
    Backend& be = *s.be;
    const int64_t n = staged_.x.dim(0);
    const float smoothing = float(s.cfg.train.label_smoothing);
    Tensor logits = s.model->forward(ctx, to_compute(s, staged_.x));
    Tensor losses = s.arena->alloc(DType::F32, Shape{n});
    Tensor dlogits = s.arena->alloc(logits.dtype, logits.shape);
    // mean over the global batch of the step: every micro-batch contributes 1/(n*accum)
    // (times the fp16 loss scale; 1 otherwise)
    be.softmax_xent(logits, staged_.y, smoothing, s.scaler.scale() / float(n * accum), losses, dlogits);
    be.sum_into(losses, 1.0, loss_sum, false);
    return dlogits;
  }

  EvalReport report(const EvalStats& ev) const override {
    EvalReport r;
    const std::string top5 = ev.accuracy_top5 >= 0 ? fmt::format(" | top-5 {:.2f}%", 100 * ev.accuracy_top5) : "";
    r.line = fmt::format("{0} loss {1:.4f} | {0} accuracy {2:.2f}%{3} | {4} samples", eval_split, ev.loss,
                         100 * ev.accuracy, top5, ev.samples);
    r.summary = fmt::format("{0} accuracy {1:.2f}% | {0} loss {2:.4f}", eval_split, 100 * ev.accuracy, ev.loss);
    r.headline("accuracy", ev.accuracy);
    if (ev.accuracy_top5 >= 0) {
      r.fields["eval_accuracy_top5"] = ev.accuracy_top5;
      r.scalars.emplace_back("eval/accuracy_top5", ev.accuracy_top5);
    }
    r.best = {"eval_accuracy", ev.accuracy, true};
    return r;
  }

 protected:
  Shape label_shape(int64_t n, int64_t, int64_t) const override { return Shape{n}; }
  Rng synthetic_rng(uint64_t seed, uint64_t stream) const override {
    return Rng(stream_id(seed, stream), stream_id(0x53594e));
  }

  void begin_eval(Runtime&) override { correct_ = correct5_ = classes_ = 0; }

  double eval_loss(Runtime& s, const Tensor& logits, const Tensor& y, int64_t n) override {
    Tensor losses = s.arena->alloc(DType::F32, Shape{n});
    Tensor none;
    s.be->softmax_xent(logits, y, 0.f, 1.f, losses, none);
    return s.be->sum(losses);
  }

  void score(const ImageBatch& b, const Tensor& logits, const std::vector<float>& logits_h) override {
    const int64_t C = classes_ = logits.shape[1];
    for (int64_t r = 0; r < b.n; ++r) {
      // the label's rank: logits above it, and equal ones before it (ties go to the lower
      // class, as the top-1 prediction is the first maximum)
      const float* row = logits_h.data() + r * C;
      const int64_t y = b.labels[size_t(r)];
      int64_t rank = 0;
      for (int64_t c = 0; c < C; ++c) rank += row[c] > row[y] || (row[c] == row[y] && c < y);
      correct_ += rank == 0;
      correct5_ += rank < 5;
    }
  }

  void end_eval(EvalStats& ev) override {
    ev.accuracy = double(correct_) / double(ev.samples);
    if (classes_ > 5) ev.accuracy_top5 = double(correct5_) / double(ev.samples);
  }

 private:
  int64_t correct_ = 0, correct5_ = 0, classes_ = 0;
};

}  // namespace

std::unique_ptr<Task> make_classify_task(Runtime& s, bool with_train_data, bool with_eval_data, int rank,
                                         int world) {
  const Config& cfg = s.cfg;
  auto t = std::make_unique<ClassifyTask>();
  t->eval_split = cfg.data.eval_split;
  const std::string data_kind = cfg.data.kind;
  if (data_kind == "webdataset") {
    if (with_train_data) t->train_ = make_loader(cfg, cfg.data.train_split, true, rank, world);
    if (with_eval_data) t->eval_ = make_loader(cfg, cfg.data.eval_split, false, 0, 1);
  } else if (data_kind != "synthetic") {
    user_error("{}: data.kind = \"{}\" does not fit model.kind = \"resnet\" (expected webdataset or synthetic)",
               cfg.source(), data_kind);
  }
  t->set_geometry(s);
  const std::vector<double> mean = cfg.data.mean, stdv = cfg.data.std;
  if (!mean.empty() && int64_t(mean.size()) != s.channels)
    user_error("{}: data.mean has {} values, expected {} (model.in_channels)", cfg.source(), mean.size(), s.channels);
  if (!stdv.empty() && int64_t(stdv.size()) != s.channels)
    user_error("{}: data.std has {} values, expected {} (model.in_channels)", cfg.source(), stdv.size(), s.channels);
  return t;
}

}  // namespace dtrain

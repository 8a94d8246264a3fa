#include "train/session.h"

#include <cmath>

#include "core/log.h"
#ifdef DTRAIN_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif
#include "data/image_loader.h"
#include "dist/data_parallel.h"
#include "models/resnet.h"

namespace dtrain {

Session::~Session() = default;

static std::unique_ptr<ImageLoader> make_loader(const Config& cfg, const std::string& split,
                                                bool training, int rank, int world) {
  ImageLoaderOptions o;
  if (training) {
    o.rank = rank;
    o.world_size = world;
  }
  o.root = cfg.s("data.path");
  o.split = split;
  o.batch_size = training ? cfg.i("train.batch_size") : cfg.i("eval.batch_size");
  o.shuffle = training;
  o.drop_last = training;
  o.seed = uint64_t(cfg.i("run.seed"));
  o.workers = int(cfg.i("data.workers"));
  o.prefetch = int(cfg.i("data.prefetch"));
  if (training) {
    o.crop_padding = int(cfg.i("data.crop_padding"));
    o.hflip = cfg.b("data.hflip");
  }
  for (double m : cfg.fv("data.mean")) o.mean.push_back(float(m));
  for (double s : cfg.fv("data.std")) o.std.push_back(float(s));
  o.num_classes_expected = int(cfg.i("model.num_classes"));
  o.channels_expected = int(cfg.i("model.in_channels"));
  return std::make_unique<ImageLoader>(o);
}

std::unique_ptr<Session> make_session(const Config& cfg, const SessionOptions& opt) {
  auto s = std::make_unique<Session>(cfg);
  s->rank = opt.rank;
  s->world = opt.world_size;
  const std::string kind = cfg.s("model.kind");
  if (kind != "resnet")
    user_error("{}: model.kind = \"{}\" is not implemented yet (available: resnet)", cfg.source(), kind);

  // ---- data ----
  const std::string data_kind = cfg.s("data.kind");
  s->channels = cfg.i("model.in_channels");
  s->num_classes = cfg.i("model.num_classes");
  if (data_kind == "webdataset") {
    if (opt.with_train_data) s->train_data = make_loader(cfg, cfg.s("data.train_split"), true, opt.rank, opt.world_size);
    if (opt.with_eval_data) s->eval_data = make_loader(cfg, cfg.s("data.eval_split"), false, 0, 1);
    ImageLoader* any = s->train_data ? s->train_data.get() : s->eval_data.get();
    if (any) {
      s->height = any->height();
      s->width = any->width();
    }
  } else if (data_kind == "synthetic") {
    s->height = cfg.i("data.synthetic_height");
    s->width = cfg.i("data.synthetic_width");
  } else {
    user_error("{}: data.kind = \"{}\" does not fit model.kind = \"resnet\" (expected webdataset or synthetic)",
               cfg.source(), data_kind);
  }
  const std::vector<double> mean = cfg.fv("data.mean"), stdv = cfg.fv("data.std");
  if (!mean.empty() && int64_t(mean.size()) != s->channels)
    user_error("{}: data.mean has {} values, expected {} (model.in_channels)", cfg.source(), mean.size(), s->channels);
  if (!stdv.empty() && int64_t(stdv.size()) != s->channels)
    user_error("{}: data.std has {} values, expected {} (model.in_channels)", cfg.source(), stdv.size(), s->channels);

  // ---- backend, model, parameters ----
  if (cfg.s("precision.dtype") != "fp32")
    user_error("{}: precision.dtype = \"{}\" is not implemented yet (mixed precision is planned; use \"fp32\")",
               cfg.source(), cfg.s("precision.dtype"));
  s->be = make_backend(cfg.s("run.device"), opt.device_index, int(cfg.i("run.threads")));
#ifdef DTRAIN_WITH_CUDA
  if (auto* cb = dynamic_cast<CudaBackend*>(s->be.get())) cb->set_allow_tf32(cfg.b("precision.tf32"));
#endif
  s->arena = std::make_unique<Arena>(*s->be);
  ResNetSpec spec;
  spec.depth = int(cfg.i("model.depth"));
  spec.width = int(cfg.i("model.width"));
  spec.stem = cfg.s("model.stem");
  spec.num_classes = int(cfg.i("model.num_classes"));
  spec.in_channels = int(cfg.i("model.in_channels"));
  spec.zero_init_residual = cfg.b("model.zero_init_residual");
  s->model = build_resnet(spec, s->params);
  s->params.finalize(*s->be);
  s->params.initialize(uint64_t(cfg.i("run.seed")));

  // ---- schedule and optimizer ----
  const int64_t accum = cfg.i("train.grad_accum");
  if (s->train_data) {
    s->steps_per_epoch = std::max<int64_t>(1, s->train_data->batches_per_epoch() / accum);
  } else {
    s->steps_per_epoch = 1000;  // synthetic data has no epochs; nominal
  }
  const int64_t max_steps = cfg.i("train.max_steps");
  s->total_steps = max_steps > 0 ? max_steps
                                 : int64_t(std::ceil(cfg.f("train.epochs") * double(s->steps_per_epoch)));
  if (s->total_steps <= 0)
    user_error("{}: train.epochs = {} gives no training step (set train.max_steps or more epochs)", cfg.source(),
               cfg.f("train.epochs"));
  if (opt.with_optimizer) {
    FlatRange range;
    if (opt.shard_optimizer) range = dist::shard_range(s->params.num_params(), opt.rank, opt.world_size);
    const bool decay_all = cfg.b("optim.decay_bias_and_norm");
    if (cfg.s("optim.name") == "sgd") {
      SgdConfig c;
      c.momentum = float(cfg.f("optim.momentum"));
      c.nesterov = cfg.b("optim.nesterov");
      c.dampening = float(cfg.f("optim.dampening"));
      c.weight_decay = float(cfg.f("optim.weight_decay"));
      c.decay_bias_and_norm = decay_all;
      if (c.nesterov && (c.momentum <= 0 || c.dampening != 0))
        user_error("{}: optim.nesterov = true needs optim.momentum > 0 and optim.dampening = 0", cfg.source());
      s->opt = std::make_unique<Sgd>(s->params, c, range);
    } else {
      AdamWConfig c;
      c.beta1 = float(cfg.f("optim.beta1"));
      c.beta2 = float(cfg.f("optim.beta2"));
      c.eps = float(cfg.f("optim.eps"));
      c.weight_decay = float(cfg.f("optim.weight_decay"));
      c.decay_bias_and_norm = decay_all;
      s->opt = std::make_unique<AdamW>(s->params, c, range);
    }
    std::vector<int64_t> milestones = cfg.iv("schedule.milestones");
    s->schedule = std::make_unique<LrSchedule>(
        parse_lr_kind(cfg.s("schedule.kind"), "schedule.kind"), cfg.f("optim.lr"), s->total_steps, cfg.i("schedule.warmup_steps"),
        cfg.f("schedule.warmup_start_factor"), cfg.i("schedule.step_size"), cfg.f("schedule.gamma"), milestones,
        cfg.f("schedule.min_lr"));
  }
  return s;
}

}  // namespace dtrain

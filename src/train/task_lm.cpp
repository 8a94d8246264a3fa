// LmTask: GPT next-token prediction on llm.c token shards (data.kind = "tokens").
// data.path holds SPLIT_*.bin shards (dtrain data tokenize writes train_000000.bin and
// val_000000.bin); the eval split is data.eval_split, "val" when the recipe leaves it unset.
// data.kind = "synthetic": random token windows (uniform over the vocabulary, targets the
// window shifted by one), one per micro-batch stream, made once and kept on the device (as
// ClassifyTask's synthetic images), for `dtrain bench`; no eval split.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>

#include "core/log.h"
#include "core/rng.h"
#include "data/token_shards.h"
#include "models/gpt.h"
#include "train/session.h"
#include "train/step.h"
#include "train/task.h"

namespace dtrain {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::vector<std::string> split_files(const Config& cfg, const std::string& split) {
  namespace stdfs = std::filesystem;
  const std::string dir = cfg.s("data.path");
  std::error_code ec;
  if (!stdfs::is_directory(dir, ec))
    user_error("{}: data.path = \"{}\" is not a directory (prepare it with `dtrain data tokenize ... --out {}`)",
               cfg.source(), dir, dir);
  std::vector<std::string> files;
  for (const auto& e : stdfs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(split + "_", 0) == 0 && n.size() > 4 && n.substr(n.size() - 4) == ".bin")
      files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty())
    user_error("{}: data.path = \"{}\" has no token shards {}_*.bin for split '{}'", cfg.source(), dir, split,
               split);
  return files;
}

class LmTask : public Task {
 public:
  explicit LmTask(const GptSpec& spec) : spec_(spec) {}
  std::string kind() const override { return "lm"; }
  std::string unit() const override { return "tok"; }

  void build_model(Session& s) override {
    auto m = build_gpt(spec_, s.params);
    gpt_ = m.get();
    s.model = std::move(m);
  }

  MicroResult forward_loss(Session& s, Ctx& ctx, uint64_t stream, int64_t accum, StepTimes& t) override {
    auto td = Clock::now();
    const int64_t B = s.cfg.i("train.batch_size"), T = spec_.block_size;
    Tensor x, y;
    if (synthetic_) {
      synthetic_batch(s, stream, x, y);
    } else {
      in_.resize(size_t(B * T));
      tg_.resize(size_t(B * T));
      // Global window order: this rank's local micro-batch c is global batch c*world + rank of
      // ONE loader (rank 0 of 1), so rank r's micro m of step s is the window a single process
      // with grad_accum * world draws for its micro m*world + r (the order step.cpp's streams
      // use; it makes N ranks equal one process with grad_accum N).
      train_->set_position(drawn_ * uint64_t(world_) + uint64_t(rank_));
      train_->next(in_.data(), tg_.data());
      ++drawn_;
      x = s.arena->alloc(DType::I32, Shape{B, T});
      y = s.arena->alloc(DType::I32, Shape{B * T});
      s.be->copy_from_host(x.data, in_.data(), x.nbytes());
      s.be->copy_from_host(y.data, tg_.data(), y.nbytes());
    }
    t.data_s += since(td);
    auto tf = Clock::now();
    Tensor logits = s.model->forward(ctx, x);
    // mean over every token of the step: 1/(B*T) per micro-batch, divided by accum
    Tensor losses = loss_.forward(ctx, logits, y, spec_.vocab_size, 1.f / float(accum));
    MicroResult r;
    r.dout = loss_.backward();
    r.loss_sum = host_sum(s, losses, tmp_);
    r.units = B * T;
    t.forward_s += since(tf);
    return r;
  }

  bool has_eval() const override { return eval_ != nullptr; }

  EvalStats evaluate(Session& s) override {
    EvalStats ev;
    if (!eval_) return ev;
    int64_t batches = eval_->eval_batches();
    const int64_t max_batches = s.cfg.i("eval.max_batches");
    if (max_batches > 0) batches = std::min(batches, max_batches);
    const int64_t B = eval_batch_, T = spec_.block_size;
    std::vector<int32_t> in(size_t(B * T)), tg(size_t(B * T));
    std::vector<float> tmp;
    double loss_sum = 0;
    for (int64_t k = 0; k < batches; ++k) {
      eval_->eval_batch(k, in.data(), tg.data());
      Tensor x = s.arena->alloc(DType::I32, Shape{B, T});
      Tensor y = s.arena->alloc(DType::I32, Shape{B * T});
      s.be->copy_from_host(x.data, in.data(), x.nbytes());
      s.be->copy_from_host(y.data, tg.data(), y.nbytes());
      Ctx ctx{*s.be, *s.arena, false, {}};
      Tensor logits = s.model->forward(ctx, x);
      GptLoss loss;
      Tensor losses = loss.forward(ctx, logits, y, spec_.vocab_size);
      loss_sum += host_sum(s, losses, tmp);
      ev.tokens += B * T;
      ev.samples += B;
      s.arena->reset();
    }
    if (ev.tokens) {
      ev.loss = loss_sum / double(ev.tokens);
      ev.perplexity = std::exp(ev.loss);
    }
    return ev;
  }

  bool data_state(LoaderState&, uint64_t& position) const override {
    if (!train_) return false;
    position = drawn_ * uint64_t(world_);  // global batches drawn: independent of the world size
    return true;
  }
  void restore_data(const LoaderState&, uint64_t position) override {
    // another world size continues at the first global batch not yet covered
    if (train_) drawn_ = (position + uint64_t(world_) - 1) / uint64_t(world_);
  }
  int64_t batches_per_epoch() const override {
    if (!train_) return 0;
    // an "epoch" = as many windows as the training tokens hold (nominal: sampling is random)
    const int64_t per_batch = train_batch_ * spec_.block_size * world_;
    return std::max<int64_t>(1, train_->total_tokens() / std::max<int64_t>(1, per_batch));
  }

  // The synthetic batch of `stream` (= micro * world + rank): made on first use and kept on
  // the device in s.synthetic, so N ranks see the windows of one process with grad_accum N.
  void synthetic_batch(Session& s, uint64_t stream, Tensor& x, Tensor& y) {
    const int64_t B = s.cfg.i("train.batch_size"), T = spec_.block_size;
    const size_t bytes = size_t(B * T) * 4;
    auto& slot = s.synthetic[stream];
    if (!slot.first.data()) {
      Rng r(stream_id(uint64_t(s.cfg.i("run.seed")), stream), stream_id(0x544f4b));
      std::vector<int32_t> win(size_t(T + 1));
      in_.resize(size_t(B * T));
      tg_.resize(size_t(B * T));
      for (int64_t b = 0; b < B; ++b) {
        for (auto& v : win) v = int32_t(r.below(uint64_t(spec_.vocab_size)));
        std::copy(win.begin(), win.end() - 1, in_.begin() + b * T);
        std::copy(win.begin() + 1, win.end(), tg_.begin() + b * T);
      }
      slot.first = Buffer(*s.be, bytes);
      slot.second = Buffer(*s.be, bytes);
      s.be->copy_from_host(slot.first.data(), in_.data(), bytes);
      s.be->copy_from_host(slot.second.data(), tg_.data(), bytes);
    }
    x = slot.first.tensor(DType::I32, Shape{B, T});
    y = slot.second.tensor(DType::I32, Shape{B * T});
  }

  GptSpec spec_;
  bool synthetic_ = false;
  GptModel* gpt_ = nullptr;
  std::unique_ptr<TokenLoader> train_, eval_;
  int64_t train_batch_ = 1, eval_batch_ = 1;
  int world_ = 1, rank_ = 0;
  uint64_t drawn_ = 0;  // micro-batches this rank drew

 private:
  GptLoss loss_;
  std::vector<int32_t> in_, tg_;
  std::vector<float> tmp_;
};

}  // namespace

GptSpec gpt_spec_from(const Config& cfg) {
  const std::string preset = cfg.s("model.preset").empty() ? "tiny" : cfg.s("model.preset");
  GptSpec spec = gpt_preset(preset);
  if (cfg.i("model.n_layer") > 0) spec.n_layer = int(cfg.i("model.n_layer"));
  if (cfg.i("model.n_head") > 0) spec.n_head = int(cfg.i("model.n_head"));
  if (cfg.i("model.n_embd") > 0) spec.n_embd = int(cfg.i("model.n_embd"));
  if (cfg.i("model.block_size") > 0) spec.block_size = int(cfg.i("model.block_size"));
  if (cfg.i("model.vocab_size") > 0) {
    spec.vocab_size = int(cfg.i("model.vocab_size"));
    spec.padded_vocab = 0;  // re-pad the new vocabulary (not the preset's padding)
  }
  gpt_validate(spec);
  return spec;
}

std::unique_ptr<Task> make_lm_task(Session& s, bool with_train_data, bool with_eval_data, int rank, int world) {
  const Config& cfg = s.cfg;
  const std::string& data_kind = cfg.s("data.kind");
  if (data_kind != "tokens" && data_kind != "synthetic")
    user_error("{}: data.kind = \"{}\" does not fit model.kind = \"gpt\" (expected tokens or synthetic)",
               cfg.source(), data_kind);
  auto t = std::make_unique<LmTask>(gpt_spec_from(cfg));
  const GptSpec& sp = t->spec_;
  const uint64_t seed = uint64_t(cfg.i("run.seed"));
  t->world_ = world;
  t->rank_ = rank;
  t->train_batch_ = cfg.i("train.batch_size");
  s.channels = 0;
  s.num_classes = sp.vocab_size;
  if (data_kind == "synthetic") {  // random windows, no loader and no eval split
    t->synthetic_ = true;
    return t;
  }
  if (with_train_data)
    t->train_ = std::make_unique<TokenLoader>(split_files(cfg, cfg.s("data.train_split")), sp.vocab_size,
                                              int(t->train_batch_), sp.block_size, 0, 1, seed);
  if (with_eval_data) {
    const std::string split = cfg.is_set("data.eval_split") ? cfg.s("data.eval_split") : "val";
    auto files = split_files(cfg, split);
    t->eval_batch_ = cfg.i("eval.batch_size");
    t->eval_ = std::make_unique<TokenLoader>(files, sp.vocab_size, int(t->eval_batch_), sp.block_size, 0, 1, seed);
    if (t->eval_->eval_batches() == 0) {  // fewer windows than one batch: evaluate them one by one
      t->eval_batch_ = 1;
      t->eval_ = std::make_unique<TokenLoader>(files, sp.vocab_size, 1, sp.block_size, 0, 1, seed);
    }
  }
  return t;
}

}  // namespace dtrain

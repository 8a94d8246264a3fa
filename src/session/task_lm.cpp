// LmTask: GPT next-token prediction on llm.c token shards (data.kind = "tokens"), or on
// random tokens (data.kind = "synthetic", benchmarks).
// data.path holds the shards of each split: *.bin files with the split name as a '_'-separated
// part of their name (dtrain data tokenize writes train_000000.bin and val_000000.bin;
// llm.c's fineweb_train_000001.bin, tiny_shakespeare_val.bin are found as well); the eval
// split is data.eval_split, "val" when the recipe leaves it unset.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <tuple>

#include "core/clock.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/rng.h"
#include "data/token_shards.h"
#include "models/gpt.h"
#include "session/pipeline.h"
#include "session/runtime.h"
#include "session/task.h"

namespace dtrain {

namespace {

std::vector<std::string> split_files(const Config& cfg, const std::string& split) {
  namespace stdfs = std::filesystem;
  const std::string dir = cfg.data.path;
  std::error_code ec;
  if (!stdfs::is_directory(dir, ec))
    user_error("{}: data.path = \"{}\" is not a directory (prepare it with `dtrain data tokenize TEXT_FILES --out {} "
               "--tokenizer byte`, or name the command in data.prepare)",
               cfg.source(), dir, dir);
  // The split is a '_'-separated part of the name: dtrain's train_000000.bin and llm.c's
  // fineweb_train_000001.bin / tiny_shakespeare_val.bin alike.
  auto in_split = [&](const std::string& stem) {
    const std::string mid = "_" + split + "_";
    return ("_" + stem + "_").find(mid) != std::string::npos;
  };
  std::vector<std::string> files;
  for (const auto& e : stdfs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (e.is_regular_file(ec) && n.size() > 4 && n.substr(n.size() - 4) == ".bin" && in_split(n.substr(0, n.size() - 4)))
      files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty())
    user_error("{}: data.path = \"{}\" has no token shards for split '{}' (*.bin files with '{}' as a '_'-separated "
               "part of the name: {}_000000.bin, fineweb_{}_000001.bin)",
               cfg.source(), dir, split, split, split, split);
  return files;
}

class LmTask : public Task {
 public:
  explicit LmTask(const GptSpec& spec) : spec_(spec) {}
  TaskKind kind() const override { return TaskKind::Lm; }
  std::string unit() const override { return "tok"; }
  int64_t units_per_sample() const override { return spec_.block_size; }
  bool token_stream() const override { return true; }

  EvalReport report(const EvalStats& ev) const override {
    EvalReport r;
    r.line = fmt::format("{0} loss {1:.4f} | {0} perplexity {2:.3f} | {3} tokens", eval_split, ev.loss, ev.perplexity,
                         ev.tokens);
    r.summary = fmt::format("{0} loss {1:.4f} | {0} perplexity {2:.3f}", eval_split, ev.loss, ev.perplexity);
    r.headline("perplexity", ev.perplexity);
    r.fields["eval_tokens"] = ev.tokens;
    r.best = {"eval_loss", ev.loss, false};
    return r;
  }

  void build_model(Runtime& s) override {
    spec_.tp_size = s.tp_size;
    spec_.sequence_parallel = s.tp_size > 1 && s.cfg.parallel.sequence;
    if (s.pp_size > 1) {  // this rank's chunks of the pipeline, in order
      const PipelineLayout& l = s.pipe_layout;
      std::vector<GptModel*> chunks;
      for (int c = 0; c < l.virtual_stages; ++c) {
        auto m = build_gpt(pipeline_chunk_spec(spec_, l, s.pp_rank, c), s.params);
        chunks.push_back(m.get());
        if (c == 0) s.model = std::move(m);
        else s.pp_more.push_back(std::move(m));
      }
      gpt_ = chunks[0];
      s.pipe = std::make_unique<Pipeline>(l, s.pp_rank, chunks);
      return;
    }
    auto m = build_gpt(spec_, s.params);
    gpt_ = m.get();
    s.model = std::move(m);
  }

  // data.kind = "synthetic": uniformly random tokens (inputs and targets), made once per
  // stream (micro * world + rank) and kept on the device, so a benchmark measures compute.
  std::pair<Tensor, Tensor> synthetic_batch(Runtime& s, uint64_t stream) {
    const int64_t B = s.cfg.train.batch_size, T = spec_.block_size;
    auto& slot = s.synthetic[stream];
    if (!slot.first.data()) {
      Rng r(stream_id(uint64_t(s.cfg.run.seed), stream, 0x544f4b));
      std::vector<int32_t> ids(size_t(B * T) * 2);
      for (auto& v : ids) v = int32_t(r.below(uint64_t(spec_.vocab_size)));
      slot.first = Buffer(*s.be, size_t(B * T) * 4);
      slot.second = Buffer(*s.be, size_t(B * T) * 4);
      s.be->copy_from_host(slot.first.data(), ids.data(), size_t(B * T) * 4);
      s.be->copy_from_host(slot.second.data(), ids.data() + B * T, size_t(B * T) * 4);
    }
    return {slot.first.tensor(DType::I32, Shape{B, T}), slot.second.tensor(DType::I32, Shape{B * T})};
  }

  StagedBatch stage_batch(Runtime& s, uint64_t stream, StepTimes& t) override {
    auto td = Clock::now();
    const int64_t B = s.cfg.train.batch_size, T = spec_.block_size;
    if (!train_) {
      std::tie(x_, y_) = synthetic_batch(s, stream);
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
      x_ = stage_upload(*s.be, x_buf_, in_.data(), DType::I32, Shape{B, T});
      y_ = stage_upload(*s.be, y_buf_, tg_.data(), DType::I32, Shape{B * T});
    }
    t.data_s += seconds_since(td);
    return StagedBatch{x_.numel(), x_, y_};
  }

  Tensor forward_loss(Runtime& s, Ctx& ctx, int64_t accum, Tensor& loss_sum) override {
    Tensor logits = s.model->forward(ctx, x_);
    // mean over every token of the step: 1/(B*T) per micro-batch, divided by accum (times the
    // fp16 loss scale; 1 otherwise)
    Tensor losses = loss_.forward(ctx, logits, y_, spec_.vocab_size, s.scaler.scale() / float(accum));
    s.be->sum_into(losses, 1.0, loss_sum, false);
    if (MoeStats* moe = gpt_->moe_stats()) {  // + the routers' auxiliary losses (per token of the mean)
      const float aux = float(moe->finish_micro(s.scaler.scale() / float(accum)));
      Tensor t = ctx.arena.alloc(DType::F32, Shape{1});
      s.be->copy_from_host(t.data, &aux, sizeof(float));
      s.be->sum_into(t, double(losses.numel()), loss_sum, true);
    }
    return loss_.backward();
  }

  bool has_eval() const override { return eval_ != nullptr; }

  nlohmann::json step_fields() override {
    nlohmann::json j = nlohmann::json::object();
    MoeStats* moe = gpt_ ? gpt_->moe_stats() : nullptr;
    if (!moe) return j;
    const MoeStats::Step st = moe->take_step();
    j["moe_tokens_per_expert"] = st.tokens_per_expert;
    j["moe_dropped_tokens"] = st.dropped;
    j["moe_aux_loss"] = st.aux_loss;
    j["moe_z_loss"] = st.z_loss;
    return j;
  }

  EvalStats evaluate(Runtime& s) override {
    EvalStats ev;
    if (!eval_) return ev;
    int64_t batches = eval_->eval_batches();
    const int64_t max_batches = s.cfg.eval.max_batches;
    if (max_batches > 0) batches = std::min(batches, max_batches);
    const int64_t B = eval_batch_, T = spec_.block_size;
    std::vector<int32_t> in(size_t(B * T)), tg(size_t(B * T));
    double loss_sum = 0;
    Progress progress("eval", batches, "batches");  // a line on a terminal (or every 10 s) on long evaluations
    for (int64_t k = 0; k < batches; ++k, progress.add(1)) {
      eval_->eval_batch(k, in.data(), tg.data());
      Tensor x = s.arena->alloc(DType::I32, Shape{B, T});
      Tensor y = s.arena->alloc(DType::I32, Shape{B * T});
      s.be->copy_from_host(x.data, in.data(), x.nbytes());
      s.be->copy_from_host(y.data, tg.data(), y.nbytes());
      if (s.pipe) {  // every stage takes part; the last one's loss summed over the stages at the end
        loss_sum += s.pipe->eval_loss_sum(s, x, y);
      } else {
        Ctx ctx{*s.be, *s.arena, false, {}, {}};
        ctx.units = s.units;
        ctx.tp = s.tp;
        Tensor logits = s.model->forward(ctx, x);
        GptLoss loss;
        Tensor losses = loss.forward(ctx, logits, y, spec_.vocab_size);
        loss_sum += s.be->sum(losses);
      }
      ev.tokens += B * T;
      ev.samples += B;
      s.arena->reset();
    }
    if (s.pipe) {
      std::vector<double> v = {loss_sum};
      s.pipe->sync().sum(*s.be, v);
      loss_sum = v[0];
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

  GptSpec spec_;
  GptModel* gpt_ = nullptr;
  std::unique_ptr<TokenLoader> train_, eval_;
  int64_t train_batch_ = 1, eval_batch_ = 1;
  int world_ = 1, rank_ = 0;
  uint64_t drawn_ = 0;  // micro-batches this rank drew

 private:
  GptLoss loss_;
  std::vector<int32_t> in_, tg_;
  Tensor x_, y_;          // the staged micro-batch (inputs [B,T], targets [B*T])
  Buffer x_buf_, y_buf_;  // the loader's windows on the device (fixed addresses)
};

}  // namespace

// the mixture-of-experts keys (nn/moe.h)
static MoeConfig moe_config_from(const ModelSection& m) {
  MoeConfig c;
  c.num_experts = int(m.num_local_experts);
  c.top_k = int(m.num_experts_per_tok);
  c.every = int(m.moe_every);
  c.expert_intermediate = int(m.moe_intermediate_size);
  c.shared_intermediate = int(m.shared_expert_intermediate_size);
  c.norm_topk = m.norm_topk_prob;
  c.aux_loss_coef = m.router_aux_loss_coef;
  c.z_loss_coef = m.router_z_loss_coef;
  c.capacity_factor = m.capacity_factor;
  return c;
}

GptSpec gpt_spec_from(const Config& cfg) {
  const std::string preset = cfg.model.preset.empty() ? "tiny" : cfg.model.preset;
  GptSpec spec = gpt_preset(preset);
  if (cfg.model.n_layer > 0) spec.n_layer = int(cfg.model.n_layer);
  if (cfg.model.n_head > 0) spec.n_head = int(cfg.model.n_head);
  if (cfg.model.n_embd > 0) spec.n_embd = int(cfg.model.n_embd);
  if (cfg.model.block_size > 0) spec.block_size = int(cfg.model.block_size);
  if (cfg.model.vocab_size > 0) {
    spec.vocab_size = int(cfg.model.vocab_size);
    spec.padded_vocab = 0;  // re-pad the new vocabulary (not the preset's padding)
  }
  if (cfg.model.arch != "gpt2") {
    // the Llama family: the sizes as above (a preset's or the n_* keys), the switches from the
    // llama keys, named as Hugging Face's LlamaConfig / Qwen2Config name them
    const ModelSection& m = cfg.model;
    spec.family = "llama";
    LlamaConfig& l = spec.llama;
    l.model_type = m.arch;
    l.vocab_size = spec.vocab_size;
    l.hidden_size = spec.n_embd;
    l.num_hidden_layers = spec.n_layer;
    l.num_attention_heads = spec.n_head;
    l.max_position_embeddings = spec.block_size;
    l.num_key_value_heads = int(m.n_kv_head);
    l.head_dim = int(m.head_dim);
    l.intermediate_size = m.intermediate_size > 0 ? int(m.intermediate_size) : 4 * spec.n_embd;
    l.rms_norm_eps = m.rms_norm_eps;
    l.rope_theta = m.rope_theta;
    if (m.rope_scaling == "llama3") {
      l.rope_scaling.rope_type = "llama3";
      l.rope_scaling.factor = m.rope_factor;
      l.rope_scaling.low_freq_factor = m.rope_low_freq_factor;
      l.rope_scaling.high_freq_factor = m.rope_high_freq_factor;
      l.rope_scaling.original_max_position_embeddings = int(m.rope_original_max_positions);
    }
    l.tie_word_embeddings = m.tie_word_embeddings;
    l.attention_bias = m.attention_bias;
    l.mlp_bias = m.mlp_bias;
  }
  spec.moe = moe_config_from(cfg.model);
  gpt_validate(spec);
  return spec;
}

std::unique_ptr<Task> make_lm_task(Runtime& s, bool with_train_data, bool with_eval_data, int rank, int world) {
  const Config& cfg = s.cfg;
  const bool synthetic = cfg.data.kind == "synthetic";
  if (cfg.data.kind != "tokens" && !synthetic)
    user_error("{}: data.kind = \"{}\" does not fit model.kind = \"gpt\" (expected tokens or synthetic)",
               cfg.source(), cfg.data.kind);
  if (synthetic) with_train_data = with_eval_data = false;
  auto t = std::make_unique<LmTask>(gpt_spec_from(cfg));
  const GptSpec& sp = t->spec_;
  const uint64_t seed = uint64_t(cfg.run.seed);
  t->world_ = world;
  t->rank_ = rank;
  t->train_batch_ = cfg.train.batch_size;
  if (with_train_data)
    t->train_ = std::make_unique<TokenLoader>(split_files(cfg, cfg.data.train_split), sp.vocab_size,
                                              int(t->train_batch_), sp.block_size, 0, 1, seed);
  if (with_eval_data) {
    const std::string split = cfg.given(cfg.data.eval_split) ? cfg.data.eval_split : "val";
    t->eval_split = split;
    auto files = split_files(cfg, split);
    t->eval_batch_ = cfg.eval.batch_size;
    t->eval_ = std::make_unique<TokenLoader>(files, sp.vocab_size, int(t->eval_batch_), sp.block_size, 0, 1, seed);
    if (t->eval_->eval_batches() == 0) {  // fewer windows than one batch: evaluate them one by one
      t->eval_batch_ = 1;
      t->eval_ = std::make_unique<TokenLoader>(files, sp.vocab_size, 1, sp.block_size, 0, 1, seed);
    }
  }
  s.channels = 0;
  s.num_classes = sp.vocab_size;
  return t;
}

}  // namespace dtrain

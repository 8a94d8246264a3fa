// LmTask: GPT next-token prediction on llm.c token shards (data.kind = "tokens"), on
// fine-tuning examples (data.kind = "sft": the shards of `dtrain data sft`, one example per
// sequence or packed, the loss on the targets only; data/sft_loader.h), or on random tokens
// (data.kind = "synthetic", benchmarks).
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
#include "data/sft_loader.h"
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
    auto m = build_gpt(spec_, s.model_params());  // LoRA: the frozen store (session/runtime.h)
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

  // A fine-tuning micro-batch: global batch g = drawn * world + rank of the examples' row
  // sequence (as the windows below). Its loss counts the targets only, over the whole step:
  // each rank knows the step's targets (N) and tokens (S) from the loader, weights its loss sum
  // by S / N (the step's loss, a sum over the ranks divided by their tokens, is then the mean
  // over the targets) and its gradient by world / N (the data-parallel average then gives the
  // mean over the targets of the global batch, as one process with grad_accum * world).
  StagedBatch stage_sft(Runtime& s, StepTimes& t) {
    auto td = Clock::now();
    const int64_t B = s.cfg.train.batch_size, T = spec_.block_size;
    in_.resize(size_t(B * T));
    tg_.resize(size_t(B * T));
    pos_host_.resize(size_t(B * T));
    const uint64_t g = drawn_ * uint64_t(world_) + uint64_t(rank_), per_step = uint64_t(accum_ * world_);
    const SftBatch b = sft_train_->batch(g, in_.data(), tg_.data(), pos_host_.data());
    ++drawn_;
    if (g / per_step != step_) {
      step_ = g / per_step;
      step_totals_ = sft_train_->totals(step_ * per_step, per_step);
    }
    StagedBatch sb;
    x_ = stage_upload(*s.be, x_buf_, in_.data(), DType::I32, Shape{B, T});
    y_ = stage_upload(*s.be, y_buf_, tg_.data(), DType::I32, Shape{B * T});
    if (packing_) sb.positions = stage_upload(*s.be, pos_buf_, pos_host_.data(), DType::I32, Shape{B, T});
    const SftBatch& n = step_totals_;
    sb.units = b.tokens;
    sb.weighted = true;
    sb.loss_weight = n.targets > 0 ? double(n.tokens) / double(n.targets) : 0.0;
    sb.grad_scale = n.targets > 0 ? float(double(world_) / double(n.targets)) : 0.f;
    sb.x = x_;
    sb.y = y_;
    t.data_s += seconds_since(td);
    staged_ = sb;
    return sb;
  }

  StagedBatch stage_batch(Runtime& s, uint64_t stream, StepTimes& t) override {
    if (sft_train_) return stage_sft(s, t);
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
    const bool sft = sft_train_ != nullptr;
    if (sft && staged_.positions.defined()) gpt_->set_positions(staged_.positions, true);
    Tensor logits = s.model->forward(ctx, x_);
    // tokens: the mean over every token of the step, 1/(B*T) per micro-batch divided by accum;
    // fine-tuning examples: the mean over the step's targets (the weights stage_sft gave the
    // micro-batch); times the fp16 loss scale (1 otherwise)
    Tensor losses = sft ? loss_.forward(ctx, logits, y_, spec_.vocab_size, s.scaler.scale() * staged_.grad_scale, 1)
                        : loss_.forward(ctx, logits, y_, spec_.vocab_size, s.scaler.scale() / float(accum));
    s.be->sum_into(losses, sft ? staged_.loss_weight : 1.0, loss_sum, false);
    if (MoeStats* moe = gpt_->moe_stats()) {  // + the routers' auxiliary losses (per token of the mean)
      const float aux = float(moe->finish_micro(s.scaler.scale() / float(accum)));
      Tensor t = ctx.arena.alloc(DType::F32, Shape{1});
      s.be->copy_from_host(t.data, &aux, sizeof(float));
      s.be->sum_into(t, double(sft ? staged_.units : losses.numel()), loss_sum, true);
    }
    return loss_.backward();
  }

  bool has_eval() const override { return eval_ != nullptr || sft_eval_ != nullptr; }

  // The loss summed over the tokens of x (targets y), by the pipeline's stages or the model.
  double eval_sum(Runtime& s, const Tensor& x, const Tensor& y, const Tensor& positions) {
    if (s.pipe) return s.pipe->eval_loss_sum(s, x, y, positions);
    Ctx ctx{*s.be, *s.arena, false, {}, {}};
    ctx.units = s.units;
    ctx.tp = s.tp;
    if (positions.defined()) gpt_->set_positions(positions, true);
    Tensor logits = s.model->forward(ctx, x);
    GptLoss loss;
    return s.be->sum(loss.forward(ctx, logits, y, spec_.vocab_size));
  }

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

  // Token windows: every token a target. Fine-tuning examples: every held-out example once, the
  // loss averaged over their targets (packed: with their documents' positions).
  EvalStats evaluate(Runtime& s) override {
    EvalStats ev;
    if (!eval_ && !sft_eval_) return ev;
    int64_t batches = sft_eval_ ? sft_eval_->eval_batches() : eval_->eval_batches();
    if (s.cfg.eval.max_batches > 0) batches = std::min(batches, int64_t(s.cfg.eval.max_batches));
    const int64_t B = eval_batch_, T = spec_.block_size;
    std::vector<int32_t> in(size_t(B * T)), tg(size_t(B * T)), pos(size_t(B * T));
    auto upload = [&](const std::vector<int32_t>& v, const Shape& sh) {
      Tensor t = s.arena->alloc(DType::I32, sh);
      s.be->copy_from_host(t.data, v.data(), t.nbytes());
      return t;
    };
    double loss_sum = 0;
    Progress progress("eval", batches, "batches");  // a line on a terminal (or every 10 s) on long evaluations
    for (int64_t k = 0; k < batches; ++k, progress.add(1)) {
      int64_t targets = B * T;
      if (sft_eval_) targets = sft_eval_->batch(uint64_t(k), in.data(), tg.data(), pos.data()).targets;
      else eval_->eval_batch(k, in.data(), tg.data());
      const Tensor x = upload(in, Shape{B, T}), y = upload(tg, Shape{B * T});
      const Tensor p = sft_eval_ && packing_ ? upload(pos, Shape{B, T}) : Tensor();
      // a pipeline: every stage takes part, the last one's loss summed over the stages at the end
      loss_sum += eval_sum(s, x, y, p);
      ev.tokens += targets;
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
    if (!train_ && !sft_train_) return false;
    position = drawn_ * uint64_t(world_);  // global batches drawn: independent of the world size
    return true;
  }
  void restore_data(const LoaderState&, uint64_t position) override {
    // another world size continues at the first global batch not yet covered
    if (train_ || sft_train_) drawn_ = (position + uint64_t(world_) - 1) / uint64_t(world_);
  }
  int64_t batches_per_epoch() const override {
    if (sft_train_) return std::max<int64_t>(1, sft_train_->rows() / std::max<int64_t>(1, train_batch_ * world_));
    if (!train_) return 0;
    // an "epoch" = as many windows as the training tokens hold (nominal: sampling is random)
    const int64_t per_batch = train_batch_ * spec_.block_size * world_;
    return std::max<int64_t>(1, train_->total_tokens() / std::max<int64_t>(1, per_batch));
  }

  GptSpec spec_;
  GptModel* gpt_ = nullptr;
  std::unique_ptr<TokenLoader> train_, eval_;
  std::unique_ptr<SftLoader> sft_train_, sft_eval_;  // data.kind = "sft"
  bool packing_ = false;
  int64_t accum_ = 1;
  int64_t train_batch_ = 1, eval_batch_ = 1;
  int world_ = 1, rank_ = 0;
  uint64_t drawn_ = 0;  // micro-batches this rank drew

 private:
  GptLoss loss_;
  std::vector<int32_t> in_, tg_, pos_host_;
  Tensor x_, y_;          // the staged micro-batch (inputs [B,T], targets [B*T])
  Buffer x_buf_, y_buf_, pos_buf_;  // the loader's windows (and positions) on the device (fixed addresses)
  StagedBatch staged_;    // fine-tuning: the staged micro-batch's positions and weights
  uint64_t step_ = ~uint64_t(0);  // fine-tuning: the step step_totals_ counts
  SftBatch step_totals_;
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
  const bool synthetic = cfg.data.kind == "synthetic", sft = cfg.data.kind == "sft";
  if (cfg.data.kind != "tokens" && !synthetic && !sft)
    user_error("{}: data.kind = \"{}\" does not fit model.kind = \"gpt\" (expected tokens, sft or synthetic)",
               cfg.source(), cfg.data.kind);
  if (synthetic) with_train_data = with_eval_data = false;
  auto t = std::make_unique<LmTask>(gpt_spec_from(cfg));
  const GptSpec& sp = t->spec_;
  const uint64_t seed = uint64_t(cfg.run.seed);
  t->world_ = world;
  t->rank_ = rank;
  t->train_batch_ = cfg.train.batch_size;
  t->accum_ = cfg.train.grad_accum;
  if (sft) {
    SftLoaderOptions o;
    o.seq_len = sp.block_size;
    o.packing = t->packing_ = cfg.data.packing;
    o.overflow = cfg.data.overflow == "split"      ? SftOverflow::Split
                 : cfg.data.overflow == "truncate" ? SftOverflow::Truncate
                                                   : SftOverflow::Refuse;
    o.seed = seed;
    o.refusal = fmt::format(" (set {} = \"split\" or \"truncate\", or train on longer sequences)",
                            cfg.key_of(cfg.data.overflow));
    if (with_train_data) {
      o.batch = int(t->train_batch_);
      t->sft_train_ = std::make_unique<SftLoader>(split_files(cfg, cfg.data.train_split), sp.vocab_size, o);
    }
    if (with_eval_data) {
      t->eval_split = cfg.given(cfg.data.eval_split) ? cfg.data.eval_split : "val";
      o.batch = int(t->eval_batch_ = cfg.eval.batch_size);
      o.shuffle = false;
      t->sft_eval_ = std::make_unique<SftLoader>(split_files(cfg, t->eval_split), sp.vocab_size, o);
    }
    with_train_data = with_eval_data = false;
  }
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

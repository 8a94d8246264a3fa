#include "session/pipeline.h"

#include <csignal>
#include <cmath>

#include <fmt/ranges.h>

#include "core/clock.h"
#include "core/error.h"
#include "core/failpoint.h"
#include "core/log.h"
#include "parallel/data_parallel.h"
#include "session/runtime.h"
#include "session/task.h"

namespace dtrain {

PipelineLayout check_pipeline(const Config& cfg, int world) {
  PipelineLayout l;
  const int P = int(cfg.parallel.pipeline);
  const int V = int(cfg.parallel.virtual_stages);
  const std::vector<int64_t> given = cfg.parallel.stage_layers;
  if (P == 1) {
    if (V != 1 || !given.empty())
      user_error("{}: parallel.virtual_stages = {} / parallel.stage_layers need parallel.pipeline > 1 (got "
                 "parallel.pipeline = 1)", cfg.source(), V);
    return l;
  }
  const int T = int(cfg.parallel.tensor);
  if (world % (P * T) != 0)
    user_error("{}: parallel.pipeline = {} x parallel.tensor = {} must divide the world size {} (world = pipeline x "
               "data x tensor)", cfg.source(), P, T, world);
  auto refuse = [&](const std::string& what) {
    user_error("{}: parallel.pipeline = {} does not work with {} (set parallel.pipeline = 1)", cfg.source(), P, what);
  };
  if (cfg.model.kind != "gpt") refuse(fmt::format("model.kind = \"{}\" (pipeline parallelism is GPT's)", cfg.model.kind));
  if (cfg.train.recompute != "none")
    refuse(fmt::format("train.recompute = \"{}\" (every stage already runs its forward again before its backward)",
                       cfg.train.recompute));
  if (cfg.train.cuda_graph) refuse("train.cuda_graph = true");
  if (cfg.parallel.offload != "none") refuse(fmt::format("parallel.offload = \"{}\"", cfg.parallel.offload));
  if (cfg.parallel.reduce_dtype != "f32") refuse(fmt::format("parallel.reduce_dtype = \"{}\"", cfg.parallel.reduce_dtype));
  if (cfg.parallel.sequence) refuse("parallel.sequence = true");
  l.stages = P;
  l.virtual_stages = V;
  l.schedule = parallel::parse_pipe_schedule(cfg.parallel.schedule, V);
  const int M = int(cfg.train.grad_accum);
  GptSpec spec = gpt_spec_from(cfg);
  if (l.schedule == parallel::PipeSchedule::Interleaved) {
    if (M % P != 0)
      user_error("{}: parallel.virtual_stages = {} (interleaved 1F1B) needs train.grad_accum = {} divisible by "
                 "parallel.pipeline = {}", cfg.source(), V, M, P);
    if (given.empty() && spec.n_layer % (P * V) != 0)
      user_error("{}: parallel.virtual_stages = {} (interleaved 1F1B) needs model.n_layer = {} divisible by "
                 "parallel.pipeline x parallel.virtual_stages = {} (or set parallel.stage_layers)",
                 cfg.source(), V, spec.n_layer, P * V);
  }
  // costs in blocks: the embedding is a gather (cheap); ln_f + the head + the loss cost a
  // GEMM of C x vocabulary per token against a block's 12 C^2 (attention besides)
  const double head = double(spec.padded_vocab) / (12.0 * spec.n_embd);
  l.layers = parallel::pipeline_stage_layers(spec.n_layer, P * V, given, 0.0, head);
  l.tied = gpt_tied_param(spec);
  return l;
}

GptSpec pipeline_chunk_spec(const GptSpec& full, const PipelineLayout& l, int rank, int chunk) {
  GptSpec s = full;
  const int k = chunk * l.stages + rank, S = l.stages * l.virtual_stages;
  s.pp_first = 0;
  for (int i = 0; i < k; ++i) s.pp_first += l.layers[size_t(i)];
  s.pp_layers = l.layers[size_t(k)];
  s.pp_embed = k == 0;
  s.pp_head = k == S - 1;
  return s;
}

Pipeline::Pipeline(const PipelineLayout& l, int rank, std::vector<GptModel*> chunks)
    : l_(l), rank_(rank), chunks_(std::move(chunks)) {
  DTRAIN_CHECK(int(chunks_.size()) == l_.virtual_stages, "pipeline: {} chunks for {} virtual stages", chunks_.size(),
               l_.virtual_stages);
}

std::string Pipeline::describe(int data, int tensor, int64_t micro_batches) const {
  return fmt::format("pipeline parallel: {} stages ({} x {} x {} mesh, pipeline outermost) | schedule {}{} | blocks per "
                     "stage {} | {} micro-batches, bubble (P-1)/{}M = {:.3f}",
                     l_.stages, l_.stages, data, tensor, l_.schedule == parallel::PipeSchedule::GPipe ? "gpipe" : "1f1b",
                     l_.virtual_stages > 1 ? fmt::format(" interleaved over {} chunks per rank", l_.virtual_stages) : "",
                     fmt::join(l_.layers, ","), micro_batches, l_.virtual_stages > 1 ? "V" : "",
                     bubble_theory(micro_batches));
}

comm::Communicator& Pipeline::pp() {
  DTRAIN_CHECK(pp_ != nullptr, "pipeline: no pp group attached");
  return *pp_;
}

int64_t Pipeline::train(Runtime& s, Task& task, int64_t accum, StepTimes& t, PipeTimes& times, int64_t step,
                        parallel::DataParallel* dp) {
  UnitHooks* hooks = dp ? dp->unit_hooks() : nullptr;  // ZeRO-3
  Backend& be = *s.be;
  if (!keep_) keep_ = std::make_unique<Arena>(be);
  Arena& keep = *keep_;
  keep.reset();
  const auto t0 = Clock::now();
  const int P = l_.stages, V = l_.virtual_stages, S = P * V, M = int(accum);
  const GptSpec& spec = chunk(0).spec();
  // every rank stages every micro-batch (the loaders stay at the same position on every
  // stage); the first stage keeps the inputs, the last the targets
  std::vector<Tensor> xs(static_cast<size_t>(M)), ys(static_cast<size_t>(M));
  int64_t units = 0, B = 0, T = 0;
  for (int m = 0; m < M; ++m) {
    const StagedBatch sb = task.stage_batch(s, uint64_t(m * s.world + s.rank), t);
    units += sb.units;
    B = sb.x.dim(0);
    T = sb.x.dim(1);
    if (first()) {
      xs[size_t(m)] = keep.alloc(sb.x.dtype, sb.x.shape);
      be.copy_device(xs[size_t(m)].data, sb.x.data, sb.x.nbytes());
    }
    if (last()) {
      ys[size_t(m)] = keep.alloc(sb.y.dtype, sb.y.shape);
      be.copy_device(ys[size_t(m)].data, sb.y.data, sb.y.nbytes());
    }
  }
  const Shape act{B, T, int64_t(spec.n_embd)};
  const DType adt = s.params.compute_dtype();
  const auto acts = parallel::pipeline_actions(l_.schedule, P, rank_, M, V);
  const auto plan = parallel::pipeline_p2p_plan(l_.schedule, P, rank_, M, V);
  // the step's messages by (kind, virtual stage it goes into, micro-batch): what this rank
  // received, and what it keeps to send (the outputs live in the step arena, reset per action)
  auto at = [&](parallel::PipeMessage::Kind kind, int k, int m) { return size_t((int(kind) * S + k) * M + m); };
  std::vector<Tensor> inbox(size_t(2 * S * M)), outbox(size_t(2 * S * M));
  double idle = 0;
  auto exchange = [&](const std::vector<parallel::PipeMessage>& group) {
    if (group.empty()) return;
    std::vector<comm::P2POp> ops;
    for (const auto& msg : group) {
      Tensor& buf = (msg.send ? outbox : inbox)[at(msg.kind, msg.stage, msg.micro)];
      if (!msg.send) buf = keep.alloc(adt, act);
      DTRAIN_CHECK(buf.defined(), "pipeline stage {}: nothing to send for {}", rank_, msg.what());
      ops.push_back({msg.send ? comm::P2POp::Kind::Send : comm::P2POp::Kind::Recv, buf, msg.peer, msg.what()});
    }
    const auto tw = Clock::now();
    try {
      pp().p2p_async(ops)->wait();
    } catch (const RuntimeFault& e) {
      std::string peers;
      for (const auto& msg : group)
        if (peers.find(fmt::format("stage {} ", msg.peer)) == std::string::npos)
          peers += fmt::format("{}pipeline stage {} (rank {})", peers.empty() ? "" : " and ", msg.peer,
                               pp().global_ranks()[size_t(msg.peer)]);
      fault("pipeline stage {} (rank {}) at step {}: its exchange of {} with {} did not complete within "
            "parallel.timeout_s: {}", rank_, pp().global_ranks()[size_t(rank_)], step + 1, group.front().what(),
            peers, e.what());
    }
    idle += seconds_since(tw);
  };
  auto keep_for_send = [&](const Tensor& out, parallel::PipeMessage::Kind kind, int k, int m) {
    Tensor kept = keep.alloc(out.dtype, out.shape);
    be.copy(out, kept);
    outbox[at(kind, k, m)] = kept;
  };
  using Msg = parallel::PipeMessage;
  const bool kill = failpoint::hits(failpoint::Point::KillStage, rank_, step + 1);
  const float loss_scale = s.scaler.scale() / float(M);
  for (const auto& st : plan) {
    exchange(st.group);
    for (int ai : st.actions) {
      const auto& a = acts[size_t(ai)];
      const int k = a.chunk * P + rank_;
      const int m = a.micro;
      Ctx ctx{be, *s.arena, true, {}, {}};
      ctx.tp = s.tp;
      ctx.units = hooks;
      GptModel& model = chunk(a.chunk);
      const Tensor in = k == 0 ? xs[size_t(m)] : inbox[at(Msg::Activations, k, m)];
      if (a.kind == parallel::PipeAction::Forward) {
        if (hooks) dp->begin_eval();  // a pass without gradients
        Tensor out = model.forward(ctx, in);
        if (k == S - 1) {
          GptLoss loss;
          Tensor losses = loss.forward(ctx, out, ys[size_t(m)], spec.vocab_size, loss_scale);
          Tensor slot = s.loss_slot(m);
          be.sum_into(losses, 1.0, slot, false);
        } else {
          keep_for_send(out, Msg::Activations, k + 1, m);
        }
        if (hooks) dp->end_eval();
        if (kill) {
          log::error("failpoint pp.kill_stage: pipeline stage {} (rank {}) kills itself at step {}", rank_,
                     pp().global_ranks()[size_t(rank_)], step + 1);
          std::raise(SIGKILL);
        }
      } else {
        // the stage's forward again (its activations were dropped), then its backward
        if (hooks) dp->begin_micro(true);
        Tensor out = model.forward(ctx, in);
        Tensor dout;
        GptLoss loss;
        if (k == S - 1) {
          loss.forward(ctx, out, ys[size_t(m)], spec.vocab_size, loss_scale);
          dout = loss.backward();
        } else {
          dout = inbox[at(Msg::Gradients, k, m)];
        }
        model.backward(ctx, dout);
        if (k > 0) keep_for_send(model.input_grad(), Msg::Gradients, k - 1, m);
        if (hooks) dp->end_micro();  // the units' reduce-scatters done (counted as the stage's busy time)
      }
      s.arena->reset();
    }
  }
  // a stage that ends its schedule early waits here for the last one: the bubble at its end
  const auto tb = Clock::now();
  pp().barrier();
  idle += seconds_since(tb);
  times.idle_s = idle;
  times.busy_s = seconds_since(t0) - idle;
  return units;
}

double Pipeline::eval_loss_sum(Runtime& s, const Tensor& x, const Tensor& y) {
  Backend& be = *s.be;
  const int P = l_.stages, V = l_.virtual_stages, S = P * V;
  const GptSpec& spec = chunk(0).spec();
  const Shape act{x.dim(0), x.dim(1), int64_t(spec.n_embd)};
  const int prev = (rank_ + P - 1) % P, next = (rank_ + 1) % P;
  std::vector<std::shared_ptr<comm::Work>> sends;
  double sum = 0;
  auto what = [](int k) { return fmt::format("evaluation activations for virtual stage {}", k); };
  for (int c = 0; c < V; ++c) {
    const int k = c * P + rank_;
    Ctx ctx{be, *s.arena, false, {}, {}};
    ctx.tp = s.tp;
    ctx.units = s.units;  // ZeRO-3 (the evaluation's pass begun by its caller)
    Tensor in = x;
    if (k > 0) {
      in = s.arena->alloc(s.params.compute_dtype(), act);
      try {
        pp().recv_async(in, prev, what(k))->wait();
      } catch (const RuntimeFault& e) {
        fault("pipeline stage {} (rank {}), evaluation: no activations from pipeline stage {} (rank {}) within "
              "parallel.timeout_s: {}", rank_, pp().global_ranks()[size_t(rank_)], prev,
              pp().global_ranks()[size_t(prev)], e.what());
      }
    }
    Tensor out = chunk(c).forward(ctx, in);
    if (k == S - 1) {
      GptLoss loss;
      sum += be.sum(loss.forward(ctx, out, y, spec.vocab_size));
    } else {
      sends.push_back(pp().send_async(out, next, what(k + 1)));
    }
  }
  for (auto& w : sends) w->wait();
  return sum;
}

double Pipeline::reduce_grads(ParamStore& ps, Arena& arena, parallel::DataParallel* dp) {
  const bool scatters = dp && dp->scatters_grads();
  if (scatters) sum_tied_grads(ps, arena);
  const double waited = dp ? dp->reduce_grads() : 0.0;
  if (!scatters) sum_tied_grads(ps, arena, dp && dp->shards_params() ? &dp->state_comm() : nullptr);
  return waited;
}

void Pipeline::after_update(ParamStore& ps, parallel::DataParallel* dp) {
  if (dp && dp->scatters_grads()) copy_tied_weights(ps);
}

void Pipeline::sum_tied_grads(ParamStore& ps, Arena& arena, comm::Communicator* shards) {
  if ((!first() && !last()) || l_.tied.empty()) return;  // an untied head: nothing shared
  const int id = ps.find_param(l_.tied);
  DTRAIN_CHECK(id >= 0, "pipeline: the first/last stage holds no {}", l_.tied);
  Backend& be = ps.backend();
  if (shards) return sum_tied_sharded(ps, arena, id, *shards);
  Tensor g = ps.grad(id);
  Tensor mine = arena.alloc(DType::F32, g.shape), theirs = arena.alloc(DType::F32, g.shape);
  be.copy(g, mine);
  const int peer = first() ? l_.stages - 1 : 0;
  const std::string what = "the tied embedding's gradient";
  pp().p2p_async({comm::P2POp{comm::P2POp::Kind::Send, mine, peer, what},
                  comm::P2POp{comm::P2POp::Kind::Recv, theirs, peer, what}})
      ->wait();
  // the first stage's part plus the last's, in that order on both (the same bits)
  if (first()) be.add(mine, theirs, g);
  else be.add(theirs, mine, g);
  arena.reset();
}

void Pipeline::sum_over_stages(Backend& be, std::vector<double>& v) {
  const size_t n = v.size();
  if (flags_.bytes() < n * 4) flags_ = Buffer(be, n * 4);
  std::vector<float> f(v.begin(), v.end());
  be.copy_from_host(flags_.data(), f.data(), n * 4);
  Tensor t = flags_.tensor(DType::F32, Shape{int64_t(n)});
  pp().allreduce(t, comm::ReduceOp::Sum);
  be.copy_to_host(f.data(), flags_.data(), n * 4);
  for (size_t i = 0; i < n; ++i) v[i] = f[i];
}

void Pipeline::sum_tied_sharded(ParamStore& ps, Arena& arena, int id, comm::Communicator& shards) {
  Backend& be = ps.backend();
  const ParamDesc& d = ps.params()[size_t(id)];
  const int u = ps.unit_of(id);
  const UnitDesc& unit = ps.units()[size_t(u)];
  const int64_t S = ps.unit_shard_size(u), W = shards.size(), r = shards.rank();
  const int64_t n = d.shape.numel(), at = d.offset - unit.begin;  // wte within the unit
  // the unit's reduced gradient, every rank's shard (padded to S each)
  Tensor shard = ps.unit_shard_grads(u);
  Tensor all = arena.alloc(DType::F32, Shape{W * S});
  shards.allgather(shard, all);
  Tensor mine = arena.alloc(DType::F32, Shape{n}), theirs = arena.alloc(DType::F32, Shape{n});
  be.copy(all.slice0(at, at + n), mine);
  const int peer = first() ? l_.stages - 1 : 0;
  const std::string what = "the tied embedding's gradient (its shard group's part)";
  pp().p2p_async({comm::P2POp{comm::P2POp::Kind::Send, mine, peer, what},
                  comm::P2POp{comm::P2POp::Kind::Recv, theirs, peer, what}})
      ->wait();
  // the first stage's part plus the last's, in that order on both (the same bits)
  Tensor sum = arena.alloc(DType::F32, Shape{n});
  if (first()) be.add(mine, theirs, sum);
  else be.add(theirs, mine, sum);
  // this rank's shard of the unit covers unit elements [r S, r S + S): its part of wte back
  const int64_t lo = std::max(at, r * S), hi = std::min(at + n, std::min((r + 1) * S, unit.numel()));
  if (hi > lo) {
    Tensor dst = shard.slice0(lo - r * S, hi - r * S);
    be.copy(sum.slice0(lo - at, hi - at), dst);
  }
  arena.reset();
}

void Pipeline::copy_tied_weights(ParamStore& ps) {
  if (!first() && !last()) return;
  if (l_.tied.empty()) return;  // an untied head: nothing shared
  const int id = ps.find_param(l_.tied);
  DTRAIN_CHECK(id >= 0, "pipeline: the first/last stage holds no {}", l_.tied);
  Tensor w = ps.param(id);
  if (first()) pp().send_async(w, l_.stages - 1, "the tied embedding's weights")->wait();
  else pp().recv_async(w, 0, "the tied embedding's weights")->wait();
}

double Pipeline::grad_norm(ParamStore& ps, TensorParallelOps* tp, Arena& arena, double scale,
                           const parallel::ShardedGrads& shards) {
  Backend& be = ps.backend();
  auto counted_on_first = [&](const ParamDesc& d) { return last() && !l_.tied.empty() && d.name == l_.tied; };
  parallel::GradSquares sq =
      parallel::sum_over_shards(shards, be, arena, parallel::grad_squares(ps, shards, counted_on_first));
  if (tp) {
    Tensor c = arena.alloc(DType::F32, Shape{1});
    const float cf = float(sq.cut);
    be.copy_from_host(c.data, &cf, 4);
    tp->allreduce_sum(c);
    float got = 0;
    be.copy_to_host(&got, c.data, 4);
    sq.cut = got;
    arena.reset();
  }
  std::vector<double> v = {sq.cut + sq.whole};
  sum_over_stages(be, v);
  return std::sqrt(v[0]) * std::abs(scale);
}

}  // namespace dtrain

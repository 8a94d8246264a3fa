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
    : l_(l), rank_(rank), chunks_(std::move(chunks)), sync_(rank, l.stages, l.tied) {
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
  // stage); the first stage keeps the inputs, the last the targets and the loss weights, every
  // stage the positions of packed documents
  std::vector<Tensor> xs(static_cast<size_t>(M)), ys(static_cast<size_t>(M)), poss(static_cast<size_t>(M));
  std::vector<StagedBatch> weights(static_cast<size_t>(M));
  int64_t units = 0, B = 0, T = 0;
  for (int m = 0; m < M; ++m) {
    const StagedBatch sb = task.stage_batch(s, uint64_t(m * s.world + s.rank), t);
    weights[size_t(m)] = sb;
    if (sb.positions.defined()) {
      poss[size_t(m)] = keep.alloc(sb.positions.dtype, sb.positions.shape);
      be.copy_device(poss[size_t(m)].data, sb.positions.data, sb.positions.nbytes());
    }
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
  // the last stage's loss of micro-batch m: losses summed into its slot, dlogits from `loss`
  auto stage_loss = [&](Ctx& ctx, GptLoss& loss, const Tensor& out, int m) {
    const StagedBatch& w = weights[size_t(m)];
    if (!w.weighted) return loss.forward(ctx, out, ys[size_t(m)], spec.vocab_size, loss_scale);
    return loss.forward(ctx, out, ys[size_t(m)], spec.vocab_size, s.scaler.scale() * w.grad_scale, 1);
  };
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
      if (poss[size_t(m)].defined()) model.set_positions(poss[size_t(m)], true);
      if (a.kind == parallel::PipeAction::Forward) {
        if (hooks) dp->begin_eval();  // a pass without gradients
        Tensor out = model.forward(ctx, in);
        if (k == S - 1) {
          GptLoss loss;
          Tensor losses = stage_loss(ctx, loss, out, m);
          Tensor slot = s.loss_slot(m);
          be.sum_into(losses, weights[size_t(m)].loss_weight, slot, false);
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
          stage_loss(ctx, loss, out, m);
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

double Pipeline::eval_loss_sum(Runtime& s, const Tensor& x, const Tensor& y, const Tensor& positions) {
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
    if (positions.defined()) chunk(c).set_positions(positions, true);
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

}  // namespace dtrain

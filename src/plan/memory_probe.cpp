#include "plan/memory_probe.h"

#include <chrono>
#include <exception>
#include <thread>

#include "comm/gloo_comm.h"
#include "comm/store.h"
#include "core/error.h"
#include "session/dist_setup.h"
#include "session/session.h"
#include "session/step.h"
#include "session/task.h"

namespace dtrain {

namespace {

void set_recompute(Config& cfg, const std::string& recompute) {
  if (!recompute.empty()) cfg.assign(cfg.train.recompute, recompute);
}

}  // namespace

Config cpu_recipe(const Config& recipe) {
  Config cfg = recipe;
  cfg.assign(cfg.run.device, "cpu");
  cfg.assign(cfg.train.cuda_graph, false);
  return cfg;
}

std::vector<std::string> recompute_choices(const Config& cfg) {
  std::vector<std::string> out;
  for (std::string_view c : cfg.spec_of(cfg.train.recompute).choices) out.emplace_back(c);
  if (out.empty()) out.emplace_back("");
  return out;
}

ActivationProfile measure_activations(const Config& recipe, const std::string& recompute, int64_t batch) {
  Config cfg = cpu_recipe(recipe);
  cfg.assign(cfg.train.batch_size, batch);
  cfg.assign(cfg.train.grad_accum, 1);
  cfg.assign(cfg.eval.batch_size, batch);
  cfg.assign(cfg.eval.max_batches, 1);
  set_recompute(cfg, recompute);
  SessionOptions so;
  so.with_optimizer = false;
  auto s = make_session(cfg, so);
  Backend& be = *s->be;
  ActivationProfile a;
  a.recompute = recompute;
  a.batch = batch;
  // one micro-batch of train_step (session/step.cpp): forward + loss + backward on the arena
  s->params.refresh_compute();
  s->params.zero_grads();
  Tensor loss_sum = s->loss_slot(0);
  StepTimes t;
  const StagedBatch sb = s->task->stage_batch(*s, 0, t);
  {
    Ctx ctx{be, *s->arena, true, {}, {}};
    ctx.recompute = s->recompute;
    ctx.scratch = s->scratch_arena.get();
    Tensor dout = s->task->forward_loss(*s, ctx, 1, loss_sum);
    s->model->backward(ctx, dout);
  }
  be.synchronize();
  a.train_high_water = int64_t(s->arena->high_water());
  if (s->scratch_arena) a.scratch_high_water = int64_t(s->scratch_arena->high_water());
  a.input_bytes = int64_t(sb.x.nbytes());
  a.label_bytes = int64_t(sb.y.nbytes());
  if (s->task->has_eval()) {  // one evaluation batch, on an arena of its own
    s->arena = std::make_unique<Arena>(be);
    evaluate(*s);
    a.eval_high_water = int64_t(s->arena->high_water());
  }
  return a;
}

std::vector<RankMemory> measure_ranks(const Config& recipe, int zero, int world, const std::string& recompute,
                                      int steps) {
  DTRAIN_CHECK(world >= 1 && zero >= 0 && zero <= 3 && steps >= 0, "measure_ranks: zero {} on {} ranks", zero, world);
  Config cfg = cpu_recipe(recipe);
  cfg.assign(cfg.parallel.zero, zero);
  if (zero != 3) cfg.assign(cfg.parallel.shard_group_size, 0);  // hybrid sharding is ZeRO-3's
  cfg.assign(cfg.eval.max_batches, 1);
  set_recompute(cfg, recompute);
  const double lr = cfg.optim.lr;
  std::vector<RankMemory> out(static_cast<size_t>(world));
  auto record = [](RankMemory& m, Session& s) {
    m.after_steps = s.be->alloc_counts().peak_bytes;
    m.arena_high_water = int64_t(s.arena->high_water());
    if (s.scratch_arena) m.scratch_high_water = int64_t(s.scratch_arena->high_water());
  };
  if (world == 1) {
    SessionOptions so;
    so.with_eval_data = steps > 0;
    auto s = make_session(cfg, so);
    out[0].after_attach = s->be->alloc_counts().peak_bytes;
    for (int i = 0; i < steps; ++i) train_step(*s, i, lr);
    if (steps > 0) evaluate(*s);
    record(out[0], *s);
    return out;
  }
  const int shard_group = resolve_shard_group_size(cfg, world);
  const std::string token = "dtrain-plan-measure";
  comm::StoreServer server("127.0.0.1", 0, token);
  const double timeout = double(cfg.parallel.timeout_s);
  std::vector<std::exception_ptr> errs(static_cast<size_t>(world));
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r)
    th.emplace_back([&, r] {
      try {
        // as the trainer: rank 0 evaluates, under ZeRO-3 every rank (the units are gathered)
        const bool evaluates = steps > 0 && (r == 0 || zero == 3);
        SessionOptions so;
        so.with_eval_data = evaluates;
        so.rank = r;
        so.world_size = world;
        so.shard_optimizer = zero == 1 || zero == 2;
        so.shard_params = zero == 3;
        so.shard_group_size = shard_group;
        auto s = make_session(cfg, so);
        DistRuntime d;
        d.env.rank = r;
        d.env.world_size = world;
        d.env.distributed = true;
        d.zero_stage = zero;
        d.shard_group_size = shard_group;
        d.reduce_dtype = zero == 3 && cfg.parallel.reduce_dtype == "bf16" ? DType::BF16 : DType::F32;
        d.sync_bn = cfg.model.sync_bn;
        d.compression = resolve_grad_compression(cfg);
        d.store = std::make_unique<comm::StoreClient>("127.0.0.1", server.port(), token,
                                                      std::chrono::milliseconds(int64_t(timeout * 1000)));
        comm::GlooOptions o;
        o.timeout_s = timeout;
        d.comm = std::make_unique<comm::GlooCommunicator>(*d.store, r, world, o, s->be.get());
        attach(d, *s, cfg.parallel.bucket_mb);
        out[size_t(r)].after_attach = s->be->alloc_counts().peak_bytes;
        for (int i = 0; i < steps; ++i) train_step(*s, i, lr, d.dp.get());
        if (evaluates) evaluate(*s, d.dp.get());
        record(out[size_t(r)], *s);
      } catch (...) {
        errs[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : th) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
  return out;
}

}  // namespace dtrain

// The parallel layout (layout.h): resolved once, every rule (layout_rules.cpp) checked together.
#include "session/layout.h"

#include <fmt/format.h>

#include <functional>
#include <vector>

#include "core/error.h"

namespace dtrain {

ParallelLayout::Coord ParallelLayout::coord(int rank) const {
  DTRAIN_CHECK(rank >= 0 && rank < world, "rank {} of {}", rank, world);
  const int per_stage = data * tensor;
  return Coord{rank / per_stage, rank % per_stage / tensor, rank % tensor};
}

int ParallelLayout::rank_of(const Coord& c) const { return c.pipe * data * tensor + c.data * tensor + c.tensor; }

SessionOptions ParallelLayout::session_options(int rank) const {
  const Coord c = coord(rank);
  SessionOptions so;
  so.rank = c.data;
  so.world_size = data;
  so.tp_rank = c.tensor;
  so.tp_size = tensor;
  so.pp_rank = c.pipe;
  so.pp_size = pipeline;
  so.pipe = pipe;
  so.shard_optimizer = zero == 1 || zero == 2;
  so.shard_params = zero == 3;
  so.shard_group_size = shard_group;
  return so;
}

std::string ParallelLayout::describe() const {
  std::string ranks = fmt::format("{} data", data);
  if (pipeline > 1) ranks = fmt::format("{} stages x ", pipeline) + ranks;
  if (tensor > 1) ranks += fmt::format(" x {} tensor{}", tensor, sequence ? " (sequence parallel)" : "");
  std::string zs = data > 1 ? fmt::format(", ZeRO-{}", zero) : "";
  if (data > 1 && zero == 3 && shard_group < data) zs += fmt::format(" in shard groups of {}", shard_group);
  return fmt::format("{} rank{}: {}{}, global batch {} = {} x {} micro-batch{} x {}", world, world == 1 ? "" : "s",
                     ranks, zs, global_batch(), micro_batch, grad_accum, grad_accum == 1 ? "" : "es", data);
}

namespace {

// The data-parallel ranks of `world` under the recipe's tensor and pipeline sizes (0 when they
// do not divide it: the checks say so).
int data_ranks(const Config& cfg, int world) {
  const int64_t tp_pp = cfg.parallel.tensor * cfg.parallel.pipeline;
  return world >= 1 && tp_pp > 0 && world % tp_pp == 0 ? int(world / tp_pp) : 0;
}

// train.grad_accum from the global batch: the recipe's, else the resumed checkpoint's when it
// is not this world's. Empty note: nothing derived.
std::string derive_accumulation(Config& cfg, int data, int64_t resumed_global, int resumed_data) {
  const int64_t per_step = cfg.train.batch_size * data;  // sequences of one micro-batch over the data ranks
  const int64_t accum = cfg.train.grad_accum;
  int64_t want = 0;
  std::string why;
  if (cfg.train.global_batch > 0) {
    want = cfg.train.global_batch;
    why = fmt::format("{} = {}", cfg.key_of(cfg.train.global_batch), want);
    if (cfg.given(cfg.train.grad_accum) && accum * per_step != want)
      user_error("{}: {} = {} and {} = {} disagree: {} x {} x {} data rank{} = {} (give one of them)", cfg.source(),
                 cfg.key_of(cfg.train.global_batch), want, cfg.key_of(cfg.train.grad_accum), accum,
                 cfg.train.batch_size, accum, data, data == 1 ? "" : "s", accum * per_step);
  } else if (resumed_data > 0 && resumed_data != data && resumed_global != accum * per_step) {
    want = resumed_global;
    why = fmt::format("the checkpoint's global batch of {} (written by {} data rank{})", want, resumed_data,
                      resumed_data == 1 ? "" : "s");
  } else {
    return "";
  }
  if (want % per_step != 0)
    user_error("{}: {}: {} x {} data rank{} cannot make a global batch of {} with whole micro-batches; set {} (or "
               "{}) so that it divides {}",
               cfg.source(), why, cfg.train.batch_size, data, data == 1 ? "" : "s", want,
               cfg.key_of(cfg.train.batch_size), cfg.key_of(cfg.train.global_batch), want);
  const int64_t derived = want / per_step;
  if (derived == accum) return "";
  cfg.assign(cfg.train.grad_accum, derived);
  return fmt::format("{} = {} (was {}): {} over {} data rank{} of {} sequences", cfg.key_of(cfg.train.grad_accum),
                     derived, accum, why, data, data == 1 ? "" : "s", cfg.train.batch_size);
}

}  // namespace

ParallelLayout resolve_layout(Config& cfg, int world, int64_t resumed_global_batch, int resumed_data_ranks) {
  ParallelLayout l;
  l.world = world;
  l.tensor = int(cfg.parallel.tensor);
  l.pipeline = int(cfg.parallel.pipeline);
  l.sequence = cfg.parallel.sequence;
  l.zero = int(cfg.parallel.zero);
  l.data = data_ranks(cfg, world);
  std::vector<std::string> problems;
  const std::string prefix = cfg.source() + ": ";
  auto check = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const UserError& e) {
      std::string m = e.what();
      if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
      problems.push_back(m);
    }
  };
  check([&] {
    if (l.data > 0) l.batch_note = derive_accumulation(cfg, l.data, resumed_global_batch, resumed_data_ranks);
  });
  check([&] { check_tensor_parallel(cfg, world); });
  check([&] { l.pipe = check_pipeline(cfg, world); });
  check([&] {
    if (l.data > 0) l.shard_group = resolve_shard_group_size(cfg, l.data);
  });
  check([&] { l.reduce_dtype = resolve_reduce_dtype(cfg); });
  check([&] { l.compression = resolve_grad_compression(cfg); });
  check([&] {
    if (cfg.train.cuda_graph && l.data > 1)
      user_error("{}: {} = true does not work with data parallelism yet ({} data ranks: gradient collectives run "
                 "inside backward); set it to false", cfg.source(), cfg.key_of(cfg.train.cuda_graph), l.data);
  });
  if (!problems.empty()) {
    std::string all = problems[0];
    for (size_t k = 1; k < problems.size(); ++k) all += "; and " + problems[k];
    if (problems.size() > 1) all = fmt::format("{} problems with the layout on {} ranks: {}", problems.size(), world, all);
    throw UserError(prefix + all);
  }
  l.micro_batch = cfg.train.batch_size;
  l.grad_accum = cfg.train.grad_accum;
  return l;
}

}  // namespace dtrain

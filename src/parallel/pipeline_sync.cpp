#include "parallel/pipeline_sync.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "parallel/data_parallel.h"

namespace dtrain::parallel {

PipelineSync::PipelineSync(int rank, int stages, std::string tied) : rank_(rank), stages_(stages), tied_(std::move(tied)) {}

comm::Communicator& PipelineSync::pp() {
  DTRAIN_CHECK(pp_ != nullptr, "pipeline: no pp group attached");
  return *pp_;
}

double PipelineSync::reduce(ParamStore& ps, Arena& arena, DataParallel* dp) {
  const bool scatters = dp && dp->scatters_grads();
  if (scatters) sum_tied(ps, arena);
  const double waited = dp ? dp->reduce_grads() : 0.0;
  if (!scatters) sum_tied(ps, arena, dp && dp->shards_params() ? &dp->state_comm() : nullptr);
  return waited;
}

void PipelineSync::after_update(ParamStore& ps, DataParallel* dp) {
  if (dp && dp->scatters_grads()) copy_tied_weights(ps);
}

// `mine` goes to the other end of the tied pair while `theirs` comes from it (one group).
void PipelineSync::swap_with_peer(const Tensor& mine, const Tensor& theirs, const std::string& what) {
  const int peer = first() ? stages_ - 1 : 0;
  pp().p2p_async({comm::P2POp{comm::P2POp::Kind::Send, mine, peer, what},
                  comm::P2POp{comm::P2POp::Kind::Recv, theirs, peer, what}})
      ->wait();
}

void PipelineSync::sum_tied(ParamStore& ps, Arena& arena, comm::Communicator* shards) {
  if ((!first() && !last()) || tied_.empty()) return;  // an untied head: nothing shared
  const int id = ps.find_param(tied_);
  DTRAIN_CHECK(id >= 0, "pipeline: the first/last stage holds no {}", tied_);
  if (shards) return sum_tied_sharded(ps, arena, id, *shards);
  Backend& be = ps.backend();
  Tensor g = ps.grad(id);
  Tensor mine = arena.alloc(DType::F32, g.shape), theirs = arena.alloc(DType::F32, g.shape);
  be.copy(g, mine);
  swap_with_peer(mine, theirs, "the tied embedding's gradient");
  // the first stage's part plus the last's, in that order on both (the same bits)
  if (first()) be.add(mine, theirs, g);
  else be.add(theirs, mine, g);
  arena.reset();
}

void PipelineSync::sum_tied_sharded(ParamStore& ps, Arena& arena, int id, comm::Communicator& shards) {
  Backend& be = ps.backend();
  const ParamDesc& d = ps.params()[size_t(id)];
  const int u = ps.unit_of(id);
  const UnitDesc& unit = ps.units()[size_t(u)];
  const int64_t S = ps.unit_shard_size(u), W = shards.size(), r = shards.rank();
  const int64_t n = d.shape.numel(), at = d.offset - unit.begin;  // the tied parameter within the unit
  // the unit's reduced gradient, every rank's shard (padded to S each)
  Tensor shard = ps.unit_shard_grads(u);
  Tensor all = arena.alloc(DType::F32, Shape{W * S});
  shards.allgather(shard, all);
  Tensor mine = arena.alloc(DType::F32, Shape{n}), theirs = arena.alloc(DType::F32, Shape{n});
  be.copy(all.slice0(at, at + n), mine);
  swap_with_peer(mine, theirs, "the tied embedding's gradient (its shard group's part)");
  // the first stage's part plus the last's, in that order on both (the same bits)
  Tensor sum = arena.alloc(DType::F32, Shape{n});
  if (first()) be.add(mine, theirs, sum);
  else be.add(theirs, mine, sum);
  // this rank's shard of the unit covers unit elements [r S, r S + S): its part of the sum back
  const int64_t lo = std::max(at, r * S), hi = std::min(at + n, std::min((r + 1) * S, unit.numel()));
  if (hi > lo) {
    Tensor dst = shard.slice0(lo - r * S, hi - r * S);
    be.copy(sum.slice0(lo - at, hi - at), dst);
  }
  arena.reset();
}

void PipelineSync::copy_tied_weights(ParamStore& ps) {
  if ((!first() && !last()) || tied_.empty()) return;  // an untied head: nothing shared
  const int id = ps.find_param(tied_);
  DTRAIN_CHECK(id >= 0, "pipeline: the first/last stage holds no {}", tied_);
  Tensor w = ps.param(id);
  if (first()) pp().send_async(w, stages_ - 1, "the tied embedding's weights")->wait();
  else pp().recv_async(w, 0, "the tied embedding's weights")->wait();
}

void PipelineSync::sum(Backend& be, std::vector<double>& v) {
  const size_t n = v.size();
  if (flags_.bytes() < n * 4) flags_ = Buffer(be, n * 4);
  std::vector<float> f(v.begin(), v.end());
  be.copy_from_host(flags_.data(), f.data(), n * 4);
  Tensor t = flags_.tensor(DType::F32, Shape{int64_t(n)});
  pp().allreduce(t, comm::ReduceOp::Sum);
  be.copy_to_host(f.data(), flags_.data(), n * 4);
  for (size_t i = 0; i < n; ++i) v[i] = f[i];
}

double PipelineSync::grad_norm(ParamStore& ps, TensorParallelOps* tp, Arena& arena, double scale,
                             const ShardedGrads& shards) {
  Backend& be = ps.backend();
  auto counted_on_first = [&](const ParamDesc& d) { return last() && !tied_.empty() && d.name == tied_; };
  GradSquares sq = sum_over_shards(shards, be, arena, grad_squares(ps, shards, counted_on_first));
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
  sum(be, v);
  return std::sqrt(v[0]) * std::abs(scale);
}

}  // namespace dtrain::parallel

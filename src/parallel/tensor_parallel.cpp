#include "parallel/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/buffer.h"

namespace dtrain::parallel {

std::vector<float> tp_gather_universal(comm::Communicator& tp, const ParamStore& ps, const std::vector<float>& local) {
  const int64_t n = ps.num_params(), W = tp.size();
  DTRAIN_CHECK(int64_t(local.size()) == n && W == ps.tp_size(), "tp_gather_universal: {} values, group of {}",
               local.size(), W);
  Backend& be = ps.backend();
  Buffer mine(be, size_t(std::max<int64_t>(n, 1)) * 4), all(be, size_t(std::max<int64_t>(n * W, 1)) * 4);
  if (n) be.copy_from_host(mine.data(), local.data(), size_t(n) * 4);
  Tensor a = mine.tensor(DType::F32, Shape{n}), b = all.tensor(DType::F32, Shape{n * W});
  tp.allgather(a, b);
  std::vector<float> host(size_t(n * W));
  if (!host.empty()) be.copy_to_host(host.data(), all.data(), host.size() * 4);
  std::vector<const float*> parts;
  for (int64_t r = 0; r < W; ++r) parts.push_back(host.data() + r * n);
  return ps.tp_assemble(parts);
}

std::vector<float> tp_gather_params(comm::Communicator& tp, const ParamStore& ps) {
  std::vector<float> local(static_cast<size_t>(ps.num_params()));
  if (!local.empty()) ps.backend().copy_to_host(local.data(), ps.flat_params().data, local.size() * 4);
  return tp_gather_universal(tp, ps, local);
}

std::vector<ParamStore::Exported> tp_gather_state(comm::Communicator& tp, const ParamStore& ps,
                                                  std::vector<ParamStore::Exported> local) {
  for (ParamStore::Exported& x : local) {
    if (x.dtype != "F32") continue;
    DTRAIN_CHECK(x.shape == std::vector<int64_t>{ps.num_params()}, "tp_gather_state: '{}' is not the local layout",
                 x.name);
    std::vector<float> v(static_cast<size_t>(ps.num_params()));
    std::memcpy(v.data(), x.bytes.data(), v.size() * 4);
    const std::vector<float> u = tp_gather_universal(tp, ps, v);
    x.shape = {int64_t(u.size())};
    x.bytes.resize(u.size() * 4);
    std::memcpy(x.bytes.data(), u.data(), x.bytes.size());
  }
  return local;
}

namespace {

// Calls f(d, g) for each run of parameter d's gradient that `shards` holds: g is the run's
// elements (in `shards.grads`, or flat_grads by default), in flat order.
template <class F>
void for_each_held(const ParamStore& ps, const ShardedGrads& shards, F&& f) {
  if (shards.pieces.empty()) {
    const Tensor flat = ps.flat_grads();
    for (const ParamDesc& d : ps.params())
      if (d.shape.numel()) f(d, flat.slice0(d.offset, d.offset + d.shape.numel()));
    return;
  }
  for (const ParamDesc& d : ps.params())
    for (const FlatPiece& p : shards.pieces) {
      const int64_t a = std::max(d.offset, p.global), b = std::min(d.offset + d.shape.numel(), p.global + p.count);
      if (b > a) f(d, shards.grads.slice0(p.local + (a - p.global), p.local + (b - p.global)));
    }
}

}  // namespace

void tp_sum_partial_grads(TensorParallelOps& tp, const ParamStore& ps, Arena& arena, const ShardedGrads& shards) {
  Backend& be = ps.backend();
  int64_t n = 0;
  for_each_held(ps, shards, [&](const ParamDesc& d, const Tensor& g) { n += d.tp_partial ? g.numel() : 0; });
  if (n == 0) return;
  Tensor all = arena.alloc(DType::F32, Shape{n});
  int64_t at = 0;
  for_each_held(ps, shards, [&](const ParamDesc& d, const Tensor& g) {
    if (!d.tp_partial) return;
    Tensor dst = all.slice0(at, at + g.numel());
    be.copy(g, dst);
    at += g.numel();
  });
  tp.allreduce_sum(all);
  at = 0;
  for_each_held(ps, shards, [&](const ParamDesc& d, const Tensor& g) {
    if (!d.tp_partial) return;
    Tensor dst = g;
    be.copy(all.slice0(at, at + g.numel()), dst);
    at += g.numel();
  });
  arena.reset();
}

TpFlags tp_agree(TensorParallelOps& tp, Backend& be, Arena& arena, TpFlags mine) {
  Tensor t = arena.alloc(DType::F32, Shape{2});
  float v[2] = {mine.stop ? 1.f : 0.f, mine.nonfinite ? 1.f : 0.f};
  be.copy_from_host(t.data, v, sizeof v);
  tp.allreduce_sum(t);
  be.copy_to_host(v, t.data, sizeof v);
  arena.reset();
  return {v[0] > 0, v[1] > 0};
}

GradSquares grad_squares(const ParamStore& ps, const ShardedGrads& shards, const std::function<bool(const ParamDesc&)>& skip) {
  Backend& be = ps.backend();
  GradSquares sq;
  for_each_held(ps, shards, [&](const ParamDesc& d, const Tensor& g) {
    if (!(skip && skip(d))) (d.tp_dim >= 0 ? sq.cut : sq.whole) += be.sum_squares(g);
  });
  return sq;
}

GradSquares sum_over_shards(const ShardedGrads& shards, Backend& be, Arena& arena, GradSquares sq) {
  if (!shards.group) return sq;
  Tensor t = arena.alloc(DType::F32, Shape{2});
  float v[2] = {float(sq.cut), float(sq.whole)};
  be.copy_from_host(t.data, v, sizeof v);
  shards.group->allreduce(t, comm::ReduceOp::Sum);
  be.copy_to_host(v, t.data, sizeof v);
  arena.reset();
  return {double(v[0]), double(v[1])};
}

double tp_grad_norm(TensorParallelOps& tp, const ParamStore& ps, Arena& arena, double scale,
                    const ShardedGrads& shards) {
  Backend& be = ps.backend();
  const GradSquares sq = sum_over_shards(shards, be, arena, grad_squares(ps, shards));
  Tensor t = arena.alloc(DType::F32, Shape{1});
  const float c = float(sq.cut);
  be.copy_from_host(t.data, &c, 4);
  tp.allreduce_sum(t);
  float total = 0;
  be.copy_to_host(&total, t.data, 4);
  arena.reset();
  return std::sqrt(double(total) + sq.whole) * std::abs(scale);
}

}  // namespace dtrain::parallel

#include "parallel/tensor_parallel.h"

#include <cmath>
#include <cstring>

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

void tp_sum_partial_grads(TensorParallelOps& tp, const ParamStore& ps, Arena& arena) {
  Backend& be = ps.backend();
  const auto& descs = ps.params();
  int64_t n = 0;
  for (const ParamDesc& d : descs)
    if (d.tp_partial) n += d.shape.numel();
  if (n == 0) return;
  Tensor all = arena.alloc(DType::F32, Shape{n});
  int64_t at = 0;
  for (size_t i = 0; i < descs.size(); ++i) {
    if (!descs[i].tp_partial) continue;
    const Tensor g = ps.grad(int(i));
    Tensor dst = all.slice0(at, at + g.numel());
    be.copy(g.view(Shape{g.numel()}), dst);
    at += g.numel();
  }
  tp.allreduce_sum(all);
  at = 0;
  for (size_t i = 0; i < descs.size(); ++i) {
    if (!descs[i].tp_partial) continue;
    Tensor g = ps.grad(int(i)).view(Shape{descs[i].shape.numel()});
    be.copy(all.slice0(at, at + g.numel()), g);
    at += g.numel();
  }
  arena.reset();
}

double tp_grad_norm(TensorParallelOps& tp, const ParamStore& ps, Arena& arena, double scale) {
  Backend& be = ps.backend();
  double cut = 0, whole = 0;
  const auto& descs = ps.params();
  for (size_t i = 0; i < descs.size(); ++i) {
    const double ss = be.sum_squares(ps.grad(int(i)));
    (descs[i].tp_dim >= 0 ? cut : whole) += ss;
  }
  Tensor t = arena.alloc(DType::F32, Shape{1});
  const float c = float(cut);
  be.copy_from_host(t.data, &c, 4);
  tp.allreduce_sum(t);
  float total = 0;
  be.copy_to_host(&total, t.data, 4);
  arena.reset();
  return std::sqrt(double(total) + whole) * std::abs(scale);
}

}  // namespace dtrain::parallel

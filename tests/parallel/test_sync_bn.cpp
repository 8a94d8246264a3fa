// Synchronised batch norm (model.sync_bn): two ranks, each with half of a batch, must
// compute what one batch norm computes over the whole batch: the same outputs and input
// gradients for their halves, parameter gradients that sum to the whole batch's, and the
// same running statistics. The ranks are threads here; Ctx::sync_sum is an in-memory sum
// (the trainer gives it the communicator's all-reduce; tests/train/test_train_dist.cpp runs that).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "core/rng.h"
#include "nn/layers.h"

using namespace dtrain;

namespace {

// Sums one host vector per participant; every participant gets the sum (a 2-party all-reduce).
class HostAllReduce {
 public:
  explicit HostAllReduce(int parties) : parties_(parties) {}
  void sum(std::vector<float>& v) {
    std::unique_lock<std::mutex> lk(mu_);
    const int64_t gen = gen_;
    if (arrived_ == 0) acc_.assign(v.size(), 0.f);
    REQUIRE(acc_.size() == v.size());
    for (size_t i = 0; i < v.size(); ++i) acc_[i] += v[i];
    if (++arrived_ == parties_) {
      result_ = acc_;
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lk, [&] { return gen_ != gen; });
    }
    v = result_;
  }

 private:
  int parties_, arrived_ = 0;
  int64_t gen_ = 0;
  std::vector<float> acc_, result_;
  std::mutex mu_;
  std::condition_variable cv_;
};

struct BnRun {
  std::vector<float> y, dx, dgamma, dbeta, running_mean, running_var;
};

// One training forward + backward of BatchNorm2d(C) on x/dy ([n,H,W,C] host data).
BnRun run_bn(const std::vector<float>& x, const std::vector<float>& dy, int64_t n, int64_t H, int64_t W, int C,
             HostAllReduce* sync) {
  auto be = make_backend("cpu", 0, 1);
  ParamStore ps;
  BatchNorm2d bn(ps, "bn", C);
  ps.finalize(*be);
  ps.initialize(1);
  std::vector<float> gb(size_t(2 * C));  // gamma, beta: not the trivial 1 and 0
  for (int c = 0; c < 2 * C; ++c) gb[size_t(c)] = 0.5f + 0.25f * float(c % 5) - (c >= C ? 0.6f : 0.f);
  be->copy_from_host(ps.flat_params().data, gb.data(), gb.size() * 4);
  Arena arena(*be);
  Ctx ctx{*be, arena, true, {}};
  if (sync)
    ctx.sync_sum = [&](Tensor& t) {
      std::vector<float> h(size_t(t.numel()));
      be->copy_to_host(h.data(), t.data, h.size() * 4);
      sync->sum(h);
      be->copy_from_host(t.data, h.data(), h.size() * 4);
    };
  const Shape s{n, H, W, C};
  Tensor xt = arena.alloc(DType::F32, s), dyt = arena.alloc(DType::F32, s);
  be->copy_from_host(xt.data, x.data(), x.size() * 4);
  be->copy_from_host(dyt.data, dy.data(), dy.size() * 4);
  Tensor y = bn.forward(ctx, xt);
  Tensor dx = bn.backward(ctx, dyt);
  auto host = [&](const Tensor& t) {
    std::vector<float> v(size_t(t.numel()));
    be->copy_to_host(v.data(), t.data, v.size() * 4);
    return v;
  };
  BnRun r;
  r.y = host(y);
  r.dx = host(dx);
  std::vector<float> g = host(ps.flat_grads()), b = host(ps.flat_buffers());
  r.dgamma.assign(g.begin(), g.begin() + C);
  r.dbeta.assign(g.begin() + C, g.end());
  r.running_mean.assign(b.begin(), b.begin() + C);
  r.running_var.assign(b.begin() + C, b.end());
  return r;
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double scale = 1e-12, err = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, double(std::fabs(b[i])));
    err = std::max(err, double(std::fabs(a[i] - b[i])));
  }
  return err / scale;
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("sync batch norm: 2 ranks with half a batch each equal one batch norm over the whole batch") {
  const int64_t n = 3, H = 4, W = 2;
  const int C = 5;
  const size_t half = size_t(n * H * W * C);
  // The two halves differ in mean and spread, so per-rank statistics would be far off.
  Rng r(12, 3);
  std::vector<float> x(2 * half), dy(2 * half);
  for (size_t i = 0; i < 2 * half; ++i) {
    const bool second = i >= half;
    x[i] = (second ? 2.f : -1.f) + (second ? 3.f : 0.5f) * r.normal();
    dy[i] = r.normal() + (second ? 0.3f : -0.2f);
  }
  const BnRun ref = run_bn(x, dy, 2 * n, H, W, C, nullptr);
  HostAllReduce ar(2);
  BnRun rank[2];
  std::thread t0([&] {
    rank[0] = run_bn({x.begin(), x.begin() + long(half)}, {dy.begin(), dy.begin() + long(half)}, n, H, W, C, &ar);
  });
  std::thread t1([&] {
    rank[1] = run_bn({x.begin() + long(half), x.end()}, {dy.begin() + long(half), dy.end()}, n, H, W, C, &ar);
  });
  t0.join();
  t1.join();
  for (int k = 0; k < 2; ++k) {
    CAPTURE(k);
    const std::vector<float> y_ref(ref.y.begin() + long(k * half), ref.y.begin() + long((k + 1) * half));
    const std::vector<float> dx_ref(ref.dx.begin() + long(k * half), ref.dx.begin() + long((k + 1) * half));
    CHECK(max_rel(rank[k].y, y_ref) < 1e-5);
    CHECK(max_rel(rank[k].dx, dx_ref) < 1e-4);
    CHECK(max_rel(rank[k].running_mean, ref.running_mean) < 1e-5);
    CHECK(max_rel(rank[k].running_var, ref.running_var) < 1e-5);
  }
  std::vector<float> dg(static_cast<size_t>(C)), db(static_cast<size_t>(C));
  for (int c = 0; c < C; ++c) {
    dg[size_t(c)] = rank[0].dgamma[size_t(c)] + rank[1].dgamma[size_t(c)];
    db[size_t(c)] = rank[0].dbeta[size_t(c)] + rank[1].dbeta[size_t(c)];
  }
  CHECK(max_rel(dg, ref.dgamma) < 1e-5);
  CHECK(max_rel(db, ref.dbeta) < 1e-5);
  // and without synchronisation the halves really would differ (the check above is not vacuous)
  const BnRun alone = run_bn({x.begin(), x.begin() + long(half)}, {dy.begin(), dy.begin() + long(half)}, n, H, W, C,
                             nullptr);
  CHECK(max_rel(alone.y, rank[0].y) > 0.1);
  CHECK(max_rel(alone.dx, rank[0].dx) > 0.1);
}
}

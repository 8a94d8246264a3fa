// Parity rows of the mixture-of-experts ops (nn/moe.h): the router's forward (softmax, top-k with
// and without renormalisation, the dispatch plan, dropless and with a capacity that drops
// slots, the column sums) and backward (through the gate values, the load-balancing term and the
// z-loss), the gather of the routed rows, the weighted combine (and its accumulating form) and
// its backward. Every row has a naive double reference; the backward ops have finite-difference
// gradient checks.
#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

#include "harness.h"

namespace dtrain::parity {
namespace {

// The reference router over logits [N,E] (as the tensor holds them): probs, lse, the top-k
// (largest first, the lower expert on ties), weights, counts, order and pos.
struct Route {
  Vals probs, lse, weights, stats;
  IntVec sel, counts, order, pos;
};
Route route(const HostVec& z, int64_t N, int64_t E, int64_t k, bool norm, int64_t cap) {
  Route r;
  r.probs.resize(size_t(N * E));
  r.lse.resize(size_t(N));
  r.sel.resize(size_t(N * k));
  r.weights.resize(size_t(N * k));
  for (int64_t n = 0; n < N; ++n) {
    double mx = z[size_t(n * E)];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, double(z[size_t(n * E + e)]));
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(z[size_t(n * E + e)] - mx);
    for (int64_t e = 0; e < E; ++e) r.probs[size_t(n * E + e)] = std::exp(z[size_t(n * E + e)] - mx) / s;
    r.lse[size_t(n)] = mx + std::log(s);
    std::vector<int> idx(static_cast<size_t>(E));
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int a, int b) { return r.probs[size_t(n * E + a)] > r.probs[size_t(n * E + b)]; });
    double ws = 0;
    for (int64_t j = 0; j < k; ++j) ws += r.probs[size_t(n * E + idx[size_t(j)])];
    for (int64_t j = 0; j < k; ++j) {
      r.sel[size_t(n * k + j)] = idx[size_t(j)];
      r.weights[size_t(n * k + j)] = r.probs[size_t(n * E + idx[size_t(j)])] / (norm ? ws : 1.0);
    }
  }
  r.counts.assign(size_t(E), 0);
  for (int32_t s : r.sel) ++r.counts[size_t(s)];
  std::vector<int64_t> next(static_cast<size_t>(E), 0), start(size_t(E), 0);
  for (int64_t e = 1; e < E; ++e) start[size_t(e)] = next[size_t(e)] = next[size_t(e - 1)] + r.counts[size_t(e - 1)];
  r.order.resize(size_t(N * k));
  r.pos.resize(size_t(N * k));
  for (int64_t s = 0; s < N * k; ++s) {
    const int64_t e = r.sel[size_t(s)], at = next[size_t(e)]++;
    r.order[size_t(at)] = int32_t(s);
    r.pos[size_t(s)] = (cap <= 0 || at - start[size_t(e)] < cap) ? int32_t(at) : int32_t(-(at + 1));
  }
  r.stats.assign(size_t(E + 1), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t e = 0; e < E; ++e) r.stats[size_t(e)] += r.probs[size_t(n * E + e)];
    r.stats[size_t(E)] += r.lse[size_t(n)] * r.lse[size_t(n)];
  }
  return r;
}
Vals as_vals(const IntVec& v) { return Vals(v.begin(), v.end()); }

// The router forward and backward on logits [N,E].
Row route_row(int64_t N, int64_t E, int64_t k, bool norm, int64_t cap) {
  Row r;
  r.family = "moe";
  r.name = fmt::format("moe_route fwd / bwd N={} E={} k={} norm={} capacity={}", N, E, k, norm, cap);
  r.ops = {Op::MoeRouteFwd, Op::MoeRouteBwd};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.emul = true;
  r.run = [=](Io& io) {
    const Opts f = dev(Metric::L2, 1e-5, 1e-5, 1e-5), bits = dev(Metric::Bits, 0, 0, 0, may_be_zero());
    Tensor z = io.in("logits", {N, E}, kAct, -2, 2);
    Tensor& probs = io.out("probs", {N, E}, kF32, f);
    Tensor& lse = io.out("lse", {N}, kF32, f);
    Tensor& sel = io.out("sel", {N, k}, fixed(DType::I32), bits);
    Tensor& w = io.out("weights", {N, k}, kF32, f);
    Tensor& counts = io.out("counts", {E}, fixed(DType::I32), bits);
    Tensor& order = io.out("order", {N * k}, fixed(DType::I32), bits);
    Tensor& pos = io.out("pos", {N * k}, fixed(DType::I32), bits);
    Tensor& stats = io.out("stats", {E + 1}, kF32, f);
    io.be.moe_route_fwd(z, int(k), norm, cap, probs, lse, sel, w, counts, order, pos, stats);
    Tensor dw = io.in("dweights", {N, k}, kF32);
    Tensor paux = io.in("paux", {E}, kF32, -0.5f, 0.5f);
    io.be.moe_route_bwd(probs, lse, sel, w, dw, paux, 0.05f, norm,
                        io.out("dlogits", {N, E}, kAct, dev(Metric::L2, 1e-5, 1e-2, 2e-3)));
  };
  r.ref = [=](const Io& io, Want& want) {
    const Route a = route(io.h("logits"), N, E, k, norm, cap);
    want.put("probs", a.probs), want.put("lse", a.lse), want.put("weights", a.weights), want.put("stats", a.stats);
    want.put("sel", as_vals(a.sel)), want.put("counts", as_vals(a.counts));
    want.put("order", as_vals(a.order)), want.put("pos", as_vals(a.pos));
    const HostVec &dw = io.h("dweights"), &paux = io.h("paux");
    Vals dz(size_t(N * E));
    for (int64_t n = 0; n < N; ++n) {
      std::vector<double> dp(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) dp[size_t(e)] = paux[size_t(e)];
      double S = 0, dot = 0;
      for (int64_t j = 0; j < k; ++j) S += a.probs[size_t(n * E + a.sel[size_t(n * k + j)])];
      for (int64_t j = 0; j < k; ++j) dot += dw[size_t(n * k + j)] * a.weights[size_t(n * k + j)];
      for (int64_t j = 0; j < k; ++j)
        dp[size_t(a.sel[size_t(n * k + j)])] += norm ? (dw[size_t(n * k + j)] - dot) / S : dw[size_t(n * k + j)];
      double pd = 0;
      for (int64_t e = 0; e < E; ++e) pd += a.probs[size_t(n * E + e)] * dp[size_t(e)];
      for (int64_t e = 0; e < E; ++e) {
        const double p = a.probs[size_t(n * E + e)];
        dz[size_t(n * E + e)] = p * (dp[size_t(e)] - pd) + 0.05 * 2 * a.lse[size_t(n)] * p;
      }
    }
    want.put("dlogits", dz);
  };
  return r;
}

// moe_route_bwd's gradient check: the gate values as a function of the logits (no auxiliary
// terms), dweights the upstream gradient.
Row route_grad_row(int64_t N, int64_t E, int64_t k, bool norm) {
  Row r;
  r.family = "moe";
  r.name = fmt::format("moe_route bwd N={} E={} k={} norm={} (gradient check)", N, E, k, norm);
  r.ops = {Op::MoeRouteFwd, Op::MoeRouteBwd};
  r.same_dtype = true;
  r.run = [=](Io& io) {
    const Opts bits = dev(Metric::Bits, 0, 0, 0, may_be_zero());
    Tensor z = io.in("logits", {N, E}, kAct, -2, 2);
    Tensor& probs = io.out("probs", {N, E}, kF32);
    Tensor& lse = io.out("lse", {N}, kF32);
    Tensor& sel = io.out("sel", {N, k}, fixed(DType::I32), bits);
    Tensor& w = io.out("weights", {N, k}, kF32);
    Tensor& counts = io.out("counts", {E}, fixed(DType::I32), bits);
    Tensor& order = io.out("order", {N * k}, fixed(DType::I32), bits);
    Tensor& pos = io.out("pos", {N * k}, fixed(DType::I32), bits);
    Tensor& stats = io.out("stats", {E + 1}, kF32);
    io.be.moe_route_fwd(z, int(k), norm, 0, probs, lse, sel, w, counts, order, pos, stats);
    io.be.moe_route_bwd(probs, lse, sel, w, io.in("dweights", {N, k}, kF32), Tensor(), 0.f, norm,
                        io.out("dlogits", {N, E}, kAct));
  };
  r.grad = Grad{"weights", "dweights", {{"logits", "dlogits"}}};
  return r;
}

// pos of a routing (k slots per token over E experts, capacity cap) from seeded choices.
Route plan(int64_t N, int64_t E, int64_t k, int64_t cap, uint64_t seed) {
  HostVec z(size_t(N * E));
  Rng g(seed);
  for (auto& v : z) v = 2.f * g.normal();
  return route(z, N, E, k, true, cap);
}

// gather, the weighted combine (plain and accumulating), the unweighted one (the gather's
// backward) and the combine's backward.
Row combine_row(int64_t N, int64_t C, int64_t E, int64_t k, int64_t cap, bool grad) {
  Row r;
  r.family = "moe";
  r.name = fmt::format("moe_gather / combine / combine_bwd N={} C={} E={} k={} capacity={}{}", N, C, E, k, cap,
                       grad ? " (gradient check)" : "");
  r.ops = {Op::MoeGather, Op::MoeCombine, Op::MoeCombineBwd};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.emul = true;
  const Route p = plan(N, E, k, cap, uint64_t(N * 31 + C));
  r.run = [=](Io& io) {
    const Opts o = dev(Metric::L2, 1e-5, 1e-2, 2e-3);
    Tensor x = io.in("x", {N, C});
    Tensor order = io.ids("order", {N * k}, p.order), pos = io.ids("pos", {N * k}, p.pos);
    io.be.moe_gather(x, order, int(k), io.out("xe", {N * k, C}, kAct, o));
    Tensor ye = io.in("ye", {N * k, C});
    Tensor w = io.in("w", {N, k}, kF32, 0.1f, 1.f);
    io.be.moe_combine(ye, pos, w, int(k), io.out("y", {N, C}, kAct, o), false);
    io.be.moe_combine(ye, pos, w, int(k), io.inout("y_acc", {N, C}, kAct, -1, 1, no_emul(o)), true);
    io.be.moe_combine(ye, pos, Tensor(), int(k), io.out("dx", {N, C}, kAct, o), false);
    Tensor dy = io.in("dy", {N, C});
    io.be.moe_combine_bwd(dy, ye, pos, w, int(k), io.out("dye", {N * k, C}, kAct, o),
                          io.out("dw", {N, k}, kF32, dev(Metric::L2, 1e-5, 1e-2, 2e-3, may_be_zero())));
  };
  r.ref = [=](const Io& io, Want& want) {
    const HostVec &x = io.h("x"), &ye = io.h("ye"), &w = io.h("w"), &dy = io.h("dy"), &y0 = io.h("y_acc");
    Vals xe(size_t(N * k * C)), y(size_t(N * C), 0.0), dx(size_t(N * C), 0.0), dye(size_t(N * k * C), 0.0),
        dw(size_t(N * k), 0.0), ya(size_t(N * C));
    for (int64_t i = 0; i < N * k; ++i)
      for (int64_t c = 0; c < C; ++c) xe[size_t(i * C + c)] = x[size_t((p.order[size_t(i)] / k) * C + c)];
    for (int64_t s = 0; s < N * k; ++s) {
      const int64_t n = s / k, q = p.pos[size_t(s)];
      if (q < 0) continue;
      for (int64_t c = 0; c < C; ++c) {
        y[size_t(n * C + c)] += double(w[size_t(s)]) * ye[size_t(q * C + c)];
        dx[size_t(n * C + c)] += ye[size_t(q * C + c)];
        dye[size_t(q * C + c)] = double(w[size_t(s)]) * dy[size_t(n * C + c)];
        dw[size_t(s)] += double(dy[size_t(n * C + c)]) * ye[size_t(q * C + c)];
      }
    }
    for (size_t i = 0; i < ya.size(); ++i) ya[i] = y0[i] + y[i];
    want.put("xe", xe), want.put("y", y), want.put("y_acc", ya), want.put("dx", dx), want.put("dye", dye);
    want.put("dw", dw);
  };
  if (grad) r.grad = Grad{"y", "dy", {{"ye", "dye"}, {"w", "dw"}}};
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  t.push_back(route_row(13, 5, 2, true, 0));
  t.push_back(route_row(13, 5, 2, false, 3));
  t.push_back(route_row(64, 8, 1, true, 0));
  t.push_back(route_row(300, 60, 4, false, 0));  // Qwen1.5-MoE's 60 experts, top 4
  t.push_back(route_grad_row(9, 4, 2, true));
  t.push_back(route_grad_row(9, 4, 2, false));
  t.push_back(combine_row(7, 6, 4, 2, 0, true));
  t.push_back(combine_row(7, 6, 4, 2, 2, true));  // dropped slots
  t.push_back(combine_row(50, 70, 8, 2, 0, false));
  t.push_back(combine_row(33, 128, 8, 2, 5, false));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

// Parity rows: batch norm (train with running statistics like PyTorch, eval, backward with
// and without accumulating the parameter gradients), its fused epilogues (ReLU, residual add +
// ReLU, the backward's mask, recomputed or read from y); layer norm forward, the residual add
// fused into it, backward (accumulating the parameter gradients, or dx).
#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "ref_ops.h"
#include "harness.h"

namespace dtrain::parity {
namespace {

constexpr float kEps = 1e-5f, kMom = 0.1f;

// ---------------------------------------------------------------- batch norm
struct BnCase {
  Shape s;
  int64_t off;
  float lo, hi;
};

Row bn_row(const BnCase& c, bool grad) {
  const Shape s = c.s;
  const int64_t C = s[s.ndim() - 1], M = s.numel() / C;
  Row r;
  r.family = "norm";
  r.name = fmt::format("batchnorm train / eval / bwd x{} off={} x in [{},{})", s.str(), c.off, c.lo, c.hi) +
           (grad ? " (gradient check)" : "");
  r.ops = {Op::BatchNormFwdTrain, Op::BatchNormFwdEval, Op::BatchNormBwd};
  r.emul = true;
  r.dev_rerun = true;
  r.threads = M >= 3000;
  r.run = [=](Io& io) {
    // statistics are f32 on both sides; dgamma / dbeta are f32 sums of 16-bit products
    const Opts st = dev(Metric::Max, 1e-5, 1e-4, 1e-4, ref(Metric::L2, 1e-6));
    const Opts pg = dev(Metric::Max, 1e-4, 2e-3, 2e-3, ref(Metric::L2, 1e-6));
    // y = (x - mean) * invstd in f32: x's rounding (relative 2^-24) is amplified by |mean| / std,
    // so inputs far from 0 relative to their spread ([20, 22)) get that factor on the tolerance
    const double spread = (c.hi - c.lo) / std::sqrt(12.0), cond = std::max(1.0, std::fabs(c.lo + c.hi) / 2 / spread);
    const Opts act = ref(Metric::L2, 1e-6 * cond);
    Tensor x = io.in("x", s, kAct, c.lo, c.hi, c.off), g = io.in("gamma", {C}, kF32, 0.5f, 1.5f), b = io.in("beta", {C}, kF32);
    Tensor rm = io.inout("running_mean", {C}, kF32, -1, 1, st), rv = io.inout("running_var", {C}, kF32, 0.5f, 2.f, st);
    Tensor sm = io.out("save_mean", {C}, kF32, st), si = io.out("save_invstd", {C}, kF32, st);
    io.be.batchnorm_fwd_train(x, g, b, io.out("y", s, kAct, act), rm, rv, sm, si, kMom, kEps);
    io.be.batchnorm_fwd_eval(x, g, b, rm, rv, io.out("y_eval", s, kAct, act), kEps);
    Tensor dy = io.in("dy", s), x2 = x.view({M, C});
    Tensor dg = io.out("dgamma", {C}, kF32, pg), db = io.out("dbeta", {C}, kF32, pg);
    io.be.batchnorm_bwd(dy, x2, g, sm, si, io.out("dx", {M, C}, kAct, ref(Metric::L2, 1e-5)), dg, db, false);
    Tensor dga = io.inout("dgamma_acc", {C}, kF32, -1, 1, pg), dba = io.inout("dbeta_acc", {C}, kF32, -1, 1, pg);
    io.be.batchnorm_bwd(dy, x2, g, sm, si, io.out("dx2", {M, C}, kAct, ref(Metric::L2, 1e-5)), dga, dba, true);
  };
  r.ref = [=](const Io& io, Want& w) {
    const HostVec &x = io.h("x"), &g = io.h("gamma"), &b = io.h("beta");
    const auto st = ref::bn_stats(x, C);
    w.put("y", ref::bn_apply(x, C, st.mean, st.var, g, b, kEps));
    Vals m(static_cast<size_t>(C)), is(static_cast<size_t>(C)), rm(static_cast<size_t>(C)), rv(static_cast<size_t>(C));
    for (size_t j = 0; j < size_t(C); ++j) {
      m[j] = st.mean[j];
      is[j] = 1 / std::sqrt(st.var[j] + kEps);
      rm[j] = (1 - kMom) * io.h("running_mean")[j] + kMom * st.mean[j];  // unbiased variance (PyTorch)
      rv[j] = (1 - kMom) * io.h("running_var")[j] + kMom * st.var[j] * double(M) / double(M - 1);
    }
    w.put("save_mean", m), w.put("save_invstd", is), w.put("running_mean", rm), w.put("running_var", rv);
    w.put("y_eval", ref::bn_apply(x, C, rm, rv, g, b, kEps));
    HostVec dg, db;
    const HostVec dx = ref::bn_bwd(io.h("dy"), x, C, g, kEps, dg, db);
    w.put("dx", dx), w.put("dx2", dx), w.put("dgamma", dg), w.put("dbeta", db);
    Vals dga(dg.size()), dba(db.size());
    for (size_t j = 0; j < dg.size(); ++j)
      dga[j] = io.h("dgamma_acc")[j] + double(dg[j]), dba[j] = io.h("dbeta_acc")[j] + double(db[j]);
    w.put("dgamma_acc", dga), w.put("dbeta_acc", dba);
  };
  if (grad) r.grad = Grad{"y", "dy", {{"x", "dx"}, {"gamma", "dgamma"}, {"beta", "dbeta"}}};
  return r;
}

// ---------------------------------------------------------------- the fused epilogue
// y = relu(bn(x) + residual?) fused, as the separate ops (batch norm, add, relu; relu_bwd,
// batch norm backward), and (without a residual) the backward's mask recomputed from x.
// gb_scale scales gamma and beta (tiny values put f16 outputs where positives round to zero).
Row epilogue_row(int64_t M, int64_t C, bool residual, float gb_scale, std::vector<DType> dtypes) {
  Row r;
  r.family = "norm";
  r.name = fmt::format("batchnorm epilogue relu{} M={} C={}{}", residual ? " + residual" : "", M, C,
                       gb_scale != 1.f ? fmt::format(" gamma beta x{}", gb_scale) : "");
  r.ops = {Op::BatchNormFwdTrain, Op::BatchNormFwdEval, Op::BatchNormBwd, Op::ReluFwd, Op::ReluBwd, Op::Add};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.dtypes = std::move(dtypes);
  r.run = [=](Io& io) {
    // 16-bit activations differ where a rounding flips, and so may the ReLU mask of an output
    // that rounds to zero on one side only, which reaches dx, dgamma and dbeta; the running
    // statistics depend on x alone (f32 sums)
    const Opts act = dev(Metric::L2, 1e-4, 1e-2, 2e-3), stats = dev(Metric::L2, 1e-4, 1e-4, 1e-4);
    Tensor x = io.in("x", {M, C}, kAct, -2, 2), res = io.in("res", {M, C}), dy = io.in("dy", {M, C});
    HostVec gv = io.uniform("gamma", size_t(C), 0.5f, 1.5f), bv = io.uniform("beta", size_t(C), -1, 1);
    for (float& e : gv) e *= gb_scale;
    for (float& e : bv) e *= gb_scale;
    Tensor g = io.in_vals("gamma", {C}, kF32, gv), b = io.in_vals("beta", {C}, kF32, bv);
    for (const char* path : {"fused", "separate", "recomputed"}) {
      const std::string p = path;
      if (p == "recomputed" && residual) continue;
      Tensor rm = io.inout_vals(p + ".running_mean", {C}, kF32, HostVec(size_t(C), 0.f), stats);
      Tensor rv = io.inout_vals(p + ".running_var", {C}, kF32, HostVec(size_t(C), 1.f), stats);
      Tensor mean = io.temp({C}, kF32), invstd = io.temp({C}, kF32);
      Tensor y = io.out(p + ".y", {M, C}, kAct, act), ye = io.out(p + ".y_eval", {M, C}, kAct, act);
      // gamma ~2e-8: dx (~gamma * invstd * dy) lies below f16's smallest subnormal, all zero
      Tensor dx = io.out(p + ".dx", {M, C}, kAct, gb_scale != 1.f ? may_be_zero(act) : act);
      Tensor dg = io.inout_vals(p + ".dgamma", {C}, kF32, HostVec(size_t(C), 0.25f), act);
      Tensor db = io.inout_vals(p + ".dbeta", {C}, kF32, HostVec(size_t(C), 0.25f), act);
      Tensor gm = io.inout_vals(p + ".dy_masked", {M, C}, kAct, HostVec(size_t(M * C), 9.f), act);
      BnEpilogue ep;
      ep.relu = true;
      if (residual) ep.residual = res;
      if (p != "separate") {
        io.be.batchnorm_fwd_train(x, g, b, y, rm, rv, mean, invstd, kMom, kEps, ep);
        io.be.batchnorm_fwd_eval(x, g, b, rm, rv, ye, kEps, ep);
        BnReluBwd relu;
        relu.y = y;
        if (p == "recomputed") relu.beta = b;
        if (residual) relu.dy_masked = gm;  // the masked gradient for the shortcut, from the backward
        io.be.batchnorm_bwd(dy, x, g, mean, invstd, dx, dg, db, true, relu);
        if (!residual) io.be.relu_bwd(y, dy, gm);
      } else {
        io.be.batchnorm_fwd_train(x, g, b, y, rm, rv, mean, invstd, kMom, kEps);
        io.be.batchnorm_fwd_eval(x, g, b, rm, rv, ye, kEps);
        for (Tensor* o : {&y, &ye}) {
          if (residual) io.be.add(*o, res, *o);
          io.be.relu_fwd(*o, *o);
        }
        io.be.relu_bwd(y, dy, gm);
        io.be.batchnorm_bwd(gm, x, g, mean, invstd, dx, dg, db, true);
      }
    }
  };
  r.ref = [=](const Io& io, Want& w) {
    const HostVec &x = io.h("x"), &g = io.h("gamma"), &b = io.h("beta"), &res = io.h("res"), &dy = io.h("dy");
    const auto st = ref::bn_stats(x, C);
    HostVec y = ref::bn_apply(x, C, st.mean, st.var, g, b, kEps);
    std::vector<double> rm(static_cast<size_t>(C)), rv(static_cast<size_t>(C));
    for (size_t j = 0; j < size_t(C); ++j) rm[j] = kMom * st.mean[j], rv[j] = 0.9 + kMom * st.var[j] * M / (M - 1);
    HostVec ye = ref::bn_apply(x, C, rm, rv, g, b, kEps), gm(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      y[i] = std::max(y[i] + (residual ? res[i] : 0.f), 0.f), ye[i] = std::max(ye[i] + (residual ? res[i] : 0.f), 0.f);
      gm[i] = y[i] > 0 ? dy[i] : 0.f;
    }
    HostVec dg, db;
    const HostVec dx = ref::bn_bwd(gm, x, C, g, kEps, dg, db);
    for (float& v : dg) v += 0.25f;
    for (float& v : db) v += 0.25f;
    for (std::string p : {"fused", "separate", "recomputed"}) {
      if (p == "recomputed" && residual) continue;
      w.put(p + ".y", y), w.put(p + ".y_eval", ye), w.put(p + ".running_mean", Vals(rm.begin(), rm.end()));
      w.put(p + ".running_var", Vals(rv.begin(), rv.end())), w.put(p + ".dx", dx), w.put(p + ".dgamma", dg);
      w.put(p + ".dbeta", db), w.put(p + ".dy_masked", gm);
    }
  };
  r.check = [=](const Io& io, const Outs& o, Report& rep) {
    rep.compared++;
    for (const auto& [name, out] : o) {
      const std::string field = name.substr(name.find('.') + 1);
      // the mask recomputed from x (not reading y) is exactly y > 0: bit-equal everywhere;
      // on the CPU the fused epilogue equals the separate ops bit for bit
      for (std::string other : {"recomputed", "separate"}) {
        if (name.rfind("fused.", 0) != 0 || !o.count(other + "." + field)) continue;
        if (other == "separate" && !io.on_cpu()) continue;
        const Vals& v = o.at(other + "." + field).v;
        if (std::memcmp(v.data(), out.v.data(), v.size() * sizeof(double)) != 0)
          rep.fail(fmt::format("[{}] {} {}: {} differs from fused", io.be.name(), dtype_name(io.dt), other + "." + field, name));
      }
    }
    // the ReLU really cut: some outputs are zero, some positive
    const Vals& y = o.at("fused.y").v;
    const auto zeros = std::count(y.begin(), y.end(), 0.0);
    if (zeros == 0 || zeros == long(y.size())) rep.fail(fmt::format("fused.y: {} of {} zeros", zeros, y.size()));
    if (gb_scale != 1.f && io.on_cpu() && io.storage(kAct) == DType::F16) {
      // the data reach f16's edge: some positive pre-activations round to zero, others survive
      const HostVec &x = io.h("x"), &g = io.h("gamma"), &b = io.h("beta");
      const auto st = ref::bn_stats(x, C);
      const HostVec pre = ref::bn_apply(x, C, st.mean, st.var, g, b, kEps);
      const auto pos32 = std::count_if(pre.begin(), pre.end(), [](float v) { return v > 0; });
      const auto pos16 = std::count_if(y.begin(), y.end(), [](double v) { return v > 0; });
      if (!(pos16 > 0 && pos32 > pos16)) rep.fail(fmt::format("f16 edge not reached: {} positive in f16, {} in f32", pos16, pos32));
    }
  };
  return r;
}

// ---------------------------------------------------------------- layer norm
// y = layernorm(x) [M,C] (gamma, beta f32), h = x + dy and layernorm(h) fused, the backward
// plain, accumulating dgamma / dbeta, and accumulating dx (a residual's sum).
Row ln_row(int64_t M, int64_t C, double stat_tol, bool grad) {
  Row r;
  r.family = "norm";
  r.name = fmt::format("layernorm fwd / add_layernorm_fwd / bwd M={} C={}", M, C) + (grad ? " (gradient check)" : "");
  r.ops = {Op::LayerNormFwd, Op::LayerNormBwd, Op::Add};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.emul = true;
  r.run = [=](Io& io) {
    const Opts act = dev(Metric::L2, 1e-5, 1e-2, 2e-3), st = dev(Metric::L2, stat_tol, 1e-4, 1e-4);
    Tensor x = io.in("x", {M, C}, kAct, -2, 2), dy = io.in("dy", {M, C});
    Tensor g = io.in("gamma", {C}, kF32, 0.5f, 1.5f), b = io.in("beta", {C}, kF32);
    Tensor mean = io.out("mean", {M}, kF32, st), rstd = io.out("rstd", {M}, kF32, st);
    io.be.layernorm_fwd(x, g, b, io.out("y", {M, C}, kAct, act), mean, rstd, kEps);
    // the residual stream's add fused in: h = x + dy, y2 = layernorm(h)
    // in 16 bits the fused layer norm normalizes h as stored (rounded), so y2 and its statistics
    // are not the f32 result rounded (out of the emulation check; compared across backends)
    io.be.add_layernorm_fwd(x, dy, io.out("h", {M, C}, kAct, act), g, b, io.out("y2", {M, C}, kAct, no_emul(act)),
                            io.out("mean2", {M}, kF32, no_emul(st)), io.out("rstd2", {M}, kF32, no_emul(st)), kEps);
    Tensor dg = io.out("dgamma", {C}, kF32, st), db = io.out("dbeta", {C}, kF32, st);
    io.be.layernorm_bwd(dy, x, g, mean, rstd, io.out("dx", {M, C}, kAct, act), dg, db, false, false);
    Tensor dga = io.inout_vals("dgamma_acc", {C}, kF32, HostVec(size_t(C), 0.5f), st);
    Tensor dba = io.inout_vals("dbeta_acc", {C}, kF32, HostVec(size_t(C), 0.5f), st);
    io.be.layernorm_bwd(dy, x, g, mean, rstd, io.out("dx_p", {M, C}, kAct, act), dga, dba, true, false);
    // accumulate_dx: a residual gradient plus the layer norm's input gradient
    Tensor dxa = io.inout("dx_acc", {M, C}, kAct, -1, 1, no_emul(act));
    io.be.layernorm_bwd(dy, x, g, mean, rstd, dxa, io.out("dgamma2", {C}, kF32, st), io.out("dbeta2", {C}, kF32, st),
                        false, true);
  };
  r.ref = [=](const Io& io, Want& w) {
    auto fwd = [&](const HostVec& x, const std::string& y, const std::string& m, const std::string& rs) {
      Vals yv(x.size()), mv(static_cast<size_t>(M)), rv(static_cast<size_t>(M));
      for (int64_t i = 0; i < M; ++i) {
        double mu = 0, var = 0;
        for (int64_t j = 0; j < C; ++j) mu += x[size_t(i * C + j)];
        mu /= double(C);
        for (int64_t j = 0; j < C; ++j) var += std::pow(x[size_t(i * C + j)] - mu, 2);
        const double rstd = 1 / std::sqrt(var / double(C) + kEps);
        for (int64_t j = 0; j < C; ++j)
          yv[size_t(i * C + j)] = (x[size_t(i * C + j)] - mu) * rstd * io.h("gamma")[size_t(j)] + io.h("beta")[size_t(j)];
        mv[size_t(i)] = mu, rv[size_t(i)] = rstd;
      }
      w.put(y, yv), w.put(m, mv), w.put(rs, rv);
      return std::pair{mv, rv};
    };
    const HostVec &x = io.h("x"), &dy = io.h("dy"), &g = io.h("gamma");
    const auto [mu, rs] = fwd(x, "y", "mean", "rstd");
    HostVec h(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = x[i] + dy[i];
    fwd(h, "y2", "mean2", "rstd2");
    w.put("h", h);
    Vals dx(x.size()), dg(static_cast<size_t>(C), 0.0), db(static_cast<size_t>(C), 0.0), dxa(x.size());
    for (int64_t i = 0; i < M; ++i) {
      double s1 = 0, s2 = 0;
      for (int64_t j = 0; j < C; ++j) {
        const size_t k = size_t(i * C + j);
        const double xh = (x[k] - mu[size_t(i)]) * rs[size_t(i)], d = double(dy[k]) * g[size_t(j)];
        s1 += d, s2 += d * xh;
        dg[size_t(j)] += dy[k] * xh, db[size_t(j)] += dy[k];
      }
      for (int64_t j = 0; j < C; ++j) {
        const size_t k = size_t(i * C + j);
        const double xh = (x[k] - mu[size_t(i)]) * rs[size_t(i)], d = double(dy[k]) * g[size_t(j)];
        dx[k] = rs[size_t(i)] * (d - s1 / double(C) - xh * s2 / double(C));
        dxa[k] = io.h("dx_acc")[k] + dx[k];
      }
    }
    Vals dga = dg, dba = db;
    for (double& v : dga) v += 0.5;
    for (double& v : dba) v += 0.5;
    w.put("dx", dx), w.put("dx_p", dx), w.put("dx_acc", dxa), w.put("dgamma", dg), w.put("dbeta", db);
    w.put("dgamma2", dg), w.put("dbeta2", db), w.put("dgamma_acc", dga), w.put("dbeta_acc", dba);
  };
  r.check = [](const Io& io, const Outs& o, Report& rep) {
    if (!io.on_cpu()) return;
    // on the CPU: accumulate_dx equals the backward then an add, bit for bit; the other
    // outputs of the three backward calls equal each other
    rep.compared++;
    const Vals &dx = o.at("dx").v, &acc = o.at("dx_acc").v;
    size_t bad = 0;
    for (size_t i = 0; i < dx.size(); ++i)
      bad += double(round_to(io.storage(kAct), io.h("dx_acc")[i] + float(dx[i]))) != acc[i];
    for (auto [a, b] : {std::pair{"dgamma", "dgamma2"}, {"dbeta", "dbeta2"}, {"dx", "dx_p"}})
      bad += o.at(a).v != o.at(b).v;
    if (bad) rep.fail(fmt::format("layernorm_bwd on the cpu {}: {} values differ between the fused and separate forms",
                                  dtype_name(io.dt), bad));
  };
  if (grad) {
    testing::GradCheckOptions opt;
    opt.detect_kinks = false;
    r.grad = Grad{"y", "dy", {{"x", "dx"}, {"gamma", "dgamma"}, {"beta", "dbeta"}}, opt};
  }
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  // the CPU test's shape, then the GPU test's: channel counts with and without 16-byte vectors
  // (C % 8 for 16-bit, C % 4 for f32), partial channel tiles (40, 264), odd row counts, many
  // row chunks (8x28x28), an unaligned x (scalar path for C = 64) and a mean far from 0
  // relative to the spread; [16,14,14,32] for 1 thread == 2 threads
  const BnCase cases[] = {{Shape{3, 5, 7, 6}, 0, -2.f, 3.f},    {Shape{4, 7, 9, 24}, 0, -2.f, 3.f},
                          {Shape{2, 33, 33, 3}, 0, -2.f, 3.f},   {Shape{64, 1, 1, 130}, 0, -2.f, 3.f},
                          {Shape{3, 5, 7, 64}, 0, -2.f, 3.f},    {Shape{3, 5, 7, 64}, 1, -2.f, 3.f},
                          {Shape{2, 9, 11, 40}, 0, -2.f, 3.f},   {Shape{1, 1, 3, 16}, 0, -2.f, 3.f},
                          {Shape{2, 3, 3, 8}, 0, -2.f, 3.f},     {Shape{8, 28, 28, 264}, 0, -2.f, 3.f},
                          {Shape{4, 16, 16, 32}, 0, 20.f, 22.f}, {Shape{16, 14, 14, 32}, 0, -2.f, 3.f}};
  for (const BnCase& c : cases) t.push_back(bn_row(c, false));
  t.push_back(bn_row({Shape{2, 3, 4, 3}, 0, -2.f, 2.f}, true));
  for (bool residual : {false, true})
    for (auto [M, C] : {std::pair<int64_t, int64_t>{50, 12}, {3 * 7 * 5, 64}, {2 * 9 * 9, 3}})
      t.push_back(epilogue_row(M, C, residual, 1.f, {DType::F32, DType::BF16, DType::F16}));
  // the recomputed mask must equal y > 0 also where a positive pre-activation rounds to zero
  // in f16 (below 2^-25): gamma and beta ~2e-8 put many outputs there
  t.push_back(epilogue_row(3 * 7 * 5, 64, false, 2e-8f, {DType::F16}));
  // GPT's block (the GPT ops test) with its gradient check; the CUDA kernels' paths: 768 (GPT-2,
  // warp per row, 3 or 6 vectors a lane), 20 (f32 vectors only), 2056 (wider than the warp
  // kernels take for 16-bit), 64 (one vector a lane)
  t.push_back(ln_row(14, 12, 1e-5, true));
  t.push_back(ln_row(7, 24, 1e-4, false));
  for (auto [M, C] : {std::pair<int64_t, int64_t>{37, 768}, {9, 20}, {4, 2056}, {64, 64}}) t.push_back(ln_row(M, C, 1e-4, false));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

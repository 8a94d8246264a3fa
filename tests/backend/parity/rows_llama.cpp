// Parity rows of the Llama family's ops: RMS norm forward, the residual add fused into it,
// backward (accumulating the weight gradient, or dx); rotary position embedding forward and
// backward (default positions and a positions tensor that restarts per document, the values'
// columns copied, the backward in place); SwiGLU forward and backward. Every row has a naive
// double reference and the backward ops a finite-difference gradient check.
#include <cmath>

#include <fmt/format.h>

#include "harness.h"
#include "models/rope.h"

namespace dtrain::parity {
namespace {

constexpr float kEps = 1e-6f;

// ---------------------------------------------------------------- RMS norm
// y = rmsnorm(x) [M,C] (weight f32), h = x + dy and rmsnorm(h) fused, the backward plain,
// accumulating dweight, and accumulating dx (a residual's sum).
Row rms_row(int64_t M, int64_t C, double stat_tol, bool grad) {
  Row r;
  r.family = "llama";
  r.name = fmt::format("rmsnorm fwd / add_rmsnorm_fwd / bwd M={} C={}", M, C) + (grad ? " (gradient check)" : "");
  r.ops = {Op::RmsNormFwd, Op::RmsNormBwd, Op::Add};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.emul = true;
  r.run = [=](Io& io) {
    const Opts act = dev(Metric::L2, 1e-5, 1e-2, 2e-3), st = dev(Metric::L2, stat_tol, 1e-4, 1e-4);
    Tensor x = io.in("x", {M, C}, kAct, -2, 2), dy = io.in("dy", {M, C});
    Tensor w = io.in("weight", {C}, kF32, 0.5f, 1.5f);
    Tensor rstd = io.out("rstd", {M}, kF32, st);
    io.be.rmsnorm_fwd(x, w, io.out("y", {M, C}, kAct, act), rstd, kEps);
    // h = x + dy normalised as stored (in 16 bits the rounded h: out of the emulation check)
    io.be.add_rmsnorm_fwd(x, dy, io.out("h", {M, C}, kAct, act), w, io.out("y2", {M, C}, kAct, no_emul(act)),
                          io.out("rstd2", {M}, kF32, no_emul(st)), kEps);
    io.be.rmsnorm_bwd(dy, x, w, rstd, io.out("dx", {M, C}, kAct, act), io.out("dweight", {C}, kF32, st), false, false);
    Tensor dwa = io.inout_vals("dweight_acc", {C}, kF32, HostVec(size_t(C), 0.5f), st);
    io.be.rmsnorm_bwd(dy, x, w, rstd, io.out("dx_p", {M, C}, kAct, act), dwa, true, false);
    // accumulate_dx: a residual gradient plus the norm's input gradient; no weight gradient
    Tensor dxa = io.inout("dx_acc", {M, C}, kAct, -1, 1, no_emul(act));
    Tensor none;
    io.be.rmsnorm_bwd(dy, x, w, rstd, dxa, none, false, true);
  };
  r.ref = [=](const Io& io, Want& want) {
    const HostVec &x = io.h("x"), &dy = io.h("dy"), &w = io.h("weight");
    auto fwd = [&](const HostVec& v, const std::string& y, const std::string& rs) {
      Vals yv(v.size()), rv(static_cast<size_t>(M));
      for (int64_t i = 0; i < M; ++i) {
        double ss = 0;
        for (int64_t j = 0; j < C; ++j) ss += double(v[size_t(i * C + j)]) * v[size_t(i * C + j)];
        const double q = 1 / std::sqrt(ss / double(C) + kEps);
        for (int64_t j = 0; j < C; ++j) yv[size_t(i * C + j)] = v[size_t(i * C + j)] * q * w[size_t(j)];
        rv[size_t(i)] = q;
      }
      want.put(y, yv), want.put(rs, rv);
      return rv;
    };
    const Vals q = fwd(x, "y", "rstd");
    HostVec h(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = x[i] + dy[i];
    fwd(h, "y2", "rstd2");
    want.put("h", h);
    Vals dx(x.size()), dw(static_cast<size_t>(C), 0.0), dxa(x.size());
    for (int64_t i = 0; i < M; ++i) {
      double s = 0;
      for (int64_t j = 0; j < C; ++j) {
        const size_t k = size_t(i * C + j);
        const double xh = x[k] * q[size_t(i)];
        s += double(dy[k]) * w[size_t(j)] * xh;
        dw[size_t(j)] += dy[k] * xh;
      }
      for (int64_t j = 0; j < C; ++j) {
        const size_t k = size_t(i * C + j);
        dx[k] = q[size_t(i)] * (double(dy[k]) * w[size_t(j)] - x[k] * q[size_t(i)] * s / double(C));
        dxa[k] = io.h("dx_acc")[k] + dx[k];
      }
    }
    Vals dwa = dw;
    for (double& v : dwa) v += 0.5;
    want.put("dx", dx), want.put("dx_p", dx), want.put("dx_acc", dxa), want.put("dweight", dw);
    want.put("dweight_acc", dwa);
  };
  r.check = [](const Io& io, const Outs& o, Report& rep) {
    if (!io.on_cpu()) return;
    // on the CPU: accumulate_dx equals the backward then an add, bit for bit
    rep.compared++;
    const Vals &dx = o.at("dx").v, &acc = o.at("dx_acc").v;
    size_t bad = o.at("dx").v != o.at("dx_p").v;
    for (size_t i = 0; i < dx.size(); ++i)
      bad += double(round_to(io.storage(kAct), io.h("dx_acc")[i] + float(dx[i]))) != acc[i];
    if (bad) rep.fail(fmt::format("rmsnorm_bwd on the cpu {}: {} values differ between the fused and separate forms",
                                  dtype_name(io.dt), bad));
  };
  if (grad) {
    testing::GradCheckOptions opt;
    opt.detect_kinks = false;
    r.grad = Grad{"y", "dy", {{"x", "dx"}, {"weight", "dweight"}}, opt};
  }
  return r;
}

// ---------------------------------------------------------------- RoPE
// x [B,T,(H + 2 Hkv) hs] rotated in its first H + Hkv heads; the tables of rope_inv_freq
// (theta 10000, or Llama 3.1's scaling) over P positions.
struct RopeCase {
  int64_t B, T, H, Hkv, hs, P;
  bool positions;  // a positions tensor (documents of 3 tokens restarting at 0, then one at P-1)
  bool llama3;
};

void rope_ref(const HostVec& x, const HostVec& cs, const HostVec& sn, const IntVec& pos, const RopeCase& c,
              double sign, Vals& y) {
  const int64_t W = (c.H + 2 * c.Hkv) * c.hs, half = c.hs / 2, rot = c.H + c.Hkv;
  y.assign(x.begin(), x.end());
  for (int64_t i = 0; i < c.B * c.T; ++i) {
    const int64_t p = pos.empty() ? i % c.T : pos[size_t(i)];
    for (int64_t h = 0; h < rot; ++h)
      for (int64_t j = 0; j < half; ++j) {
        const size_t a = size_t(i * W + h * c.hs + j), b = a + size_t(half);
        const double co = cs[size_t(p * half + j)], si = sign * sn[size_t(p * half + j)];
        y[a] = double(x[a]) * co - double(x[b]) * si;
        y[b] = double(x[b]) * co + double(x[a]) * si;
      }
  }
}

Row rope_row(const RopeCase& c, bool grad) {
  const int64_t W = (c.H + 2 * c.Hkv) * c.hs, half = c.hs / 2;
  Row r;
  r.family = "llama";
  r.name = fmt::format("rope fwd / bwd B={} T={} H={} Hkv={} hs={} P={}{}{}{}", c.B, c.T, c.H, c.Hkv, c.hs, c.P,
                       c.positions ? " positions" : "", c.llama3 ? " llama3" : "", grad ? " (gradient check)" : "");
  r.ops = {Op::RopeFwd, Op::RopeBwd};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.emul = true;
  r.run = [=](Io& io) {
    const Opts o = dev(Metric::L2, 1e-6, 1e-2, 2e-3, ref(Metric::Approx, 1e-6));
    RopeScaling sc;
    if (c.llama3) sc.rope_type = "llama3", sc.factor = 8, sc.low_freq_factor = 1, sc.high_freq_factor = 4,
                  sc.original_max_position_embeddings = 16;
    std::vector<float> cs, sn;
    rope_tables(rope_inv_freq(c.llama3 ? 500000.0 : 10000.0, sc, int(c.hs)), int(c.P), cs, sn);
    Tensor tc = io.in_vals("cos", {c.P, half}, kF32, cs), ts = io.in_vals("sin", {c.P, half}, kF32, sn);
    Tensor pos;
    if (c.positions) {
      IntVec p(size_t(c.B * c.T));
      for (size_t i = 0; i < p.size(); ++i) p[i] = int32_t((i % size_t(c.T)) % 3);
      p.back() = int32_t(c.P - 1);
      pos = io.ids("positions", {c.B, c.T}, p);
    }
    Tensor x = io.in("x", {c.B, c.T, W}, kAct, -2, 2), dy = io.in("dy", {c.B, c.T, W});
    io.be.rope_fwd(x, tc, ts, pos, int(c.H + c.Hkv), io.out("y", {c.B, c.T, W}, kAct, o));
    io.be.rope_bwd(dy, tc, ts, pos, int(c.H + c.Hkv), io.out("dx", {c.B, c.T, W}, kAct, o));
    Tensor& inplace = io.inout("dx_inplace", {c.B, c.T, W}, kAct, -1, 1, o);  // dx aliasing dy
    io.be.rope_bwd(inplace, tc, ts, pos, int(c.H + c.Hkv), inplace);
  };
  r.ref = [=](const Io& io, Want& w) {
    const IntVec none;
    const IntVec& pos = c.positions ? io.hi("positions") : none;
    Vals y, dx, dxi;
    rope_ref(io.h("x"), io.h("cos"), io.h("sin"), pos, c, 1, y);
    rope_ref(io.h("dy"), io.h("cos"), io.h("sin"), pos, c, -1, dx);
    rope_ref(io.h("dx_inplace"), io.h("cos"), io.h("sin"), pos, c, -1, dxi);
    w.put("y", y), w.put("dx", dx), w.put("dx_inplace", dxi);
  };
  if (grad) r.grad = Grad{"y", "dy", {{"x", "dx"}}};
  return r;
}

// ---------------------------------------------------------------- SwiGLU
Row swiglu_row(int64_t M, int64_t I, float lo, float hi, bool grad) {
  Row r;
  r.family = "llama";
  r.name = fmt::format("swiglu fwd / bwd M={} I={} in [{},{}){}", M, I, lo, hi, grad ? " (gradient check)" : "");
  r.ops = {Op::SwigluFwd, Op::SwigluBwd};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.emul = true;
  r.run = [=](Io& io) {
    const Opts o = dev(Metric::L2, 1e-5, 1e-2, 2e-3, ref(Metric::Approx, 1e-6));
    Tensor gu = io.in("gu", {M, 2 * I}, kAct, lo, hi);
    io.be.swiglu_fwd(gu, io.out("y", {M, I}, kAct, o));
    io.be.swiglu_bwd(gu, io.in("dy", {M, I}), io.out("dgu", {M, 2 * I}, kAct, o));
  };
  r.ref = [=](const Io& io, Want& w) {
    const HostVec &gu = io.h("gu"), &dy = io.h("dy");
    Vals y(size_t(M * I)), dgu(size_t(M * 2 * I));
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < I; ++j) {
        const double g = gu[size_t(i * 2 * I + j)], u = gu[size_t(i * 2 * I + I + j)], d = dy[size_t(i * I + j)];
        const double sg = 1 / (1 + std::exp(-g));
        y[size_t(i * I + j)] = g * sg * u;
        dgu[size_t(i * 2 * I + j)] = d * u * sg * (1 + g * (1 - sg));
        dgu[size_t(i * 2 * I + I + j)] = d * g * sg;
      }
    w.put("y", y), w.put("dgu", dgu);
  };
  if (grad) r.grad = Grad{"y", "dy", {{"gu", "dgu"}}};
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  // small shapes with the gradient checks; the CUDA kernels' paths: 768 and 2056 (many values a
  // lane), 20 (fewer than a warp), 64
  t.push_back(rms_row(14, 12, 1e-5, true));
  t.push_back(rms_row(7, 24, 1e-4, false));
  for (auto [M, C] : {std::pair<int64_t, int64_t>{37, 768}, {9, 20}, {4, 2056}, {64, 64}}) t.push_back(rms_row(M, C, 1e-4, false));
  // multi-head, grouped-query and multi-query rows; positions restarting per document; Llama
  // 3.1's scaled frequencies; a head size of 128 and a long table
  t.push_back(rope_row({2, 5, 2, 1, 4, 8, false, false}, true));
  t.push_back(rope_row({2, 6, 2, 2, 8, 8, true, false}, true));
  for (const RopeCase& c : {RopeCase{2, 17, 4, 2, 16, 32, false, true}, {1, 33, 3, 1, 64, 40, true, true},
                            {3, 9, 2, 2, 128, 4096, true, false}, {1, 1, 8, 8, 32, 1, false, false}})
    t.push_back(rope_row(c, false));
  t.push_back(swiglu_row(5, 6, -4, 4, true));
  for (auto [M, I] : {std::pair<int64_t, int64_t>{37, 688}, {9, 20}, {64, 64}}) t.push_back(swiglu_row(M, I, -6, 6, false));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

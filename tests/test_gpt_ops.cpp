// GPT ops: CPU against naive formulas and finite differences ("unit"), CUDA against CPU
// ("gpu", f32/bf16/f16; a visible skip without a device).
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <memory>

#include "gpu_skip.h"
#include "backend/backend.h"
#include "core/error.h"
#include "core/rng.h"
#include "gradcheck.h"
#include "op_harness.h"

using namespace dtrain;
using testing::HostDev;
using testing::HostVec;

namespace {

// All GPT ops with float inputs `in` (host) on backend `be`; returns the outputs in order.
struct GptCase {
  int B = 2, T = 7, C = 12, H = 3, V = 21, Vp = 32;
  std::vector<int32_t> ids, labels;
  HostVec x, g, b, dy, qkv, dout, wte, wpe, logits;
  explicit GptCase(uint64_t seed) {
    Rng r(seed);
    x = testing::random_vec(size_t(B * T * C), seed + 1, -2, 2);
    g = testing::random_vec(size_t(C), seed + 2, 0.5, 1.5);
    b = testing::random_vec(size_t(C), seed + 3);
    dy = testing::random_vec(size_t(B * T * C), seed + 4);
    qkv = testing::random_vec(size_t(B * T * 3 * C), seed + 5, -1.5, 1.5);
    dout = testing::random_vec(size_t(B * T * C), seed + 6);
    wte = testing::random_vec(size_t(V * C), seed + 7);
    wpe = testing::random_vec(size_t(10 * C), seed + 8);
    logits = testing::random_vec(size_t(B * T * Vp), seed + 9, -3, 3);
    for (int i = 0; i < B * T; ++i) ids.push_back(int32_t(r.below(5)) * 4);  // repeats
    for (int i = 0; i < B * T; ++i) labels.push_back(int32_t(r.below(uint64_t(V))));
  }
};

double weighted(const HostVec& y, const HostVec& w) { return testing::dot(y, w); }

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("gpt ops cpu: layernorm fwd vs formula / bwd vs finite differences") {
  auto be = make_backend("cpu");
  HostDev d(*be);
  GptCase c(1);
  const int M = c.B * c.T, C = c.C;
  auto run = [&](const HostVec& x, const HostVec& g, const HostVec& b, HostVec* mean_out) {
    Tensor tx = d.up(x, Shape{M, C}), tg = d.up(g, Shape{C}), tb = d.up(b, Shape{C});
    Tensor y = d.zeros(Shape{M, C}), m = d.zeros(Shape{M}), r = d.zeros(Shape{M});
    be->layernorm_fwd(tx, tg, tb, y, m, r, 1e-5f);
    if (mean_out) *mean_out = d.down(m);
    return d.down(y);
  };
  HostVec mean;
  HostVec y = run(c.x, c.g, c.b, &mean);
  for (int i = 0; i < M; ++i) {
    double mu = 0, var = 0;
    for (int j = 0; j < C; ++j) mu += c.x[size_t(i * C + j)];
    mu /= C;
    for (int j = 0; j < C; ++j) var += std::pow(c.x[size_t(i * C + j)] - mu, 2);
    var /= C;
    for (int j = 0; j < C; ++j)
      CHECK(y[size_t(i * C + j)] == doctest::Approx((c.x[size_t(i * C + j)] - mu) /
                                                        std::sqrt(var + 1e-5) * c.g[size_t(j)] +
                                                    c.b[size_t(j)]).epsilon(1e-4));
    CHECK(mean[size_t(i)] == doctest::Approx(mu).epsilon(1e-5));
  }
  // analytic grads with dy = c.dy, accumulate onto 1.0 to test `accumulate`
  Tensor tx = d.up(c.x, Shape{M, C}), tg = d.up(c.g, Shape{C}), tb = d.up(c.b, Shape{C});
  Tensor ty = d.zeros(Shape{M, C}), m = d.zeros(Shape{M}), r = d.zeros(Shape{M});
  be->layernorm_fwd(tx, tg, tb, ty, m, r, 1e-5f);
  Tensor tdy = d.up(c.dy, Shape{M, C}), dx = d.zeros(Shape{M, C});
  Tensor dg = d.up(HostVec(size_t(C), 1.f), Shape{C}), db = d.up(HostVec(size_t(C), 1.f), Shape{C});
  be->layernorm_bwd(tdy, tx, tg, m, r, dx, dg, db, true, false);
  HostVec adx = d.down(dx), adg = d.down(dg), adb = d.down(db);
  for (auto& v : adg) v -= 1.f;
  for (auto& v : adb) v -= 1.f;
  HostVec x = c.x, gg = c.g, bb = c.b;
  auto L = [&] { return weighted(run(x, gg, bb, nullptr), c.dy); };
  testing::GradCheckOptions o;
  o.detect_kinks = false;
  auto r1 = testing::check_gradient<float>(L, x, adx, o);
  CHECK_MESSAGE(r1.ok, r1.summary());
  auto r2 = testing::check_gradient<float>(L, gg, adg, o);
  CHECK_MESSAGE(r2.ok, r2.summary());
  auto r3 = testing::check_gradient<float>(L, bb, adb, o);
  CHECK_MESSAGE(r3.ok, r3.summary());
}

TEST_CASE("gpt ops cpu: gelu (tanh) value and gradient") {
  auto be = make_backend("cpu");
  HostDev d(*be);
  HostVec x = testing::random_vec(50, 3, -4, 4), w = testing::random_vec(50, 4);
  auto fwd = [&](const HostVec& v) {
    Tensor tx = d.up(v, Shape{50}), ty = d.zeros(Shape{50});
    be->gelu_fwd(tx, ty);
    return d.down(ty);
  };
  HostVec y = fwd(x);
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    CHECK(y[i] == doctest::Approx(0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)))).epsilon(1e-5));
  }
  Tensor tx = d.up(x, Shape{50}), tdy = d.up(w, Shape{50}), tdx = d.zeros(Shape{50});
  be->gelu_bwd(tx, tdy, tdx);
  HostVec a = d.down(tdx);
  auto r = testing::check_gradient<float>([&] { return weighted(fwd(x), w); }, x, a);
  CHECK_MESSAGE(r.ok, r.summary());
}

TEST_CASE("gpt ops cpu: embedding fwd/bwd (repeated ids / accumulate) and bad ids") {
  auto be = make_backend("cpu");
  HostDev d(*be);
  GptCase c(2);
  const int B = c.B, T = c.T, C = c.C, V = c.V;
  Tensor ids = d.empty(DType::I32, Shape{B, T});
  be->copy_from_host(ids.data, c.ids.data(), c.ids.size() * 4);
  Tensor wte = d.up(c.wte, Shape{V, C}), wpe = d.up(c.wpe, Shape{10, C}), y = d.zeros(Shape{B, T, C});
  be->embedding_fwd(ids, wte, wpe, y);
  HostVec hy = d.down(y);
  for (int i = 0; i < B * T; ++i)
    for (int j = 0; j < C; ++j)
      CHECK(hy[size_t(i * C + j)] == c.wte[size_t(c.ids[size_t(i)] * C + j)] + c.wpe[size_t((i % T) * C + j)]);
  HostVec ones_te(size_t(V * C), 1.f), ones_pe(size_t(10 * C), 1.f);
  Tensor dte = d.up(ones_te, Shape{V, C}), dpe = d.up(ones_pe, Shape{10, C});
  Tensor dy = d.up(c.dy, Shape{B, T, C});
  be->embedding_bwd(dy, ids, dte, dpe, true);
  HostVec wte_ref = ones_te, wpe_ref = ones_pe;
  for (int i = 0; i < B * T; ++i)
    for (int j = 0; j < C; ++j) {
      wte_ref[size_t(c.ids[size_t(i)] * C + j)] += c.dy[size_t(i * C + j)];
      wpe_ref[size_t((i % T) * C + j)] += c.dy[size_t(i * C + j)];
    }
  CHECK(testing::nerr(d.down(dte), wte_ref) < 1e-6);
  CHECK(testing::nerr(d.down(dpe), wpe_ref) < 1e-6);
  std::vector<int32_t> bad(size_t(B * T), 0);
  bad[3] = V;
  be->copy_from_host(ids.data, bad.data(), bad.size() * 4);
  CHECK_THROWS_WITH_AS(be->embedding_fwd(ids, wte, wpe, y), doctest::Contains("token id 21"), UserError);
}

TEST_CASE("gpt ops cpu: causal attention probabilities / output and gradient") {
  auto be = make_backend("cpu");
  HostDev d(*be);
  GptCase c(3);
  const int B = c.B, T = c.T, C = c.C, H = c.H, hs = C / H;
  auto fwd = [&](const HostVec& q, HostVec* probs) {
    Tensor tq = d.up(q, Shape{B, T, 3 * C}), o = d.zeros(Shape{B, T, C}), p = d.zeros(Shape{B, H, T, T});
    be->attention_fwd(tq, o, p, H);
    if (probs) *probs = d.down(p);
    return d.down(o);
  };
  HostVec probs;
  HostVec out = fwd(c.qkv, &probs);
  // naive reference for (b=1, h=2, t=4)
  {
    const int b = 1, h = 2, t = 4;
    std::vector<double> s(size_t(t + 1));
    double mx = -1e30, se = 0;
    for (int u = 0; u <= t; ++u) {
      double dd = 0;
      for (int j = 0; j < hs; ++j)
        dd += c.qkv[size_t((b * T + t) * 3 * C + h * hs + j)] * c.qkv[size_t((b * T + u) * 3 * C + C + h * hs + j)];
      s[size_t(u)] = dd / std::sqrt(double(hs));
      mx = std::max(mx, s[size_t(u)]);
    }
    for (auto& v : s) se += v = std::exp(v - mx);
    for (int j = 0; j < hs; ++j) {
      double o = 0;
      for (int u = 0; u <= t; ++u) o += s[size_t(u)] / se * c.qkv[size_t((b * T + u) * 3 * C + 2 * C + h * hs + j)];
      CHECK(out[size_t((b * T + t) * C + h * hs + j)] == doctest::Approx(o).epsilon(1e-5));
    }
    for (int u = t + 1; u < T; ++u) CHECK(probs[size_t(((b * H + h) * T + t) * T + u)] == 0.f);
  }
  Tensor tq = d.up(c.qkv, Shape{B, T, 3 * C}), o = d.zeros(Shape{B, T, C}), p = d.zeros(Shape{B, H, T, T});
  be->attention_fwd(tq, o, p, H);
  Tensor g = d.up(c.dout, Shape{B, T, C}), dq = d.zeros(Shape{B, T, 3 * C});
  be->attention_bwd(g, tq, o, p, dq, H);
  HostVec a = d.down(dq), q = c.qkv;
  auto r = testing::check_gradient<float>([&] { return weighted(fwd(q, nullptr), c.dout); }, q, a);
  CHECK_MESSAGE(r.ok, r.summary());
}

TEST_CASE("gpt ops cpu: softmax_xent_masked ignores padded columns") {
  auto be = make_backend("cpu");
  HostDev d(*be);
  GptCase c(4);
  const int N = c.B * c.T, V = c.V, Vp = c.Vp;
  HostVec z = c.logits;
  for (int i = 0; i < N; ++i) z[size_t(i * Vp + V + 1)] = 50.f;  // a huge padded logit
  auto run = [&](const HostVec& zz, HostVec* dz) {
    Tensor tz = d.up(zz, Shape{N, Vp}), lab = d.labels(c.labels), l = d.zeros(Shape{N});
    Tensor dl = d.zeros(Shape{N, Vp});
    be->softmax_xent_masked(tz, lab, V, 0.5f, l, dl);
    if (dz) *dz = d.down(dl);
    return d.down(l);
  };
  HostVec dz;
  HostVec loss = run(z, &dz);
  for (int i = 0; i < N; ++i) {
    double mx = -1e30, se = 0;
    for (int k = 0; k < V; ++k) mx = std::max(mx, double(z[size_t(i * Vp + k)]));
    for (int k = 0; k < V; ++k) se += std::exp(z[size_t(i * Vp + k)] - mx);
    CHECK(loss[size_t(i)] == doctest::Approx(mx + std::log(se) - z[size_t(i * Vp + c.labels[size_t(i)])]).epsilon(1e-5));
    for (int k = V; k < Vp; ++k) CHECK(dz[size_t(i * Vp + k)] == 0.f);
  }
  auto L = [&] {
    HostVec l = run(z, nullptr);
    double s = 0;
    for (float v : l) s += 0.5 * v;
    return s;
  };
  testing::GradCheckOptions o;
  o.max_checks = 200;
  auto r = testing::check_gradient<float>(L, z, dz, o);
  CHECK_MESSAGE(r.ok, r.summary());
}

TEST_CASE("gpt ops cpu: layer norm backward with accumulate_dx equals backward then add bit for bit") {
  auto be = make_backend("cpu");
  HostDev d(*be);
  const int64_t M = 7, C = 24;
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(t));
    const HostVec x = testing::rounded(testing::random_vec(size_t(M * C), 71, -2, 2), t);
    const HostVec dy = testing::rounded(testing::random_vec(size_t(M * C), 72), t);
    const HostVec res = testing::rounded(testing::random_vec(size_t(M * C), 73), t);
    HostVec g = testing::random_vec(size_t(C), 74, 0.5f, 1.5f), b = testing::random_vec(size_t(C), 75);
    Tensor tx = d.up(x, t, {M, C}), tdy = d.up(dy, t, {M, C}), tg = d.up(g, Shape{C}), tb = d.up(b, Shape{C});
    Tensor y = d.up(HostVec(size_t(M * C)), t, {M, C}), mean = d.zeros(Shape{M}), rstd = d.zeros(Shape{M});
    be->layernorm_fwd(tx, tg, tb, y, mean, rstd, 1e-5f);
    // separate: dx then dx + res
    Tensor dx = d.up(HostVec(size_t(M * C)), t, {M, C}), tres = d.up(res, t, {M, C});
    Tensor dg1 = d.zeros(Shape{C}), db1 = d.zeros(Shape{C});
    be->layernorm_bwd(tdy, tx, tg, mean, rstd, dx, dg1, db1, false, false);
    be->add(dx, tres, dx);
    // fused: res += the gradient (parameter gradients in the same call)
    Tensor acc = d.up(res, t, {M, C}), dg2 = d.zeros(Shape{C}), db2 = d.zeros(Shape{C});
    be->layernorm_bwd(tdy, tx, tg, mean, rstd, acc, dg2, db2, false, true);
    CHECK(testing::bit_equal(d.down(acc), d.down(dx)));
    CHECK(testing::bit_equal(d.down(dg2), d.down(dg1)));
    CHECK(testing::bit_equal(d.down(db2), d.down(db1)));
  }
}

}  // TEST_SUITE("unit")

TEST_SUITE("gpu") {

TEST_CASE("gpt ops: CUDA matches CPU (layernorm / gelu / embedding / attention / masked xent)") {
  GPU_OR_SKIP();
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  GptCase c(5);
  const int B = c.B, T = c.T, C = c.C, H = c.H, V = c.V, M = B * T;
  // Runs every op on `be` and returns all outputs concatenated by name.
  auto run_all = [&](Backend& be) {
    HostDev d(be);
    std::vector<std::pair<std::string, HostVec>> out;
    Tensor x = d.up(c.x, Shape{M, C}), g = d.up(c.g, Shape{C}), b = d.up(c.b, Shape{C});
    Tensor y = d.zeros(Shape{M, C}), mean = d.zeros(Shape{M}), rstd = d.zeros(Shape{M});
    be.layernorm_fwd(x, g, b, y, mean, rstd, 1e-5f);
    Tensor dy = d.up(c.dy, Shape{M, C}), dx = d.zeros(Shape{M, C}), dg = d.zeros(Shape{C}), db = d.zeros(Shape{C});
    be.layernorm_bwd(dy, x, g, mean, rstd, dx, dg, db, false, false);
    out.push_back({"ln.y", d.down(y)});
    out.push_back({"ln.rstd", d.down(rstd)});
    out.push_back({"ln.dx", d.down(dx)});
    out.push_back({"ln.dg", d.down(dg)});
    out.push_back({"ln.db", d.down(db)});
    Tensor gy = d.zeros(Shape{M, C}), gdx = d.zeros(Shape{M, C});
    be.gelu_fwd(x, gy);
    be.gelu_bwd(x, dy, gdx);
    out.push_back({"gelu.y", d.down(gy)});
    out.push_back({"gelu.dx", d.down(gdx)});
    Tensor ids = d.empty(DType::I32, Shape{B, T});
    be.copy_from_host(ids.data, c.ids.data(), c.ids.size() * 4);
    Tensor wte = d.up(c.wte, Shape{V, C}), wpe = d.up(c.wpe, Shape{10, C}), ey = d.zeros(Shape{B, T, C});
    be.embedding_fwd(ids, wte, wpe, ey);
    Tensor dte = d.up(c.wte, Shape{V, C}), dpe = d.zeros(Shape{10, C});
    be.embedding_bwd(dy, ids, dte, dpe, true);
    out.push_back({"emb.y", d.down(ey)});
    out.push_back({"emb.dwte", d.down(dte)});
    out.push_back({"emb.dwpe", d.down(dpe)});
    Tensor q = d.up(c.qkv, Shape{B, T, 3 * C}), o = d.zeros(Shape{B, T, C}), p = d.zeros(Shape{B, H, T, T});
    be.attention_fwd(q, o, p, H);
    Tensor go = d.up(c.dout, Shape{B, T, C}), dq = d.zeros(Shape{B, T, 3 * C});
    be.attention_bwd(go, q, o, p, dq, H);
    out.push_back({"attn.out", d.down(o)});
    out.push_back({"attn.probs", d.down(p)});
    out.push_back({"attn.dqkv", d.down(dq)});
    Tensor z = d.up(c.logits, Shape{M, c.Vp}), lab = d.labels(c.labels), l = d.zeros(Shape{M}), dz = d.zeros(Shape{M, c.Vp});
    be.softmax_xent_masked(z, lab, V, 1.f / M, l, dz);
    out.push_back({"xent.loss", d.down(l)});
    out.push_back({"xent.dlogits", d.down(dz)});
    return out;
  };
  auto want = run_all(*cpu);
  auto got = run_all(*gpu);
  REQUIRE(want.size() == got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    CAPTURE(want[i].first);
    CHECK(testing::nerr(got[i].second, want[i].second) < 1e-5);
    CHECK(!testing::all_zero(got[i].second));
  }
  // determinism: a second run is bit-identical
  auto again = run_all(*gpu);
  for (size_t i = 0; i < got.size(); ++i) CHECK(testing::bit_equal(got[i].second, again[i].second));
}

}  // TEST_SUITE("gpu")

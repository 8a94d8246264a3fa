// CpuBackend ops against the naive references (tests/ref_ops.h) on awkward sizes, their
// finite-difference gradients (tests/gradcheck.h), optimizer steps against hand-computed
// PyTorch formulas, accumulate flags, 16-bit emulation and determinism.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "core/buffer.h"
#include "gradcheck.h"
#include "op_harness.h"
#include "ref_ops.h"

using namespace dtrain;
using ref::Vec;
using testing::random_vec;

namespace {

using testing::all_zero;
using testing::bit_equal;
using testing::HostDev;
using testing::nerr;

Conv2dParams cp(int sh, int sw, int ph, int pw, int dh = 1, int dw = 1) {
  Conv2dParams p;
  p.stride_h = sh, p.stride_w = sw, p.pad_h = ph, p.pad_w = pw, p.dil_h = dh, p.dil_w = dw;
  return p;
}
// awkward geometries: odd sizes, stride 2, padding, dilation 2, 1x1, 7x7, non-square
const ref::Conv kConvCases[] = {
    {2, 7, 5, 3, 4, 3, 3, cp(1, 1, 1, 1)},     {3, 9, 8, 5, 6, 3, 3, cp(2, 2, 1, 1)},
    {2, 10, 9, 3, 2, 3, 3, cp(1, 1, 2, 2, 2, 2)}, {2, 6, 5, 7, 3, 1, 1, cp(1, 1, 0, 0)},
    {2, 6, 6, 4, 5, 1, 1, cp(2, 2, 0, 0)},     {1, 11, 13, 3, 4, 7, 7, cp(2, 2, 3, 3)},
    {2, 8, 7, 3, 5, 3, 1, cp(2, 1, 1, 0)},     {2, 5, 9, 2, 3, 1, 5, cp(1, 2, 0, 2, 1, 1)},
    // ResNet's stride-2 1x1 shortcut: oneDNN 2.6's AVX2 1x1 backward-weights kernel got
    // these wrong (and corrupted the heap) on an AVX2-only CPU
    {4, 8, 8, 4, 8, 1, 1, cp(2, 2, 0, 0)},     {4, 8, 8, 1, 16, 1, 1, cp(2, 2, 0, 0)},
    {1, 8, 8, 3, 4, 1, 1, cp(2, 2, 0, 0)},
};
const cpu::ConvImpl kImpls[] = {cpu::ConvImpl::Dnnl, cpu::ConvImpl::Im2col};
const char* impl_name(cpu::ConvImpl i) { return i == cpu::ConvImpl::Dnnl ? "dnnl" : "im2col"; }
Shape xs(const ref::Conv& g) { return {g.N, g.H, g.W, g.C}; }
Shape ws(const ref::Conv& g) { return {g.O, g.KH, g.KW, g.C}; }
Shape ys(const ref::Conv& g) { return {g.N, g.OH(), g.OW(), g.O}; }

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("cpu: supports() is truthful and unsupported dtypes throw naming op and dtype") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  CHECK(d.be.supports(Op::Conv2dFwd, DType::F32));
  CHECK(d.be.supports(Op::Cast, DType::BF16));
  CHECK(d.be.supports(Op::Cast, DType::F16));
  CHECK_FALSE(d.be.supports(Op::AdamWStep, DType::BF16));
  CHECK_FALSE(d.be.supports(Op::Gemm, DType::I32));
  Buffer b(d.be, 64);
  Tensor p16 = b.tensor(DType::BF16, Shape{8}), g = d.zeros({8}), m = d.zeros({8}), v = d.zeros({8});
  try {
    d.be.adamw_step(p16, g, m, v, {{0, 8, true}}, AdamWArgs{});
    FAIL("expected RuntimeFault");
  } catch (const RuntimeFault& e) {
    CHECK(std::string(e.what()).find("adamw_step") != std::string::npos);
    CHECK(std::string(e.what()).find("bf16") != std::string::npos);
  }
}

TEST_CASE("cpu: fill copy cast (bf16/f16 both ways) add axpby scale") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  Vec a = random_vec(1001, 1, -3, 3), b = random_vec(1001, 2);
  Tensor ta = d.up(a, {7, 11, 13}), tb = d.up(b, {1001}), ty = d.zeros({1001});
  d.be.fill(ty, 2.5f);
  for (float f : d.down(ty)) REQUIRE(f == 2.5f);
  d.be.copy(ta, ty);
  CHECK(bit_equal(d.down(ty), a));
  for (DType t : {DType::BF16, DType::F16}) {
    Buffer hb(d.be, 1001 * 2);
    Tensor h = hb.tensor(t, Shape{1001});
    d.be.cast(ta, h);
    d.be.cast(h, ty);
    Vec back = d.down(ty);
    const uint16_t* raw = h.ptr<uint16_t>();
    for (size_t i = 0; i < a.size(); ++i) {
      const float want = t == DType::BF16 ? bf16_to_f32(f32_to_bf16(a[i])) : f16_to_f32(f32_to_f16(a[i]));
      REQUIRE(back[i] == want);
      REQUIRE(raw[i] == (t == DType::BF16 ? f32_to_bf16(a[i]) : f32_to_f16(a[i])));
    }
    d.be.fill(h, -1.5f);
    d.be.cast(h, ty);
    CHECK(d.down(ty)[1000] == -1.5f);
  }
  Tensor ta1 = ta.view({1001});
  d.be.add(ta1, tb, ty);
  Vec want(1001);
  for (size_t i = 0; i < want.size(); ++i) want[i] = a[i] + b[i];
  CHECK(bit_equal(d.down(ty), want));
  d.be.add(ty, tb, ty);  // aliasing output
  for (size_t i = 0; i < want.size(); ++i) want[i] = want[i] + b[i];
  CHECK(bit_equal(d.down(ty), want));
  d.be.axpby(2.f, ta1, -0.5f, ty);
  for (size_t i = 0; i < want.size(); ++i) want[i] = 2.f * a[i] + -0.5f * want[i];
  CHECK(bit_equal(d.down(ty), want));
  d.be.fill(ty, std::numeric_limits<float>::quiet_NaN());
  d.be.axpby(3.f, tb, 0.f, ty);  // beta = 0 never reads y
  for (size_t i = 0; i < want.size(); ++i) want[i] = 3.f * b[i];
  CHECK(bit_equal(d.down(ty), want));
  d.be.scale(ty, 0.25f);
  for (auto& w : want) w *= 0.25f;
  CHECK(bit_equal(d.down(ty), want));
}

TEST_CASE("cpu: sum_squares and sum_rows (accumulate) and all_finite") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  Vec a = random_vec(100003, 3);
  Tensor ta = d.up(a, {100003});
  double want = 0;
  for (float f : a) want += double(f) * f;
  CHECK(d.be.sum_squares(ta) == doctest::Approx(want).epsilon(1e-12));
  for (int64_t N : {1, 7, 64, 20000}) {
    const int64_t M = 100003 / N;
    Vec x(a.begin(), a.begin() + M * N);
    Tensor tx = d.up(x, {M, N}), ty = d.up(random_vec(size_t(N), 4), {N});
    Vec y0 = d.down(ty);
    d.be.sum_rows(tx, ty, false);
    Vec s = ref::sum_rows(x, N);
    EXPECT_CLOSE(d.down(ty), s, 1e-5);
    d.set(ty, y0);
    d.be.sum_rows(tx, ty, true);
    for (int64_t j = 0; j < N; ++j) s[size_t(j)] += y0[size_t(j)];
    EXPECT_CLOSE(d.down(ty), s, 1e-5);
  }
  CHECK(d.be.all_finite(ta));
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    Vec b = a;
    b[77777] = bad;
    CHECK_FALSE(d.be.all_finite(d.up(b, {100003})));
  }
}

TEST_CASE("cpu: gemm all transposes with alpha/beta on odd sizes") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{7, 5, 9}, {33, 65, 17}, {1, 3, 1},
                             {130, 67, 45} /* split by rows */, {3, 200, 400} /* by columns */})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        CAPTURE(M); CAPTURE(N); CAPTURE(K); CAPTURE(ta); CAPTURE(tb);
        Vec a = random_vec(size_t(M * K), 5), b = random_vec(size_t(K * N), 6);
        Vec c = random_vec(size_t(M * N), 7);
        Tensor A = d.up(a, ta ? Shape{K, M} : Shape{M, K}), B = d.up(b, tb ? Shape{N, K} : Shape{K, N});
        Tensor C = d.up(c, {M, N});
        d.be.gemm(ta, tb, 1.5f, A, B, 0.5f, C);
        Vec want = c;
        ref::gemm(ta, tb, M, N, K, 1.5, a, b, 0.5, want);
        EXPECT_CLOSE(d.down(C), want, 1e-6);
      }
  Vec bias = random_vec(5, 8), y = random_vec(35, 9);
  Tensor ty = d.up(y, {7, 5});
  d.be.add_bias(ty, d.up(bias, {5}));
  for (size_t i = 0; i < y.size(); ++i) y[i] += bias[i % 5];
  CHECK(bit_equal(d.down(ty), y));
}

TEST_CASE("cpu: conv2d fwd / bwd_data / bwd_filter (oneDNN and im2col) vs naive reference") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  for (auto impl : kImpls)
    for (const auto& g : kConvCases) {
      CAPTURE(impl_name(impl)); CAPTURE(g.H); CAPTURE(g.W); CAPTURE(g.KH); CAPTURE(g.KW);
          CAPTURE(g.p.stride_h); CAPTURE(g.p.pad_h); CAPTURE(g.p.dil_h);
      cpu.set_conv_impl(impl);
      Vec x = random_vec(size_t(g.xsize()), 10), w = random_vec(size_t(g.wsize()), 11);
      Vec bias = random_vec(size_t(g.O), 12), dy = random_vec(size_t(g.ysize()), 13);
      Tensor tx = d.up(x, xs(g)), tw = d.up(w, ws(g)), tb = d.up(bias, {g.O});
      Tensor ty = d.zeros(ys(g)), tdy = d.up(dy, ys(g)), tdx = d.zeros(xs(g));
      d.be.conv2d_fwd(tx, tw, tb, ty, g.p);
      EXPECT_CLOSE(d.down(ty), ref::conv2d_fwd(g, x, w, &bias), 1e-5);
      d.be.conv2d_fwd(tx, tw, Tensor(), ty, g.p);
      EXPECT_CLOSE(d.down(ty), ref::conv2d_fwd(g, x, w, nullptr), 1e-5);
      d.be.fill(tdx, 7.f);  // overwritten, not accumulated
      d.be.conv2d_bwd_data(tdy, tw, tdx, g.p, false);
      EXPECT_CLOSE(d.down(tdx), ref::conv2d_bwd_data(g, dy, w), 1e-5);
      {  // accumulate: dx += the gradient, bit-identical to the op then an add
        Vec base = random_vec(x.size(), 77), sum(x.size()), got = d.down(tdx);
        Tensor tacc = d.up(base, xs(g));
        d.be.conv2d_bwd_data(tdy, tw, tacc, g.p, true);
        for (size_t i = 0; i < x.size(); ++i) sum[i] = base[i] + got[i];
        CHECK(bit_equal(d.down(tacc), sum));
      }
      Vec dw0 = random_vec(size_t(g.wsize()), 14), db0 = random_vec(size_t(g.O), 15);
      Tensor tdw = d.up(dw0, ws(g)), tdb = d.up(db0, {g.O});
      Vec dw_ref = ref::conv2d_bwd_filter(g, x, dy), db_ref = ref::sum_rows(dy, g.O);
      d.be.conv2d_bwd_filter(tx, tdy, tdw, tdb, g.p, false);
      EXPECT_CLOSE(d.down(tdw), dw_ref, 1e-5);
      EXPECT_CLOSE(d.down(tdb), db_ref, 1e-5);
      d.be.conv2d_bwd_filter(tx, tdy, tdw, tdb, g.p, true);  // accumulate: doubles
      for (auto& v : dw_ref) v *= 2;
      for (auto& v : db_ref) v *= 2;
      EXPECT_CLOSE(d.down(tdw), dw_ref, 1e-5);
      EXPECT_CLOSE(d.down(tdb), db_ref, 1e-5);
      Tensor none;
      d.be.conv2d_bwd_filter(tx, tdy, tdw, none, g.p, false);  // no bias grad
      EXPECT_CLOSE(d.down(tdw), ref::conv2d_bwd_filter(g, x, dy), 1e-5);
    }
}

TEST_CASE("cpu: conv2d rejects mismatched shapes with a message naming the op") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  Tensor x = d.zeros({1, 5, 5, 3}), w = d.zeros({4, 3, 3, 2}), y = d.zeros({1, 5, 5, 4});
  CHECK_THROWS_WITH_AS(d.be.conv2d_fwd(x, w, Tensor(), y, cp(1, 1, 1, 1)),
                       doctest::Contains("conv2d_fwd"), RuntimeFault);
}

TEST_CASE("cpu: batchnorm train/eval/bwd vs reference and running stats like PyTorch") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  const int64_t M = 3 * 5 * 7, C = 6;
  const float eps = 1e-5f, mom = 0.1f;
  Vec x = random_vec(size_t(M * C), 20, -2, 3), g = random_vec(size_t(C), 21, 0.5, 1.5);
  Vec b = random_vec(size_t(C), 22), dy = random_vec(size_t(M * C), 23);
  Vec rm0 = random_vec(size_t(C), 24), rv0 = random_vec(size_t(C), 25, 0.5, 2);
  Tensor tx = d.up(x, {3, 5, 7, C}), tg = d.up(g, {C}), tb = d.up(b, {C}), ty = d.zeros({3, 5, 7, C});
  Tensor rm = d.up(rm0, {C}), rv = d.up(rv0, {C}), sm = d.zeros({C}), si = d.zeros({C});
  d.be.batchnorm_fwd_train(tx, tg, tb, ty, rm, rv, sm, si, mom, eps);
  auto st = ref::bn_stats(x, C);
  EXPECT_CLOSE(d.down(ty), ref::bn_apply(x, C, st.mean, st.var, g, b, eps), 1e-6);
  Vec want_m(C), want_i(C), want_rm(C), want_rv(C);
  for (int64_t j = 0; j < C; ++j) {
    want_m[j] = float(st.mean[j]);
    want_i[j] = float(1 / std::sqrt(st.var[j] + eps));
    want_rm[j] = float(0.9 * rm0[j] + 0.1 * st.mean[j]);
    want_rv[j] = float(0.9 * rv0[j] + 0.1 * st.var[j] * M / (M - 1));
  }
  EXPECT_CLOSE(d.down(sm), want_m, 1e-6);
  EXPECT_CLOSE(d.down(si), want_i, 1e-6);
  EXPECT_CLOSE(d.down(rm), want_rm, 1e-6);
  EXPECT_CLOSE(d.down(rv), want_rv, 1e-6);
  d.be.batchnorm_fwd_eval(tx, tg, tb, rm, rv, ty, eps);
  std::vector<double> rmd(want_rm.begin(), want_rm.end()), rvd(want_rv.begin(), want_rv.end());
  EXPECT_CLOSE(d.down(ty), ref::bn_apply(x, C, rmd, rvd, g, b, eps), 1e-6);
  Vec dg_ref, db_ref;
  Vec dx_ref = ref::bn_bwd(dy, x, C, g, eps, dg_ref, db_ref);
  Vec dg0 = random_vec(size_t(C), 26), db0 = random_vec(size_t(C), 27);
  Tensor tdy = d.up(dy, {M, C}), tdx = d.zeros({M, C}), tdg = d.up(dg0, {C}), tdb = d.up(db0, {C});
  Tensor tx2 = tx.view({M, C});
  d.be.batchnorm_bwd(tdy, tx2, tg, sm, si, tdx, tdg, tdb, false);
  EXPECT_CLOSE(d.down(tdx), dx_ref, 1e-5);
  EXPECT_CLOSE(d.down(tdg), dg_ref, 1e-6);
  EXPECT_CLOSE(d.down(tdb), db_ref, 1e-6);
  d.be.batchnorm_bwd(tdy, tx2, tg, sm, si, tdx, tdg, tdb, true);
  for (auto& v : dg_ref) v *= 2;
  for (auto& v : db_ref) v *= 2;
  EXPECT_CLOSE(d.down(tdg), dg_ref, 1e-6);
  EXPECT_CLOSE(d.down(tdb), db_ref, 1e-6);
  Tensor one = d.zeros({1, 1, 1, C});
  CHECK_THROWS_AS(d.be.batchnorm_fwd_train(one, tg, tb, one, rm, rv, sm, si, mom, eps), UserError);
}

TEST_CASE("cpu: relu and max/avg/global pooling vs reference") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  Vec x = random_vec(2 * 7 * 9 * 3, 30);
  Tensor tx = d.up(x, {2, 7, 9, 3}), ty = d.zeros({2, 7, 9, 3});
  d.be.relu_fwd(tx, ty);
  Vec y = d.down(ty), dy = random_vec(x.size(), 31);
  for (size_t i = 0; i < x.size(); ++i) REQUIRE(y[i] == std::max(x[i], 0.f));
  Tensor tdy = d.up(dy, {2, 7, 9, 3});
  d.be.relu_bwd(ty, tdy, tdy);  // dx aliases dy
  Vec dx = d.down(tdy);
  for (size_t i = 0; i < x.size(); ++i) REQUIRE(dx[i] == (x[i] > 0 ? dy[i] : 0.f));

  Pool2dParams pools[] = {{3, 3, 2, 2, 1, 1}, {2, 2, 2, 2, 0, 0}, {3, 2, 1, 2, 1, 0}, {1, 1, 2, 2, 0, 0}};
  for (const auto& p : pools) {
    CAPTURE(p.kernel_h); CAPTURE(p.kernel_w); CAPTURE(p.stride_h); CAPTURE(p.pad_h);
    ref::Pool g{2, 7, 9, 3, p};
    Tensor tpy = d.zeros({g.N, g.OH(), g.OW(), g.C}), tdx = d.zeros({2, 7, 9, 3});
    Vec pdy = random_vec(size_t(g.ysize()), 32);
    Tensor tpdy = d.up(pdy, {g.N, g.OH(), g.OW(), g.C});
    Tensor am = d.empty(DType::U8, {g.N, g.OH(), g.OW(), g.C}), none;
    d.be.maxpool2d_fwd(tx, tpy, am, p);
    CHECK(bit_equal(d.down(tpy), ref::maxpool_fwd(g, x)));
    d.be.maxpool2d_bwd(am, tpdy, tdx, p, false);
    const Vec want = ref::maxpool_bwd(g, x, pdy);
    EXPECT_CLOSE(d.down(tdx), want, 1e-6);
    // without argmax (no backward follows) the same output
    Tensor tpy2 = d.zeros({g.N, g.OH(), g.OW(), g.C});
    d.be.maxpool2d_fwd(tx, tpy2, none, p);
    CHECK(bit_equal(d.down(tpy2), d.down(tpy)));
    // accumulate: dx += the gradient, bit-identical to a separate add
    Vec base = random_vec(x.size(), 34), sum(x.size());
    Tensor tacc = d.up(base, {2, 7, 9, 3});
    d.be.maxpool2d_bwd(am, tpdy, tacc, p, true);
    Vec got = d.down(tdx);
    for (size_t i = 0; i < x.size(); ++i) sum[i] = base[i] + got[i];
    CHECK(bit_equal(d.down(tacc), sum));
    d.be.avgpool2d_fwd(tx, tpy, p);
    EXPECT_CLOSE(d.down(tpy), ref::avgpool_fwd(g, x), 1e-6);
    d.be.avgpool2d_bwd(tpdy, tdx, p);
    EXPECT_CLOSE(d.down(tdx), ref::avgpool_bwd(g, pdy), 1e-6);
  }
  // ties: the gradient goes to the first max of the window only (PyTorch)
  ref::Pool g{1, 4, 4, 1, {2, 2, 2, 2, 0, 0}};
  Tensor ones = d.up(Vec(16, 1.f), {1, 4, 4, 1}), py = d.zeros({1, 2, 2, 1}), pdx = d.zeros({1, 4, 4, 1});
  Tensor pam = d.empty(DType::U8, {1, 2, 2, 1});
  d.be.maxpool2d_fwd(ones, py, pam, g.p);
  d.be.maxpool2d_bwd(pam, d.up(Vec{1, 2, 3, 4}, {1, 2, 2, 1}), pdx, g.p, false);
  CHECK(bit_equal(d.down(pdx), Vec{1, 0, 2, 0, 0, 0, 0, 0, 3, 0, 4, 0, 0, 0, 0, 0}));
  // NaN wins, and of two NaNs the last in scan order (PyTorch's rule); padding never wins
  {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    Pool2dParams p3{3, 3, 1, 1, 1, 1};
    Tensor nx = d.up(Vec{-5, nan, 2, nan}, {1, 2, 2, 1}), ny = d.zeros({1, 2, 2, 1});
    Tensor nam = d.empty(DType::U8, {1, 2, 2, 1}), ndx = d.zeros({1, 2, 2, 1});
    d.be.maxpool2d_fwd(nx, ny, nam, p3);
    for (float v : d.down(ny)) CHECK(std::isnan(v));
    d.be.maxpool2d_bwd(nam, d.up(Vec{1, 2, 4, 8}, {1, 2, 2, 1}), ndx, p3, false);
    CHECK(bit_equal(d.down(ndx), Vec{0, 0, 0, 15}));
    Tensor mx = d.up(Vec{-7, -9, -8, -6}, {1, 2, 2, 1});  // all negative: the padded -inf never wins
    d.be.maxpool2d_fwd(mx, ny, nam, p3);
    CHECK(bit_equal(d.down(ny), Vec{-6, -6, -6, -6}));
  }

  Tensor gy = d.zeros({2, 3});
  d.be.global_avgpool_fwd(tx, gy);
  ref::Pool whole{2, 7, 9, 3, {7, 9, 1, 1, 0, 0}};
  EXPECT_CLOSE(d.down(gy), ref::avgpool_fwd(whole, x), 1e-6);
  Vec gdy = random_vec(6, 33);
  Tensor gdx = d.zeros({2, 7, 9, 3});
  d.be.global_avgpool_bwd(d.up(gdy, {2, 3}), gdx);
  EXPECT_CLOSE(d.down(gdx), ref::avgpool_bwd(whole, gdy), 1e-6);
}

TEST_CASE("cpu: softmax_xent with and without label smoothing and stable for huge logits") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  const int64_t N = 5, C = 7;
  for (float ls : {0.f, 0.1f})
    for (float shift : {0.f, 1000.f}) {
      Vec z = random_vec(size_t(N * C), 40, -4, 4);
      for (auto& v : z) v += shift;
      std::vector<int32_t> lab{0, 6, 3, 3, 1};
      Tensor tz = d.up(z, {N, C}), tl = d.zeros({N}), tdz = d.zeros({N, C});
      d.be.softmax_xent(tz, d.labels(lab), ls, 0.5f, tl, tdz);
      Vec wl(N), wdz(size_t(N * C));
      for (int64_t i = 0; i < N; ++i)
        wl[i] = float(ref::xent_row(&z[size_t(i * C)], C, lab[i], ls, &wdz[size_t(i * C)], 0.5));
      EXPECT_CLOSE(d.down(tl), wl, 1e-6);
      EXPECT_CLOSE(d.down(tdz), wdz, 1e-6);
      CHECK(d.be.all_finite(tl));
    }
  Tensor tz = d.zeros({2, 3}), tl = d.zeros({2}), none;
  CHECK_THROWS_AS(d.be.softmax_xent(tz, d.labels({0, 3}), 0.f, 1.f, tl, none), UserError);
}

TEST_CASE("cpu: sgd_step matches PyTorch's SGD (momentum/dampening/nesterov/decay flags)") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  // hand-computed: p=1, g=0.5, lr=0.1, momentum 0.9, wd 0.01
  //   step 1: d = 0.5 + 0.01 = 0.51, buf = 0.51, p = 0.949
  //   step 2: d = 0.5 + 0.00949 = 0.50949, buf = 0.9*0.51 + 0.50949 = 0.96849, p = 0.852151
  Tensor p = d.up({1.f}, {1}), g = d.up({0.5f}, {1}), m = d.zeros({1});
  SgdArgs a;
  a.lr = 0.1f, a.momentum = 0.9f, a.weight_decay = 0.01f, a.first_step = true;
  d.be.sgd_step(p, g, m, {{0, 1, true}}, a);
  CHECK(d.down(p)[0] == doctest::Approx(0.949).epsilon(1e-6));
  a.first_step = false;
  d.be.sgd_step(p, g, m, {{0, 1, true}}, a);
  CHECK(d.down(p)[0] == doctest::Approx(0.852151).epsilon(1e-6));
  CHECK(d.down(m)[0] == doctest::Approx(0.96849).epsilon(1e-6));

  for (int variant = 0; variant < 3; ++variant) {
    CAPTURE(variant);
    const int64_t n = 300;
    Vec p0 = random_vec(n, 50), g0 = random_vec(n, 51);
    Tensor tp = d.up(p0, {n}), tg = d.up(g0, {n}), tm = d.zeros({n});
    SgdArgs s;
    s.lr = 0.05f, s.momentum = variant == 0 ? 0.f : 0.9f, s.weight_decay = 5e-4f;
    s.dampening = variant == 1 ? 0.1f : 0.f, s.nesterov = variant == 2, s.grad_scale = 0.25f;
    std::vector<ParamSegment> segs{{0, 100, true}, {100, 50, false}, {200, 100, true}};
    std::vector<double> pp(p0.begin(), p0.end()), buf(n, 0.0);
    for (int step = 0; step < 3; ++step) {
      s.first_step = step == 0;
      d.be.sgd_step(tp, tg, tm, segs, s);
      for (const auto& sg : segs)
        for (int64_t i = sg.offset; i < sg.offset + sg.count; ++i) {
          double dp = g0[i] * 0.25 + (sg.decay ? 5e-4 : 0.0) * pp[i];
          if (s.momentum != 0) {
            buf[i] = step == 0 ? dp : 0.9 * buf[i] + (1 - s.dampening) * dp;
            dp = s.nesterov ? dp + 0.9 * buf[i] : buf[i];
          }
          pp[i] -= 0.05 * dp;
        }
    }
    Vec got = d.down(tp);
    for (int64_t i = 0; i < n; ++i) REQUIRE(got[i] == doctest::Approx(pp[i]).epsilon(1e-5));
    for (int64_t i = 150; i < 200; ++i) REQUIRE(got[i] == p0[i]);  // outside every segment
  }
}

TEST_CASE("cpu: adamw_step matches PyTorch's AdamW (decoupled decay and bias correction)") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  // hand-computed step 1: p=1, g=0.5, lr=0.1, wd=0.01: p*=0.999; m=0.05; v=0.00025;
  // step_size = 0.1/0.1 = 1; denom = sqrt(0.00025)/sqrt(0.001) + 1e-8 = 0.5; p = 0.999 - 0.1
  Tensor p = d.up({1.f}, {1}), g = d.up({0.5f}, {1}), m = d.zeros({1}), v = d.zeros({1});
  AdamWArgs a;
  a.lr = 0.1f, a.weight_decay = 0.01f, a.step = 1;
  d.be.adamw_step(p, g, m, v, {{0, 1, true}}, a);
  CHECK(d.down(p)[0] == doctest::Approx(0.899).epsilon(1e-6));
  CHECK(d.down(m)[0] == doctest::Approx(0.05).epsilon(1e-6));
  CHECK(d.down(v)[0] == doctest::Approx(0.00025).epsilon(1e-6));

  const int64_t n = 257;
  Vec p0 = random_vec(n, 60), g0 = random_vec(n, 61);
  Tensor tp = d.up(p0, {n}), tg = d.up(g0, {n}), tm = d.zeros({n}), tv = d.zeros({n});
  std::vector<ParamSegment> segs{{0, 200, true}, {200, 57, false}};
  std::vector<double> pp(p0.begin(), p0.end()), mm(n, 0.0), vv(n, 0.0);
  AdamWArgs s;
  s.lr = 3e-3f, s.beta1 = 0.8f, s.beta2 = 0.99f, s.eps = 1e-6f, s.weight_decay = 0.1f;
  s.grad_scale = 2.f;
  for (int64_t step = 1; step <= 4; ++step) {
    s.step = step;
    d.be.adamw_step(tp, tg, tm, tv, segs, s);
    for (const auto& sg : segs)
      for (int64_t i = sg.offset; i < sg.offset + sg.count; ++i) {
        const double gi = 2.0 * g0[i];
        if (sg.decay) pp[i] *= 1 - double(s.lr) * double(s.weight_decay);
        mm[i] = 0.8 * mm[i] + 0.2 * gi;
        vv[i] = 0.99 * vv[i] + 0.01 * gi * gi;
        const double bc1 = 1 - std::pow(0.8, step), bc2 = 1 - std::pow(0.99, step);
        pp[i] -= double(s.lr) / bc1 * mm[i] / (std::sqrt(vv[i]) / std::sqrt(bc2) + 1e-6);
      }
  }
  Vec got = d.down(tp);
  for (int64_t i = 0; i < n; ++i) REQUIRE(got[i] == doctest::Approx(pp[i]).epsilon(1e-5));
}

}  // TEST_SUITE("unit")

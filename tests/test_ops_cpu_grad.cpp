// CpuBackend: finite-difference gradient checks of every op with a backward
// (tests/gradcheck.h), determinism (bit-identical reruns; reductions independent of the
// thread count) and bf16/f16 emulation (16-bit storage, f32 math).
#include <doctest/doctest.h>

#include <functional>

#include "backend/cpu/cpu_backend.h"
#include "gradcheck.h"
#include "op_harness.h"
#include "ref_ops.h"

using namespace dtrain;
using testing::bit_equal;
using testing::dot;
using testing::GradCheckOptions;
using testing::HostDev;
using testing::HostVec;
using testing::random_vec;

namespace {

void expect_grad(const std::function<double()>& loss, HostVec& x, const HostVec& analytic,
                 const char* what, GradCheckOptions o = {}) {
  auto r = testing::check_gradient(loss, x, analytic, o);
  CHECK_MESSAGE(r.ok, what << ": " << r.summary());
  CHECK_MESSAGE(r.skipped * 10 <= r.checked, what << ": too many skipped: " << r.summary());
  CHECK_MESSAGE(!testing::all_zero(analytic), what << ": analytic gradient is all zero");
}

Conv2dParams cp(int s, int p, int d) {
  Conv2dParams c;
  c.stride_h = c.stride_w = s, c.pad_h = c.pad_w = p, c.dil_h = c.dil_w = d;
  return c;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("gradcheck: conv2d w.r.t. data/filter/bias (oneDNN and im2col)") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  for (auto impl : {cpu::ConvImpl::Dnnl, cpu::ConvImpl::Im2col})
    for (const ref::Conv& g : {ref::Conv{2, 6, 5, 3, 4, 3, 3, cp(2, 1, 1)},
                               ref::Conv{1, 7, 7, 2, 3, 3, 3, cp(1, 2, 2)}}) {
      cpu.set_conv_impl(impl);
      HostVec x = random_vec(size_t(g.xsize()), 1), w = random_vec(size_t(g.wsize()), 2);
      HostVec b = random_vec(size_t(g.O), 3), r = random_vec(size_t(g.ysize()), 4);
      Shape xs{g.N, g.H, g.W, g.C}, ws{g.O, g.KH, g.KW, g.C}, ys{g.N, g.OH(), g.OW(), g.O};
      Tensor tx = d.up(x, xs), tw = d.up(w, ws), tb = d.up(b, {g.O}), ty = d.zeros(ys);
      Tensor tr = d.up(r, ys), tdx = d.zeros(xs), tdw = d.zeros(ws), tdb = d.zeros({g.O});
      auto loss = [&] {
        d.set(tx, x), d.set(tw, w), d.set(tb, b);
        cpu.conv2d_fwd(tx, tw, tb, ty, g.p);
        return dot(d.down(ty), r);
      };
      cpu.conv2d_bwd_data(tr, tw, tdx, g.p, false);
      cpu.conv2d_bwd_filter(tx, tr, tdw, tdb, g.p, false);
      HostVec dx = d.down(tdx), dw = d.down(tdw), db = d.down(tdb);
      expect_grad(loss, x, dx, "conv dx");
      expect_grad(loss, w, dw, "conv dw");
      expect_grad(loss, b, db, "conv dbias");
    }
}

TEST_CASE("gradcheck: batchnorm (train) w.r.t. x/gamma/beta") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  const int64_t M = 2 * 3 * 4, C = 3;
  HostVec x = random_vec(size_t(M * C), 5, -2, 2), g = random_vec(C, 6, 0.5, 1.5);
  HostVec b = random_vec(C, 7), r = random_vec(size_t(M * C), 8);
  Tensor tx = d.up(x, {2, 3, 4, C}), tg = d.up(g, {C}), tb = d.up(b, {C}), ty = d.zeros({M, C});
  Tensor rm = d.zeros({C}), rv = d.zeros({C}), sm = d.zeros({C}), si = d.zeros({C});
  auto loss = [&] {
    d.set(tx, x), d.set(tg, g), d.set(tb, b);
    cpu.batchnorm_fwd_train(tx, tg, tb, ty, rm, rv, sm, si, 0.1f, 1e-5f);
    return dot(d.down(ty), r);
  };
  loss();
  Tensor tdx = d.zeros({M, C}), tdg = d.zeros({C}), tdb = d.zeros({C});
  cpu.batchnorm_bwd(d.up(r, {M, C}), tx, tg, sm, si, tdx, tdg, tdb, false);
  HostVec dx = d.down(tdx), dg = d.down(tdg), db = d.down(tdb);
  expect_grad(loss, x, dx, "bn dx");
  expect_grad(loss, g, dg, "bn dgamma");
  expect_grad(loss, b, db, "bn dbeta");
}

TEST_CASE("gradcheck: relu and max/avg/global avg pooling") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  HostVec x = random_vec(2 * 7 * 6 * 3, 9);
  Shape xs{2, 7, 6, 3};
  Tensor tx = d.up(x, xs), ty = d.zeros(xs), tdx = d.zeros(xs);
  {
    HostVec r = random_vec(x.size(), 10);
    auto loss = [&] {
      d.set(tx, x);
      cpu.relu_fwd(tx, ty);
      return dot(d.down(ty), r);
    };
    loss();
    cpu.relu_bwd(ty, d.up(r, xs), tdx);
    HostVec dx = d.down(tdx);
    GradCheckOptions o;
    o.skip = [&](int64_t i) { return std::abs(x[size_t(i)]) < 2e-3f; };  // the kink
    expect_grad(loss, x, dx, "relu", o);
  }
  for (bool maxpool : {true, false}) {
    Pool2dParams p{3, 3, 2, 2, 1, 1};
    ref::Pool g{2, 7, 6, 3, p};
    Shape ys{2, g.OH(), g.OW(), 3};
    Tensor tpy = d.zeros(ys), am = d.empty(DType::U8, ys);
    HostVec r = random_vec(size_t(g.ysize()), 11);
    auto loss = [&] {
      d.set(tx, x);
      maxpool ? cpu.maxpool2d_fwd(tx, tpy, am, p) : cpu.avgpool2d_fwd(tx, tpy, p);
      return dot(d.down(tpy), r);
    };
    loss();
    Tensor tr = d.up(r, ys);
    maxpool ? cpu.maxpool2d_bwd(am, tr, tdx, p, false) : cpu.avgpool2d_bwd(tr, tdx, p);
    HostVec dx = d.down(tdx);
    expect_grad(loss, x, dx, maxpool ? "maxpool" : "avgpool");
  }
  {
    Tensor gy = d.zeros({2, 3});
    HostVec r = random_vec(6, 12);
    auto loss = [&] {
      d.set(tx, x);
      cpu.global_avgpool_fwd(tx, gy);
      return dot(d.down(gy), r);
    };
    cpu.global_avgpool_bwd(d.up(r, {2, 3}), tdx);
    HostVec dx = d.down(tdx);
    expect_grad(loss, x, dx, "global avgpool");
  }
}

TEST_CASE("gradcheck: softmax_xent w.r.t. logits (with and without label smoothing)") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  const int64_t N = 4, C = 5;
  Tensor lab = d.labels({1, 4, 0, 2}), tl = d.zeros({N}), tdz = d.zeros({N, C}), none;
  for (float ls : {0.f, 0.2f}) {
    HostVec z = random_vec(size_t(N * C), 13, -3, 3);
    Tensor tz = d.up(z, {N, C});
    auto loss = [&] {
      d.set(tz, z);
      cpu.softmax_xent(tz, lab, ls, 1.f, tl, none);
      double s = 0;
      for (float v : d.down(tl)) s += v;
      return s;
    };
    cpu.softmax_xent(tz, lab, ls, 1.f, tl, tdz);
    HostVec dz = d.down(tdz);
    expect_grad(loss, z, dz, ls == 0.f ? "xent" : "xent smoothed");
  }
}

TEST_CASE("gradcheck: gemm w.r.t. both operands") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  const int64_t M = 5, N = 4, K = 7;
  HostVec a = random_vec(size_t(M * K), 14), b = random_vec(size_t(N * K), 15);
  HostVec r = random_vec(size_t(M * N), 16);
  Tensor ta = d.up(a, {M, K}), tb = d.up(b, {N, K}), tc = d.zeros({M, N}), tr = d.up(r, {M, N});
  auto loss = [&] {  // c = a @ b^T
    d.set(ta, a), d.set(tb, b);
    cpu.gemm(false, true, 1.f, ta, tb, 0.f, tc);
    return dot(d.down(tc), r);
  };
  Tensor tda = d.zeros({M, K}), tdb = d.zeros({N, K});
  cpu.gemm(false, false, 1.f, tr, tb, 0.f, tda);  // da = r @ b
  cpu.gemm(true, false, 1.f, tr, ta, 0.f, tdb);   // db = r^T @ a
  HostVec da = d.down(tda), db = d.down(tdb);
  expect_grad(loss, a, da, "gemm da");
  expect_grad(loss, b, db, "gemm db");
}

TEST_CASE("gradcheck: the checker itself fails a wrong gradient and skips a kink") {
  HostVec x{0.5f, -0.3f, 0.f, 2.f};
  auto loss = [&] { return double(x[0]) * x[0] + 3.0 * x[1] + std::abs(double(x[2])) + x[3]; };
  HostVec good{1.f, 3.f, 0.f, 1.f}, bad{1.f, 3.f, 0.f, 1.1f};
  auto r = testing::check_gradient<float>(loss, x, good);
  CHECK(r.ok);
  CHECK(r.skipped == 1);  // |x| at 0
  CHECK_FALSE(testing::check_gradient<float>(loss, x, bad).ok);
}

TEST_CASE("cpu determinism: reruns are bit-identical and own reductions ignore the thread count") {
  CpuBackend cpu1(1), cpu2(2);
  HostDev d1(cpu1), d2(cpu2);
  const ref::Conv g{16, 14, 14, 32, 32, 3, 3, cp(1, 1, 1)};
  Shape xs{g.N, g.H, g.W, g.C}, ws{g.O, g.KH, g.KW, g.C}, ys{g.N, g.OH(), g.OW(), g.O};
  HostVec x = random_vec(size_t(g.xsize()), 17), w = random_vec(size_t(g.wsize()), 18);
  HostVec dy = random_vec(size_t(g.ysize()), 19);
  Tensor tx = d2.up(x, xs), tw = d2.up(w, ws), ty = d2.zeros(ys), tdy = d2.up(dy, ys);
  Tensor tdx = d2.zeros(xs), tdw = d2.zeros(ws), tdb = d2.zeros({g.O});
  for (auto impl : {cpu::ConvImpl::Dnnl, cpu::ConvImpl::Im2col}) {
    cpu2.set_conv_impl(impl);
    std::vector<HostVec> runs[2];
    for (auto& run : runs) {
      cpu2.conv2d_fwd(tx, tw, Tensor(), ty, g.p);
      cpu2.conv2d_bwd_data(tdy, tw, tdx, g.p, false);
      cpu2.conv2d_bwd_filter(tx, tdy, tdw, tdb, g.p, false);
      run = {d2.down(ty), d2.down(tdx), d2.down(tdw), d2.down(tdb)};
    }
    for (size_t i = 0; i < runs[0].size(); ++i) CHECK(bit_equal(runs[0][i], runs[1][i]));
  }
  // batch norm, sum_rows, sum_squares, softmax: 1 thread == 2 threads, bit for bit
  const int64_t M = g.N * g.H * g.W, C = g.C;
  HostVec out[2][6];
  double ss[2];
  for (int k = 0; k < 2; ++k) {
    CpuBackend& be = k ? cpu2 : cpu1;
    HostDev& d = k ? d2 : d1;
    Tensor bx = d.up(x, {M, C}), bg = d.up(random_vec(C, 20), {C}), bb = d.up(random_vec(C, 21), {C});
    Tensor by = d.zeros({M, C}), rm = d.zeros({C}), rv = d.zeros({C}), sm = d.zeros({C}), si = d.zeros({C});
    Tensor bdx = d.zeros({M, C}), bdg = d.zeros({C}), bdb = d.zeros({C}), srow = d.zeros({C});
    be.batchnorm_fwd_train(bx, bg, bb, by, rm, rv, sm, si, 0.1f, 1e-5f);
    be.batchnorm_bwd(d.up(dy, {M, C}), bx, bg, sm, si, bdx, bdg, bdb, false);
    be.sum_rows(bx, srow, false);
    ss[k] = be.sum_squares(bx);
    out[k][0] = d.down(by), out[k][1] = d.down(rv), out[k][2] = d.down(bdx);
    out[k][3] = d.down(bdg), out[k][4] = d.down(srow);
    Tensor z = d.up(HostVec(x.begin(), x.begin() + 1000 * 10), {1000, 10});
    std::vector<int32_t> lab(1000);
    for (int i = 0; i < 1000; ++i) lab[size_t(i)] = i % 10;
    Tensor l = d.zeros({1000}), dz = d.zeros({1000, 10});
    be.softmax_xent(z, d.labels(lab), 0.1f, 1e-3f, l, dz);
    out[k][5] = d.down(dz);
  }
  for (int i = 0; i < 6; ++i) CHECK_MESSAGE(bit_equal(out[0][i], out[1][i]), "output " << i);
  CHECK(ss[0] == ss[1]);
}

TEST_CASE("cpu: bf16/f16 emulation equals the rounded f32 op on rounded inputs") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  for (DType t : {DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(t));
    auto rnd = [&](HostVec v) {
      for (auto& f : v) f = t == DType::BF16 ? bf16_to_f32(f32_to_bf16(f)) : f16_to_f32(f32_to_f16(f));
      return v;
    };
    // h(v, s): a 16-bit tensor holding v; read(t): f32 copy of any float tensor
    auto h = [&](const HostVec& v, Shape s) {
      Tensor out = d.empty(t, s);
      cpu.cast(d.up(v, s), out);
      return out;
    };
    auto read = [&](const Tensor& x) {
      Tensor f = d.zeros(x.shape);
      cpu.cast(x, f);
      return d.down(f);
    };
    const ref::Conv g{2, 6, 5, 3, 4, 3, 3, cp(2, 1, 1)};
    Shape xs{g.N, g.H, g.W, g.C}, ws{g.O, g.KH, g.KW, g.C}, ys{g.N, g.OH(), g.OW(), g.O};
    HostVec x = rnd(random_vec(size_t(g.xsize()), 22)), w = rnd(random_vec(size_t(g.wsize()), 23));
    HostVec dy = rnd(random_vec(size_t(g.ysize()), 24));
    // conv: 16-bit x, w, y, dy, dx; f32 dw (master grads)
    Tensor y16 = d.empty(t, ys), y32 = d.zeros(ys), dx16 = d.empty(t, xs), dx32 = d.zeros(xs);
    Tensor dw16 = d.zeros(ws), dw32 = d.zeros(ws), none;
    cpu.conv2d_fwd(h(x, xs), h(w, ws), none, y16, g.p);
    cpu.conv2d_fwd(d.up(x, xs), d.up(w, ws), none, y32, g.p);
    CHECK(bit_equal(read(y16), rnd(d.down(y32))));
    cpu.conv2d_bwd_data(h(dy, ys), h(w, ws), dx16, g.p, false);
    cpu.conv2d_bwd_data(d.up(dy, ys), d.up(w, ws), dx32, g.p, false);
    CHECK(bit_equal(read(dx16), rnd(d.down(dx32))));
    {  // accumulate into 16 bits: the gradient rounded, added, rounded (= the op, then add)
      HostVec base = rnd(random_vec(size_t(g.xsize()), 25)), grad = read(dx16), sum(base.size());
      Tensor acc16 = h(base, xs);
      cpu.conv2d_bwd_data(h(dy, ys), h(w, ws), acc16, g.p, true);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = base[i] + grad[i];
      CHECK(bit_equal(read(acc16), rnd(sum)));
    }
    cpu.conv2d_bwd_filter(h(x, xs), h(dy, ys), dw16, none, g.p, false);
    cpu.conv2d_bwd_filter(d.up(x, xs), d.up(dy, ys), dw32, none, g.p, false);
    CHECK(bit_equal(d.down(dw16), d.down(dw32)));
    // gemm, relu, batch norm, pooling, softmax_xent, add/axpby/scale on the same data
    const int64_t M = g.xsize() / g.C, C = g.C;
    Tensor c16 = d.empty(t, {M, M}), c32 = d.zeros({M, M});
    cpu.gemm(false, true, 1.f, h(x, {M, C}), h(x, {M, C}), 0.f, c16);
    cpu.gemm(false, true, 1.f, d.up(x, {M, C}), d.up(x, {M, C}), 0.f, c32);
    CHECK(bit_equal(read(c16), rnd(d.down(c32))));
    Tensor r16 = d.empty(t, xs), r32 = d.zeros(xs);
    cpu.relu_fwd(h(x, xs), r16);
    cpu.relu_fwd(d.up(x, xs), r32);
    CHECK(bit_equal(read(r16), rnd(d.down(r32))));
    Tensor st[2][4];
    for (auto& s : st)
      for (auto& e : s) e = d.zeros({C});
    Tensor gam = d.up(HostVec(size_t(C), 1.5f), {C}), bet = d.zeros({C});
    Tensor b16 = d.empty(t, {M, C}), b32 = d.zeros({M, C});
    cpu.batchnorm_fwd_train(h(x, {M, C}), gam, bet, b16, st[0][0], st[0][1], st[0][2], st[0][3], 0.1f, 1e-5f);
    cpu.batchnorm_fwd_train(d.up(x, {M, C}), gam, bet, b32, st[1][0], st[1][1], st[1][2], st[1][3], 0.1f, 1e-5f);
    CHECK(bit_equal(read(b16), rnd(d.down(b32))));
    Pool2dParams pp{3, 3, 2, 2, 1, 1};
    Tensor m16 = d.empty(t, {g.N, 3, 3, C}), m32 = d.zeros({g.N, 3, 3, C});
    Tensor am16 = d.empty(DType::U8, m16.shape), am32 = d.empty(DType::U8, m16.shape);
    cpu.maxpool2d_fwd(h(x, xs), m16, am16, pp);
    cpu.maxpool2d_fwd(d.up(x, xs), m32, am32, pp);
    CHECK(bit_equal(read(m16), rnd(d.down(m32))));
    {  // the backward (plain and accumulating) from the same argmax
      HostVec pdy = rnd(random_vec(size_t(m16.numel()), 26)), base = rnd(random_vec(size_t(g.xsize()), 27));
      Tensor p16 = d.empty(t, xs), p32 = d.zeros(xs), acc16 = h(base, xs);
      cpu.maxpool2d_bwd(am16, h(pdy, m16.shape), p16, pp, false);
      cpu.maxpool2d_bwd(am32, d.up(pdy, m16.shape), p32, pp, false);
      CHECK(bit_equal(read(p16), rnd(d.down(p32))));
      cpu.maxpool2d_bwd(am16, h(pdy, m16.shape), acc16, pp, true);
      HostVec grad = read(p16), sum(base.size());
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = base[i] + grad[i];
      CHECK(bit_equal(read(acc16), rnd(sum)));
    }
    Tensor lab = d.labels({0, 1, 2, 3, 0, 1}), l16 = d.zeros({6}), l32 = d.zeros({6});
    Tensor z16 = d.empty(t, {6, 5}), z32 = d.zeros({6, 5});
    HostVec zz(x.begin(), x.begin() + 30);
    cpu.softmax_xent(h(zz, {6, 5}), lab, 0.1f, 1.f, l16, z16);
    cpu.softmax_xent(d.up(zz, {6, 5}), lab, 0.1f, 1.f, l32, z32);
    CHECK(bit_equal(d.down(l16), d.down(l32)));
    CHECK(bit_equal(read(z16), rnd(d.down(z32))));
    Tensor a16 = h(x, xs), a32 = d.up(x, xs);
    cpu.axpby(0.5f, h(x, xs), 2.f, a16), cpu.axpby(0.5f, d.up(x, xs), 2.f, a32);
    CHECK(bit_equal(read(a16), rnd(d.down(a32))));
    Tensor s16 = d.empty(t, xs), s32 = d.zeros(xs);
    cpu.add(h(x, xs), r16, s16), cpu.add(d.up(x, xs), r32, s32);
    CHECK(bit_equal(read(s16), rnd(d.down(s32))));
    CHECK(cpu.sum_squares(h(x, xs)) == cpu.sum_squares(d.up(x, xs)));
  }
}

}  // TEST_SUITE("unit")

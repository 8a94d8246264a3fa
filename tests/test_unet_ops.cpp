// U-Net backend ops: bilinear x2 upsampling (fwd vs a naive PyTorch-formula reference and
// hand values, bwd by finite differences and adjointness), channel concat/split, softmax
// soft-Dice (loss vs a naive double reference, dlogits by finite differences); CPU
// determinism; CUDA vs CPU parity in every dtype (gpu suite, skipped visibly without a device).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "backend/cpu/cpu_backend.h"
#ifdef DTRAIN_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif
#include "core/rng.h"
#include "gpu_skip.h"
#include "gradcheck.h"
#include "op_harness.h"

using namespace dtrain;
using testing::dot;
using testing::HostDev;
using testing::HostVec;
using testing::random_vec;

namespace {

// Naive bilinear x2, align_corners=False, in double.
HostVec ref_up2x(const HostVec& x, int N, int H, int W, int C) {
  auto src = [](int o, int n, int& i0, int& i1, double& l1) {
    double s = std::max(0.0, (o + 0.5) / 2.0 - 0.5);
    i0 = std::min(int(std::floor(s)), n - 1);
    i1 = std::min(i0 + 1, n - 1);
    l1 = s - i0;
  };
  HostVec y(size_t(N) * 4 * H * W * C);
  for (int n = 0; n < N; ++n)
    for (int oh = 0; oh < 2 * H; ++oh)
      for (int ow = 0; ow < 2 * W; ++ow)
        for (int c = 0; c < C; ++c) {
          int h0, h1, w0, w1;
          double lh, lw;
          src(oh, H, h0, h1, lh);
          src(ow, W, w0, w1, lw);
          auto at = [&](int h, int w) { return double(x[((size_t(n) * H + h) * W + w) * C + c]); };
          double v = (1 - lh) * ((1 - lw) * at(h0, w0) + lw * at(h0, w1)) +
                     lh * ((1 - lw) * at(h1, w0) + lw * at(h1, w1));
          y[((size_t(n) * 2 * H + oh) * 2 * W + ow) * C + c] = float(v);
        }
  return y;
}

// Naive soft Dice loss (double).
double ref_dice(const HostVec& x, const std::vector<int32_t>& y, int64_t P, int K, double smooth) {
  std::vector<double> sp(static_cast<size_t>(K)), I(static_cast<size_t>(K)), st(static_cast<size_t>(K));
  for (int64_t i = 0; i < P; ++i) {
    double m = -1e300, s = 0;
    for (int k = 0; k < K; ++k) m = std::max(m, double(x[size_t(i * K + k)]));
    for (int k = 0; k < K; ++k) s += std::exp(double(x[size_t(i * K + k)]) - m);
    for (int k = 0; k < K; ++k) {
      double p = std::exp(double(x[size_t(i * K + k)]) - m) / s;
      sp[k] += p;
      if (y[size_t(i)] == k) I[k] += p, st[k] += 1;
    }
  }
  double d = 0;
  for (int k = 0; k < K; ++k) d += (2 * I[k] + smooth) / (sp[k] + st[k] + smooth);
  return 1 - d / K;
}

std::vector<int32_t> random_labels(size_t n, int K, uint64_t seed) {
  Rng r(seed, 0);
  std::vector<int32_t> v(n);
  for (auto& e : v) e = int32_t(r.below(uint64_t(K)));
  return v;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("upsample_bilinear2x: hand values and naive reference") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  // PyTorch: F.interpolate([[1,2],[3,4]], scale_factor=2, mode='bilinear')
  Tensor x = d.up({1, 2, 3, 4}, {1, 2, 2, 1}), y = d.zeros({1, 4, 4, 1});
  cpu.upsample_bilinear2x_fwd(x, y);
  HostVec want = {1, 1.25, 1.75, 2, 1.5, 1.75, 2.25, 2.5, 2.5, 2.75, 3.25, 3.5, 3, 3.25, 3.75, 4};
  CHECK(d.down(y) == want);
  for (auto [N, H, W, C] : {std::array<int, 4>{2, 3, 5, 3}, {1, 1, 1, 2}, {1, 4, 1, 5}}) {
    HostVec xv = random_vec(size_t(N * H * W * C), 7);
    Tensor tx = d.up(xv, {N, H, W, C}), ty = d.zeros({N, 2 * H, 2 * W, C});
    cpu.upsample_bilinear2x_fwd(tx, ty);
    EXPECT_CLOSE(d.down(ty), ref_up2x(xv, N, H, W, C), 1e-6);
  }
}

TEST_CASE("upsample_bilinear2x: backward is the adjoint and matches finite differences") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  const int N = 2, H = 3, W = 4, C = 2;
  HostVec x = random_vec(size_t(N * H * W * C), 1), r = random_vec(size_t(N * 4 * H * W * C), 2);
  Tensor tx = d.up(x, {N, H, W, C}), ty = d.zeros({N, 2 * H, 2 * W, C});
  Tensor tr = d.up(r, {N, 2 * H, 2 * W, C}), tdx = d.zeros({N, H, W, C});
  cpu.upsample_bilinear2x_bwd(tr, tdx);
  HostVec dx = d.down(tdx);
  auto loss = [&] {
    d.set(tx, x);
    cpu.upsample_bilinear2x_fwd(tx, ty);
    return dot(d.down(ty), r);
  };
  auto res = testing::check_gradient(loss, x, dx);
  CHECK_MESSAGE(res.ok, res.summary());
  CHECK(std::abs(loss() - dot(x, dx)) < 1e-4);
  // bit-identical with another thread count
  CpuBackend cpu1(1);
  HostDev d1(cpu1);
  Tensor tdx1 = d1.zeros({N, H, W, C});
  cpu1.upsample_bilinear2x_bwd(d1.up(r, {N, 2 * H, 2 * W, C}), tdx1);
  CHECK(testing::bit_equal(d1.down(tdx1), dx));
}

TEST_CASE("concat_channels / split_channels") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  HostVec a = random_vec(2 * 3 * 3 * 2, 1), b = random_vec(2 * 3 * 3 * 5, 2);
  Tensor ta = d.up(a, {2, 3, 3, 2}), tb = d.up(b, {2, 3, 3, 5}), ty = d.zeros({2, 3, 3, 7});
  cpu.concat_channels(ta, tb, ty);
  HostVec y = d.down(ty);
  for (int p = 0; p < 18; ++p)
    for (int c = 0; c < 7; ++c)
      REQUIRE(y[size_t(p * 7 + c)] == (c < 2 ? a[size_t(p * 2 + c)] : b[size_t(p * 5 + c - 2)]));
  Tensor da = d.zeros({2, 3, 3, 2}), db = d.zeros({2, 3, 3, 5}), none;
  cpu.split_channels(ty, da, db);
  CHECK(d.down(da) == a);
  CHECK(d.down(db) == b);
  Tensor db2 = d.zeros({2, 3, 3, 5});
  cpu.split_channels(ty, none, db2);
  CHECK(d.down(db2) == b);
  Tensor bad = d.zeros({2, 3, 3, 6});
  CHECK_THROWS(cpu.concat_channels(ta, tb, bad));
}

TEST_CASE("softmax_dice: loss vs naive reference / dlogits vs finite differences") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  const int N = 2, H = 3, W = 5, K = 4;
  const int64_t P = N * H * W;
  HostVec x = random_vec(size_t(P * K), 3, -2.f, 2.f);
  auto y = random_labels(size_t(P), K, 4);
  Tensor tx = d.up(x, {N, H, W, K}), tdx = d.zeros({N, H, W, K}), none;
  Tensor ty = d.empty(DType::I32, {N, H, W});
  cpu.copy_from_host(ty.data, y.data(), y.size() * 4);
  float loss = -1;
  loss = testing::softmax_dice_host(cpu, tx, ty, 1.f, 1.f, tdx);
  CHECK(std::abs(loss - ref_dice(x, y, P, K, 1.0)) < 1e-6);
  CHECK(loss > 0.f);
  HostVec dx = d.down(tdx);
  auto f = [&] {
    d.set(tx, x);
    return double(testing::softmax_dice_host(cpu, tx, ty, 1.f, 1.f, none));
  };
  testing::GradCheckOptions o;
  o.eps = 1e-2;
  o.threshold = 2e-2;
  auto r = testing::check_gradient(f, x, dx, o);
  CHECK_MESSAGE(r.ok, r.summary());
  // grad_scale scales dlogits
  Tensor tdx2 = d.zeros({N, H, W, K});
  d.set(tx, x);  // the gradient check left its last perturbation on the device
  cpu.softmax_dice(tx, ty, 1.f, 0.5f, none, tdx2);
  HostVec dx2 = d.down(tdx2);
  float mx = 0;
  for (float v : dx) mx = std::max(mx, std::abs(v));
  for (size_t i = 0; i < dx.size(); ++i) REQUIRE(std::abs(dx2[i] - 0.5f * dx[i]) <= 1e-6f * mx);
  // perfect prediction -> loss near 0; bad label -> fault
  HostVec xp(size_t(P * K), -20.f);
  for (int64_t i = 0; i < P; ++i) xp[size_t(i * K + y[size_t(i)])] = 20.f;
  d.set(tx, xp);
  loss = testing::softmax_dice_host(cpu, tx, ty, 1.f, 1.f, none);
  CHECK(loss < 1e-5f);
  y[3] = K;
  cpu.copy_from_host(ty.data, y.data(), y.size() * 4);
  CHECK_THROWS_AS(testing::softmax_dice_host(cpu, tx, ty, 1.f, 1.f, none), RuntimeFault);
}

TEST_CASE("U-Net ops emulate bf16/f16 on the CPU") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  for (DType t : {DType::BF16, DType::F16}) {
    HostVec xv = {1, 2, 3, 4};
    Tensor x32 = d.up(xv, {1, 2, 2, 1}), x = d.empty(t, {1, 2, 2, 1}), y = d.empty(t, {1, 4, 4, 1});
    cpu.cast(x32, x);
    cpu.upsample_bilinear2x_fwd(x, y);
    Tensor y32 = d.zeros({1, 4, 4, 1});
    cpu.cast(y, y32);
    CHECK(d.down(y32)[1] == 1.25f);
  }
}

}  // TEST_SUITE("unit")

// ---------------------------------------------------------------- CUDA parity
namespace {
double tol(DType t) { return t == DType::F32 ? 1e-5 : t == DType::BF16 ? 1e-2 : 2e-3; }
}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("U-Net ops: CUDA vs CPU parity") {
  GPU_OR_SKIP();
  auto gpu = make_backend("cuda");
  CpuBackend cpu(2);
  HostDev dc(cpu), dg(*gpu);
  // Channel counts pick the concat/split copy unit (16 bytes down to 2: 16+8, 6+2, 3+1
  // channels) and K the Dice kernels' register width (<= 4, <= 16, <= 64); the last case
  // has over a million pixels (the Dice grid-stride loops go round; no upsampling there).
  struct Case { int N, H, W, C, Cb, K; };
  const Case cases[] = {{2, 7, 9, 5, 2, 3},  {1, 5, 6, 16, 8, 2},     {1, 3, 5, 6, 2, 7},
                        {2, 4, 4, 3, 1, 20}, {4, 512, 640, 8, 8, 2}};
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    for (const Case& cs : cases) {
      CAPTURE(dtype_name(t));
      const int N = cs.N, H = cs.H, W = cs.W, C = cs.C, Cb = cs.Cb, K = cs.K;
      CAPTURE(N);
      CAPTURE(H);
      CAPTURE(W);
      CAPTURE(C);
      CAPTURE(Cb);
      CAPTURE(K);
      HostVec x = testing::rounded(random_vec(size_t(N * H * W * C), 1), t);
      Shape xs{N, H, W, C}, ys{N, 2 * H, 2 * W, C};
      if (int64_t(N) * H * W <= 4096) {
        // upsample fwd / bwd
        HostVec r = testing::rounded(random_vec(size_t(N * 4 * H * W * C), 2), t);
        Tensor cy = dc.zeros(ys), gy = dg.empty(t, ys);
        cpu.upsample_bilinear2x_fwd(dc.up(x, xs), cy);
        gpu->upsample_bilinear2x_fwd(dg.up(x, t, xs), gy);
        EXPECT_CLOSE(dg.down(gy), dc.down(cy), tol(t));
        Tensor cdx = dc.zeros(xs), gdx = dg.empty(t, xs);
        cpu.upsample_bilinear2x_bwd(dc.up(r, ys), cdx);
        gpu->upsample_bilinear2x_bwd(dg.up(r, t, ys), gdx);
        EXPECT_CLOSE(dg.down(gdx), dc.down(cdx), tol(t));
      }
      // concat / split (exact), and concat against the host-built result
      HostVec xb = testing::rounded(random_vec(size_t(N * H * W * Cb), 3), t);
      Tensor ga = dg.up(x, t, xs), gb = dg.up(xb, t, {N, H, W, Cb});
      Tensor gc = dg.empty(t, {N, H, W, C + Cb}), ga2 = dg.empty(t, xs), gb2 = dg.empty(t, {N, H, W, Cb});
      gpu->concat_channels(ga, gb, gc);
      HostVec want(size_t(N * H * W * (C + Cb)));
      for (size_t r = 0; r < size_t(N * H * W); ++r) {
        for (int c = 0; c < C; ++c) want[r * size_t(C + Cb) + size_t(c)] = x[r * size_t(C) + size_t(c)];
        for (int c = 0; c < Cb; ++c) want[r * size_t(C + Cb) + size_t(C + c)] = xb[r * size_t(Cb) + size_t(c)];
      }
      CHECK(dg.down(gc) == want);
      gpu->split_channels(gc, ga2, gb2);
      CHECK(dg.down(ga2) == dg.down(ga));
      CHECK(dg.down(gb2) == dg.down(gb));
      // softmax dice
      HostVec lg = testing::rounded(random_vec(size_t(N * H * W * K), 4, -2.f, 2.f), t);
      auto lab = random_labels(size_t(N * H * W), K, 5);
      Shape ls{N, H, W, K};
      Tensor cl = dc.empty(DType::I32, {N, H, W}), gl = dg.empty(DType::I32, {N, H, W});
      cpu.copy_from_host(cl.data, lab.data(), lab.size() * 4);
      gpu->copy_from_host(gl.data, lab.data(), lab.size() * 4);
      Tensor cd = dc.zeros(ls), gd = dg.empty(t, ls);
      const float gs = float(N * H * W) / 16.f;  // dlogits ~1/pixels: keep f16 out of subnormals
      const float lc = testing::softmax_dice_host(cpu, dc.up(lg, ls), cl, 1.f, gs, cd);
      const float lgpu = testing::softmax_dice_host(*gpu, dg.up(lg, t, ls), gl, 1.f, gs, gd);
      CHECK(std::abs(lc - lgpu) < 1e-5);
      EXPECT_CLOSE(dg.down(gd), dc.down(cd), tol(t) * 10);
    }
}

// The decoder's convolution over cat(a, b) (Op::Conv2dCat): CUDA convolves a and b with the
// filter's two halves; the CPU reference concatenates and convolves. Forward, the two input
// gradients and the filter gradient accumulated into an f32 master gradient.
TEST_CASE("U-Net ops: CUDA convolution over a concatenation matches concat + convolution on the CPU") {
  GPU_OR_SKIP();
  auto gpu = make_backend("cuda");
  CpuBackend cpu(2);
  HostDev dc(cpu), dg(*gpu);
  CHECK_FALSE(cpu.supports(Op::Conv2dCat, DType::F32));
  struct Case { int N, H, W, Ca, Cb, O, k; };
  const Case cases[] = {{2, 16, 16, 32, 32, 32, 3}, {1, 9, 7, 8, 16, 24, 3}, {2, 8, 8, 16, 16, 8, 1}};
#ifdef DTRAIN_WITH_CUDA
  // the second pass times cuDNN's algorithms (run.cudnn_benchmark) for each half
  for (bool bench : {false, true}) {
    dynamic_cast<CudaBackend&>(*gpu).set_cudnn_benchmark(bench);
    CAPTURE(bench);
#endif
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    for (const Case& c : cases) {
      CAPTURE(dtype_name(t));
      CAPTURE(c.Ca);
      CAPTURE(c.Cb);
      CAPTURE(c.k);
      REQUIRE(gpu->supports(Op::Conv2dCat, t));
      Conv2dParams p;
      p.pad_h = p.pad_w = c.k / 2;
      const Shape as{c.N, c.H, c.W, c.Ca}, bs{c.N, c.H, c.W, c.Cb}, xs{c.N, c.H, c.W, c.Ca + c.Cb};
      const Shape ws{c.O, c.k, c.k, c.Ca + c.Cb}, ys{c.N, c.H, c.W, c.O};
      const HostVec a = testing::rounded(random_vec(size_t(as.numel()), 11), t);
      const HostVec b = testing::rounded(random_vec(size_t(bs.numel()), 12), t);
      const HostVec w = testing::rounded(random_vec(size_t(ws.numel()), 13, -0.2f, 0.2f), t);
      const HostVec dy = testing::rounded(random_vec(size_t(ys.numel()), 14), t);
      const HostVec dw0 = random_vec(size_t(ws.numel()), 15);
      // CPU: concatenate, then the plain ops
      Tensor cx = dc.zeros(xs), cy = dc.zeros(ys), cdx = dc.zeros(xs), cda = dc.zeros(as), cdb = dc.zeros(bs);
      cpu.concat_channels(dc.up(a, t, as), dc.up(b, t, bs), cx);
      Tensor cw = dc.up(w, t, ws), cdw = dc.up(dw0, DType::F32, ws), none;
      cpu.conv2d_fwd(cx, cw, none, cy, p);
      cpu.conv2d_bwd_data(dc.up(dy, t, ys), cw, cdx, p, false);
      cpu.split_channels(cdx, cda, cdb);
      cpu.conv2d_bwd_filter(cx, dc.up(dy, t, ys), cdw, none, p, true);
      // CUDA: never concatenated
      Tensor ga = dg.up(a, t, as), gb = dg.up(b, t, bs), gw = dg.up(w, t, ws), gdy = dg.up(dy, t, ys);
      Tensor gy = dg.empty(t, ys), gda = dg.empty(t, as), gdb = dg.empty(t, bs), gdw = dg.up(dw0, DType::F32, ws);
      gpu->conv2d_fwd_cat(ga, gb, gw, gy, p);
      gpu->conv2d_bwd_data_cat(gdy, gw, gda, gdb, p);
      gpu->conv2d_bwd_filter_cat(ga, gb, gdy, gdw, p, true);
      EXPECT_CLOSE(dg.down(gy), dc.down(cy), tol(t) * 2);
      EXPECT_CLOSE(dg.down(gda), dc.down(cda), tol(t) * 2);
      EXPECT_CLOSE(dg.down(gdb), dc.down(cdb), tol(t) * 2);
      // f32 master gradient; CUDA rounds a 16-bit filter gradient to t before widening it
      EXPECT_CLOSE(dg.down(gdw), dc.down(cdw), t == DType::F32 ? 1e-4 : tol(t) * 2);
    }
#ifdef DTRAIN_WITH_CUDA
  }
#endif
}

}  // TEST_SUITE("gpu")

// CpuBackend op semantics outside the parity table (tests/backend/parity/): supports() and the errors
// ops give for bad arguments, hand-computed values (PyTorch's formulas by hand, bilinear
// upsampling of a 2x2 image), max pooling's tie and NaN rules, and the gradient checker itself.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "core/buffer.h"
#include "gradcheck.h"
#include "op_harness.h"

using namespace dtrain;
using testing::bit_equal;
using testing::HostDev;
using testing::HostVec;

TEST_SUITE("unit") {

TEST_CASE("cpu: supports() is truthful and unsupported dtypes throw naming op and dtype") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  CHECK(d.be.supports(Op::Conv2dFwd, DType::F32));
  CHECK(d.be.supports(Op::Cast, DType::BF16));
  CHECK(d.be.supports(Op::Cast, DType::F16));
  CHECK_FALSE(d.be.supports(Op::AdamWStep, DType::BF16));
  CHECK_FALSE(d.be.supports(Op::Gemm, DType::I32));
  CHECK_FALSE(d.be.supports(Op::Conv2dCat, DType::F32));  // callers concatenate on the CPU
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

TEST_CASE("cpu: bad shapes - labels - ids are errors naming the op or the value") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  Conv2dParams p;
  p.pad_h = p.pad_w = 1;
  Tensor x = d.zeros({1, 5, 5, 3}), w = d.zeros({4, 3, 3, 2}), y = d.zeros({1, 5, 5, 4});
  CHECK_THROWS_WITH_AS(cpu.conv2d_fwd(x, w, Tensor(), y, p), doctest::Contains("conv2d_fwd"), RuntimeFault);
  // batch norm over one value per channel has no variance
  Tensor one = d.zeros({1, 1, 1, 6}), c6 = d.zeros({6}), rm = d.zeros({6}), rv = d.zeros({6});
  Tensor sm = d.zeros({6}), si = d.zeros({6});
  CHECK_THROWS_AS(cpu.batchnorm_fwd_train(one, c6, c6, one, rm, rv, sm, si, 0.1f, 1e-5f), UserError);
  Tensor tz = d.zeros({2, 3}), tl = d.zeros({2}), none;
  CHECK_THROWS_AS(cpu.softmax_xent(tz, d.labels({0, 3}), 0.f, 1.f, tl, none), UserError);
  Tensor ids = d.labels({0, 1, 2, 21}).view({1, 4}), wte = d.zeros({21, 4}), wpe = d.zeros({4, 4}), ey = d.zeros({1, 4, 4});
  CHECK_THROWS_WITH_AS(cpu.embedding_fwd(ids, wte, wpe, ey), doctest::Contains("token id 21"), UserError);
  Tensor a = d.zeros({2, 3, 3, 2}), bb = d.zeros({2, 3, 3, 5}), bad = d.zeros({2, 3, 3, 6});
  CHECK_THROWS(cpu.concat_channels(a, bb, bad));
  Tensor lg = d.zeros({1, 2, 2, 3}), lab = d.labels({0, 1, 2, 3}).view({1, 2, 2});
  CHECK_THROWS_AS(testing::softmax_dice_host(cpu, lg, lab, 1.f, 1.f, none), RuntimeFault);
}

TEST_CASE("cpu: max pooling's rules - the first max of a window wins ties - NaN wins - padding never does") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  // ties: the gradient goes to the first max of the window only (PyTorch)
  Pool2dParams p2{2, 2, 2, 2, 0, 0};
  Tensor ones = d.up(HostVec(16, 1.f), {1, 4, 4, 1}), py = d.zeros({1, 2, 2, 1}), pdx = d.zeros({1, 4, 4, 1});
  Tensor pam = d.empty(DType::U8, {1, 2, 2, 1});
  cpu.maxpool2d_fwd(ones, py, pam, p2);
  cpu.maxpool2d_bwd(pam, d.up(HostVec{1, 2, 3, 4}, {1, 2, 2, 1}), pdx, p2, false);
  CHECK(bit_equal(d.down(pdx), HostVec{1, 0, 2, 0, 0, 0, 0, 0, 3, 0, 4, 0, 0, 0, 0, 0}));
  // NaN wins, and of two NaNs the last in scan order (PyTorch's rule); padding never wins
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Pool2dParams p3{3, 3, 1, 1, 1, 1};
  Tensor nx = d.up(HostVec{-5, nan, 2, nan}, {1, 2, 2, 1}), ny = d.zeros({1, 2, 2, 1});
  Tensor nam = d.empty(DType::U8, {1, 2, 2, 1}), ndx = d.zeros({1, 2, 2, 1});
  cpu.maxpool2d_fwd(nx, ny, nam, p3);
  for (float v : d.down(ny)) CHECK(std::isnan(v));
  cpu.maxpool2d_bwd(nam, d.up(HostVec{1, 2, 4, 8}, {1, 2, 2, 1}), ndx, p3, false);
  CHECK(bit_equal(d.down(ndx), HostVec{0, 0, 0, 15}));
  Tensor mx = d.up(HostVec{-7, -9, -8, -6}, {1, 2, 2, 1});  // all negative: the padded -inf never wins
  cpu.maxpool2d_fwd(mx, ny, nam, p3);
  CHECK(bit_equal(d.down(ny), HostVec{-6, -6, -6, -6}));
}

TEST_CASE("cpu: sgd and adamw steps by hand (PyTorch's formulas)") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  // p=1, g=0.5, lr=0.1, momentum 0.9, wd 0.01
  //   step 1: d = 0.5 + 0.01 = 0.51, buf = 0.51, p = 0.949
  //   step 2: d = 0.5 + 0.00949 = 0.50949, buf = 0.9*0.51 + 0.50949 = 0.96849, p = 0.852151
  Tensor p = d.up({1.f}, {1}), g = d.up({0.5f}, {1}), m = d.zeros({1});
  SgdArgs a;
  a.lr = 0.1f, a.momentum = 0.9f, a.weight_decay = 0.01f, a.first_step = true;
  cpu.sgd_step(p, g, m, {{0, 1, true}}, a);
  CHECK(d.down(p)[0] == doctest::Approx(0.949).epsilon(1e-6));
  a.first_step = false;
  cpu.sgd_step(p, g, m, {{0, 1, true}}, a);
  CHECK(d.down(p)[0] == doctest::Approx(0.852151).epsilon(1e-6));
  CHECK(d.down(m)[0] == doctest::Approx(0.96849).epsilon(1e-6));
  // AdamW step 1: p=1, g=0.5, lr=0.1, wd=0.01: p*=0.999; m=0.05; v=0.00025;
  // step_size = 0.1/0.1 = 1; denom = sqrt(0.00025)/sqrt(0.001) + 1e-8 = 0.5; p = 0.999 - 0.1
  Tensor q = d.up({1.f}, {1}), mm = d.zeros({1}), v = d.zeros({1});
  AdamWArgs w;
  w.lr = 0.1f, w.weight_decay = 0.01f, w.step = 1;
  cpu.adamw_step(q, g, mm, v, {{0, 1, true}}, w);
  CHECK(d.down(q)[0] == doctest::Approx(0.899).epsilon(1e-6));
  CHECK(d.down(mm)[0] == doctest::Approx(0.05).epsilon(1e-6));
  CHECK(d.down(v)[0] == doctest::Approx(0.00025).epsilon(1e-6));
}

TEST_CASE("cpu: bilinear x2 upsampling of a 2x2 image by hand (PyTorch) in f32 and 16 bits") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  // F.interpolate([[1,2],[3,4]], scale_factor=2, mode='bilinear')
  const HostVec want = {1, 1.25, 1.75, 2, 1.5, 1.75, 2.25, 2.5, 2.5, 2.75, 3.25, 3.5, 3, 3.25, 3.75, 4};
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(t));
    Tensor x = d.up({1, 2, 3, 4}, t, {1, 2, 2, 1}), y = d.empty(t, {1, 4, 4, 1});
    cpu.upsample_bilinear2x_fwd(x, y);
    CHECK(d.down(y) == want);  // every value is exact in 16 bits
  }
}

TEST_CASE("cpu: soft Dice of a perfect prediction is 0") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  const int64_t P = 30, K = 4;
  std::vector<int32_t> y(P);
  HostVec xp(size_t(P * K), -20.f);
  for (int64_t i = 0; i < P; ++i) y[size_t(i)] = int32_t(i % K), xp[size_t(i * K + i % K)] = 20.f;
  Tensor none;
  CHECK(testing::softmax_dice_host(cpu, d.up(xp, {2, 3, 5, K}), d.labels(y).view({2, 3, 5}), 1.f, 1.f, none) < 1e-5f);
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

}  // TEST_SUITE("unit")

TEST_SUITE("unit") {

// GELU's tanh is dtrain's own (vectorised, no libm call): over 200,001 points from -12 to 12
// (the tiny, the cancelling and the saturated ranges) its forward and backward stay within a
// few f32 ulp of the formula in double (ulp of the terms it sums: 1 + tanh cancels for x << 0,
// in f32 as in PyTorch), and exact zeros and signs hold.
TEST_CASE("cpu: GELU forward and backward match the tanh formula in double within a few ulp") {
  CpuBackend cpu(2);
  HostDev d(cpu);
  HostVec xs;
  for (int i = -100000; i <= 100000; ++i) xs.push_back(float(i) * 1.2e-4f);
  for (float v : {1e-30f, -1e-30f, 1e-7f, -3e-5f, 9.f, -9.f, 40.f, -40.f}) xs.push_back(v);
  const Shape s{int64_t(xs.size())};
  Tensor x = d.up(xs, s), dy = d.up(HostVec(xs.size(), 1.f), s), y = d.zeros(s), dx = d.zeros(s);
  cpu.gelu_fwd(x, y);
  cpu.gelu_bwd(x, dy, dx);
  const HostVec hy = d.down(y), hdx = d.down(dx);
  const double c = std::sqrt(2.0 / M_PI);
  double worst_y = 0, worst_dx = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i], u = c * (v + 0.044715 * v * v * v), t = std::tanh(u);
    const double ry = 0.5 * v * (1 + t);
    const double rdx = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * c * (1 + 3 * 0.044715 * v * v);
    // error in units of the f32 spacing at the larger of the value and the terms it sums
    auto ulps = [](double got, double want, double scale) {
      const float f = float(std::max(std::fabs(want), scale));
      return std::fabs(got - want) / double(std::nextafter(f, INFINITY) - f);
    };
    worst_y = std::max(worst_y, ulps(hy[i], ry, 0.5 * std::fabs(v)));  // 0.5 v (1 + t): 1 + t cancels
    worst_dx = std::max(worst_dx, ulps(hdx[i], rdx, std::max(0.5, std::fabs(rdx - 0.5 * (1 + t)))));
  }
  CHECK(worst_y <= 4);    // std::tanh in the same formula: 2.1 ulp
  CHECK(worst_dx <= 12);  // std::tanh: 9.2 ulp (1 - t^2 amplifies tanh's rounding by x)
  MESSAGE("GELU worst error: forward " << worst_y << " ulp, backward " << worst_dx << " ulp");
  CHECK(hy[100000] == 0.f);            // x = 0
  CHECK(hdx[100000] == 0.5f);
  CHECK(hy[xs.size() - 4] == 9.f);     // saturated: x * 1
  CHECK(hy[xs.size() - 2] == 40.f);
  CHECK(hy[xs.size() - 1] == 0.f);     // -40: x * 0 (tanh = -1 exactly)
  CHECK(hy[xs.size() - 8] > 0.f);  // 1e-30 * (1 + tanh(tiny)) / 2 > 0
}

}  // TEST_SUITE

// CUDA throughput of the main kernels (numbers for the log; the checks are on the timed outputs)
// and out-of-memory handling. Op parity is the parity table's (tests/backend/parity/, test_parity.cpp).
// Without a CUDA device every case is skipped.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"
#include "core/error.h"
#include "core/rng.h"
#include "skip.h"

using namespace dtrain;

namespace {

const DType kDtypes[] = {DType::F32, DType::BF16, DType::F16};

struct Backends {
  std::unique_ptr<Backend> gpu = make_backend("cuda");
};

void upload_gpu(Backend& gpu, const Tensor& t, const std::vector<float>& v) {
  std::vector<uint16_t> h16(v.size());
  if (t.dtype == DType::F32) {
    gpu.copy_from_host(t.data, v.data(), v.size() * 4);
    return;
  }
  for (size_t i = 0; i < v.size(); ++i)
    h16[i] = t.dtype == DType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
  gpu.copy_from_host(t.data, h16.data(), h16.size() * 2);
}

// Milliseconds per call of fn on be: one warm-up call, then iters calls between two syncs.
template <typename F>
double mean_ms(Backend& be, int iters, F&& fn) {
  fn();
  be.synchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) fn();
  be.synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("gpu: out of memory is a clear RuntimeFault and the backend works after it") {
  GPU_OR_SKIP();
  Backends b;
  try {
    (void)b.gpu->alloc(size_t(1) << 50);  // 1 PiB
    FAIL("alloc of 1 PiB did not throw");
  } catch (const RuntimeFault& e) {
    std::string m = e.what();
    CHECK(m.find("out of memory") != std::string::npos);
    CHECK(m.find("train.batch_size") != std::string::npos);
    CHECK(m.find("precision.dtype") != std::string::npos);
  }
  void* p = b.gpu->alloc(1000);  // the backend still works after the failure
  b.gpu->free(p);
  Buffer buf(*b.gpu, 4096 * 4);
  Tensor x = buf.tensor(DType::F32, {4096});
  b.gpu->fill(x, 0.5f);
  CHECK(b.gpu->all_finite(x));
}

// Throughput report (numbers for the log; the checks are on the timed outputs).
TEST_CASE("gpu: throughput of gemm / conv / batchnorm / adamw") {
  GPU_OR_SKIP();
  Backends b;
  Backend& g = *b.gpu;
  auto time_ms = [&](int iters, auto&& fn) { return mean_ms(g, iters, fn); };
  auto finite_nonzero = [&](const Tensor& t) {
    CHECK(g.all_finite(t));
    CHECK(g.sum_squares(t) > 0);
  };
  for (DType dt : kDtypes) {
    const int64_t n = 4096;
    Buffer ba(g, n * n * 2 * 2), bb(g, n * n * 4), bc(g, n * n * 4);
    Tensor a = ba.tensor(dt, {n, n}), w = bb.tensor(dt, {n, n}), c = bc.tensor(dt, {n, n});
    g.fill(a, 0.01f);
    g.fill(w, 0.02f);
    double ms = time_ms(5, [&] { g.gemm(false, true, 1.f, a, w, 0.f, c); });
    MESSAGE("gemm 4096^3 ", std::string(dtype_name(dt)), ": ", ms, " ms, ", 2.0 * n * n * n / ms / 1e9, " TFLOP/s");
    finite_nonzero(c);
  }
  for (DType dt : kDtypes) {  // ResNet-50 stage-1 3x3 conv, batch 64
    const int64_t N = 64, H = 56, C = 64;
    Buffer bx(g, N * H * H * C * 4), bw(g, C * 9 * C * 4), by(g, N * H * H * C * 4);
    Tensor x = bx.tensor(dt, {N, H, H, C}), w = bw.tensor(dt, {C, 3, 3, C}), y = by.tensor(dt, {N, H, H, C});
    g.fill(x, 0.01f);  // small enough that f16 dw (a sum over 200k products) stays finite
    g.fill(w, 0.001f);
    Conv2dParams p{1, 1, 1, 1, 1, 1};
    Tensor none;
    double flop = 2.0 * N * H * H * C * C * 9;
    double f = time_ms(10, [&] { g.conv2d_fwd(x, w, none, y, p); });
    double d = time_ms(10, [&] { g.conv2d_bwd_data(y, w, x, p, false); });
    double wg = time_ms(10, [&] { g.conv2d_bwd_filter(x, y, w, none, p, false); });
    MESSAGE("conv3x3 64ch 64x56x56 ", std::string(dtype_name(dt)), ": fwd ", flop / f / 1e9,
            " bwd_data ", flop / d / 1e9, " bwd_filter ", flop / wg / 1e9, " TFLOP/s");
    finite_nonzero(w);
    Buffer bs(g, 6 * C * 4);
    Tensor st[6];
    for (int i = 0; i < 6; ++i) st[i] = bs.tensor(DType::F32, {C}, size_t(i) * C * 4);
    g.fill(st[0], 1.f);
    g.fill(st[1], 0.f);
    double bn = time_ms(10, [&] { g.batchnorm_fwd_train(x, st[0], st[1], y, st[2], st[3], st[4], st[5], 0.1f, 1e-5f); });
    MESSAGE("batchnorm_fwd_train 64x56x56x64 ", std::string(dtype_name(dt)), ": ", bn, " ms, ",
            3.0 * x.nbytes() / bn / 1e6, " GB/s (2 reads + 1 write)");
  }
  const int64_t P = 124'000'000;
  Buffer bp(g, P * 4), bg(g, P * 4), bm(g, P * 4), bv(g, P * 4);
  Tensor p = bp.tensor(DType::F32, {P}), gr = bg.tensor(DType::F32, {P}), m = bm.tensor(DType::F32, {P}), v = bv.tensor(DType::F32, {P});
  g.fill(p, 1.f); g.fill(gr, 0.5f); g.fill(m, 0.f); g.fill(v, 0.f);
  std::vector<ParamSegment> segs = {{0, P / 2, true}, {P / 2, P - P / 2, false}};
  AdamWArgs args;
  double ms = time_ms(5, [&] { g.adamw_step(p, gr, m, v, segs, args); });
  MESSAGE("adamw 124M params: ", ms, " ms, ", 7.0 * P * 4 / ms / 1e6, " GB/s");
  finite_nonzero(p);
}

// Memory-bound CNN kernels at ResNet-50 / U-Net sizes: ms per call and GB/s counting the
// minimum traffic (each input read once, each output written once) against ~3000 GB/s.
TEST_CASE("gpu: throughput of the memory-bound CNN kernels") {
  GPU_OR_SKIP();
  Backends b;
  Backend& g = *b.gpu;
  auto time_ms = [&](int iters, auto&& fn) { return mean_ms(g, iters, fn); };
  auto gbs = [](double bytes, double ms) { return bytes / ms / 1e6; };
  Rng rng(13, 1);
  for (DType dt : kDtypes) {
    const std::string dn(dtype_name(dt));
    const int64_t N = 64, H = 56, C = 64, n = N * H * H * C;
    const double nb = double(n) * double(dtype_size(dt));
    std::vector<float> hx(static_cast<size_t>(n)), hd(static_cast<size_t>(n));
    for (auto& v : hx) v = rng.uniform() * 4.f - 2.f;
    for (auto& v : hd) v = rng.uniform() - 0.5f;
    Buffer b1(g, size_t(nb)), b2(g, size_t(nb)), b3(g, size_t(nb));
    Tensor x = b1.tensor(dt, {N, H, H, C}), d = b2.tensor(dt, {N, H, H, C}), z = b3.tensor(dt, {N, H, H, C});
    upload_gpu(g, x, hx);
    upload_gpu(g, d, hd);
    double add = time_ms(20, [&] { g.add(x, d, z); });
    double rf = time_ms(20, [&] { g.relu_fwd(x, z); });
    double rb = time_ms(20, [&] { g.relu_bwd(x, d, z); });
    MESSAGE("64x56x56x64 ", dn, ": add ", add, " ms ", gbs(3 * nb, add), " GB/s, relu_fwd ", rf,
            " ms ", gbs(2 * nb, rf), " GB/s, relu_bwd ", rb, " ms ", gbs(3 * nb, rb), " GB/s");
    Buffer bs(g, 8 * C * 4);
    Tensor st[8];
    for (int i = 0; i < 8; ++i) st[i] = bs.tensor(DType::F32, {C}, size_t(i) * C * 4);
    g.fill(st[0], 1.f);
    g.fill(st[1], 0.f);
    g.fill(st[2], 0.f);
    g.fill(st[3], 1.f);
    double bf = time_ms(20, [&] { g.batchnorm_fwd_train(x, st[0], st[1], z, st[2], st[3], st[4], st[5], 0.1f, 1e-5f); });
    double bw = time_ms(20, [&] { g.batchnorm_bwd(d, x, st[0], st[4], st[5], z, st[6], st[7], false); });
    double be = time_ms(20, [&] { g.batchnorm_fwd_eval(x, st[0], st[1], st[2], st[3], z, 1e-5f); });
    MESSAGE("batchnorm 64x56x56x64 ", dn, ": fwd_train ", bf, " ms ", gbs(3 * nb, bf), " GB/s, bwd ", bw,
            " ms ", gbs(5 * nb, bw), " GB/s, fwd_eval ", be, " ms ", gbs(2 * nb, be), " GB/s");
    CHECK(g.all_finite(z));
    // ResNet stem pooling: 3x3 stride 2 pad 1 over [64,56,56,64] -> [64,28,28,64]
    Pool2dParams pp{3, 3, 2, 2, 1, 1};
    Buffer b4(g, size_t(nb / 4)), b5(g, size_t(nb / 4)), b6(g, size_t(N * 28 * 28 * C));
    Tensor py = b4.tensor(dt, {N, 28, 28, C}), pdy = b5.tensor(dt, {N, 28, 28, C});
    Tensor pam = b6.tensor(DType::U8, {N, 28, 28, C});
    g.fill(pdy, 0.5f);
    const double amb = double(pam.numel());  // argmax bytes
    double pf = time_ms(20, [&] { g.maxpool2d_fwd(x, py, pam, pp); });
    double pb = time_ms(20, [&] { g.maxpool2d_bwd(pam, pdy, z, pp, false); });
    MESSAGE("maxpool 3x3/2 64x56x56x64 ", dn, ": fwd ", pf, " ms ", gbs(1.25 * nb + amb, pf),
            " GB/s, bwd ", pb, " ms ", gbs(1.25 * nb + amb, pb), " GB/s");
    CHECK(g.sum_squares(z) > 0);
  }
  for (DType dt : kDtypes) {  // U-Net 256x256 batch 16: 2-class losses and a skip concat
    const std::string dn(dtype_name(dt));
    const int64_t P = 16 * 256 * 256, K = 2, es = int64_t(dtype_size(dt));
    std::vector<float> hl(static_cast<size_t>(P * K));
    for (auto& v : hl) v = rng.uniform() * 4.f - 2.f;
    std::vector<int32_t> lab(static_cast<size_t>(P));
    for (auto& l : lab) l = int32_t(rng.below(2));
    Buffer bl(g, size_t(P * K * es)), bd(g, size_t(P * K * es)), blab(g, size_t(P * 4)), bloss(g, size_t(P * 4));
    Tensor logits = bl.tensor(dt, {16, 256, 256, K}), dl = bd.tensor(dt, {16, 256, 256, K});
    Tensor labels = blab.tensor(DType::I32, {16, 256, 256}), losses = bloss.tensor(DType::F32, {P});
    upload_gpu(g, logits, hl);
    g.copy_from_host(labels.data, lab.data(), lab.size() * 4);
    Tensor flat = logits.view(Shape{P, K}), dflat = dl.view(Shape{P, K}), lflat = labels.view(Shape{P});
    double xe = time_ms(20, [&] { g.softmax_xent(flat, lflat, 0.f, 1.f / float(P), losses, dflat); });
    Buffer bdice(g, sizeof(float));
    Tensor dice_dev = bdice.tensor(DType::F32, {1});
    double di = time_ms(20, [&] { g.softmax_dice(logits, labels, 1.f, 1.f, dice_dev, dl); });
    float dice = 0;
    g.copy_to_host(&dice, dice_dev.data, sizeof dice);
    const double lb = double(P * K * es), ib = double(P * 4);
    MESSAGE("16x256x256x2 ", dn, ": softmax_xent ", xe, " ms ", gbs(2 * lb + 2 * ib, xe),
            " GB/s, softmax_dice ", di, " ms ", gbs(3 * lb + 2 * ib, di), " GB/s");
    CHECK(std::isfinite(dice));
    const int64_t R = 16 * 128 * 128, Ca = 64;
    Buffer ba(g, size_t(R * Ca * es)), bb(g, size_t(R * Ca * es)), by(g, size_t(R * 2 * Ca * es));
    Tensor ta = ba.tensor(dt, {16, 128, 128, Ca}), tb = bb.tensor(dt, {16, 128, 128, Ca});
    Tensor ty = by.tensor(dt, {16, 128, 128, 2 * Ca});
    g.fill(ta, 1.f);
    g.fill(tb, 2.f);
    double cc = time_ms(20, [&] { g.concat_channels(ta, tb, ty); });
    double sp = time_ms(20, [&] { g.split_channels(ty, ta, tb); });
    const double cb = double(R * 2 * Ca * es);
    MESSAGE("concat/split 16x128x128x(64+64) ", dn, ": concat ", cc, " ms ", gbs(2 * cb, cc),
            " GB/s, split ", sp, " ms ", gbs(2 * cb, sp), " GB/s");
    CHECK(g.sum_squares(ty) > 0);
  }
}

}  // TEST_SUITE("gpu")

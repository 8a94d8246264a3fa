// CPU op benchmark on the ResNet-20 / Fashion-MNIST shapes (batch 128, 28x28). Skipped by
// default; run with
//   ./build/dtrain_tests -ts=bench --no-skip
// Compare with scripts/bench/cpu_ops.py (PyTorch, channels_last, same shapes and threads).
// Reports the best of DTRAIN_BENCH_REPS (default 10) runs in milliseconds.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <functional>

#include "backend/cpu/cpu_backend.h"
#include "gradcheck.h"
#include "op_harness.h"

using namespace dtrain;
using testing::HostDev;
using testing::random_vec;

namespace {
double best_ms(const std::function<void()>& f) {
  const char* e = std::getenv("DTRAIN_BENCH_REPS");
  const int reps = e ? std::max(1, std::atoi(e)) : 10;
  f();  // warm-up: primitive creation, scratch growth
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
struct ConvShape {
  const char* name;
  int64_t H, C, O, K;
  int stride;
  int count;  // occurrences in ResNet-20
};
}  // namespace

TEST_SUITE("bench") {
TEST_CASE("bench: cpu conv/bn/relu on ResNet-20 Fashion-MNIST shapes" * doctest::skip()) {
  const int threads = std::getenv("DTRAIN_BENCH_THREADS") ? std::atoi(std::getenv("DTRAIN_BENCH_THREADS")) : 2;
  CpuBackend cpu(threads);
  HostDev d(cpu);
  const int64_t N = 128;
  const ConvShape shapes[] = {
      {"stem 28x28 1->16", 28, 1, 16, 3, 1, 1},     {"28x28 16->16", 28, 16, 16, 3, 1, 6},
      {"28x28 16->32 s2", 28, 16, 32, 3, 2, 1},     {"14x14 32->32", 14, 32, 32, 3, 1, 5},
      {"14x14 32->64 s2", 14, 32, 64, 3, 2, 1},     {"7x7 64->64", 7, 64, 64, 3, 1, 5},
      {"1x1 s2 16->32 (shortcut B)", 28, 16, 32, 1, 2, 0},
  };
  fmt::print("threads {}; best of runs, ms; N={}\n", threads, N);
  fmt::print("{:<28} {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9}\n", "conv", "dnnl fwd", "bwd_data",
             "bwd_filt", "i2c fwd", "bwd_data", "bwd_filt");
  double step[2] = {0, 0};
  for (const auto& s : shapes) {
    Conv2dParams p;
    p.stride_h = p.stride_w = s.stride;
    p.pad_h = p.pad_w = s.K / 2;
    const int64_t OH = (s.H + 2 * p.pad_h - s.K) / s.stride + 1;
    Tensor x = d.up(random_vec(size_t(N * s.H * s.H * s.C), 1), {N, s.H, s.H, s.C});
    Tensor w = d.up(random_vec(size_t(s.O * s.K * s.K * s.C), 2), {s.O, s.K, s.K, s.C});
    Tensor y = d.zeros({N, OH, OH, s.O}), dy = d.up(random_vec(size_t(N * OH * OH * s.O), 3), {N, OH, OH, s.O});
    Tensor dx = d.zeros(x.shape), dw = d.zeros(w.shape), none;
    double t[2][3];
    for (int k = 0; k < 2; ++k) {
      cpu.set_conv_impl(k ? cpu::ConvImpl::Im2col : cpu::ConvImpl::Dnnl);
      t[k][0] = best_ms([&] { cpu.conv2d_fwd(x, w, none, y, p); });
      t[k][1] = best_ms([&] { cpu.conv2d_bwd_data(dy, w, dx, p, false); });
      t[k][2] = best_ms([&] { cpu.conv2d_bwd_filter(x, dy, dw, none, p, false); });
      if (k == 0) fmt::print("  oneDNN: {}\n", cpu.dnnl_impl_info());
      const bool stem = s.C == 1;
      step[k] += s.count * (t[k][0] + (stem ? 0 : t[k][1]) + t[k][2]);
    }
    fmt::print("{:<28} {:9.2f} {:9.2f} {:9.2f} | {:9.2f} {:9.2f} {:9.2f}\n", s.name, t[0][0],
               t[0][1], t[0][2], t[1][0], t[1][1], t[1][2]);
  }
  fmt::print("ResNet-20 conv time per training step: oneDNN {:.1f} ms, im2col {:.1f} ms\n", step[0],
             step[1]);
  // batch norm + relu on the largest activation
  const int64_t M = N * 28 * 28, C = 16;
  Tensor bx = d.up(random_vec(size_t(M * C), 4), {M, C}), by = d.zeros({M, C}), bdx = d.zeros({M, C});
  Tensor g = d.up(random_vec(C, 5), {C}), b = d.zeros({C}), rm = d.zeros({C}), rv = d.zeros({C});
  Tensor sm = d.zeros({C}), si = d.zeros({C}), dg = d.zeros({C}), db = d.zeros({C});
  const double bn_f = best_ms([&] { cpu.batchnorm_fwd_train(bx, g, b, by, rm, rv, sm, si, 0.1f, 1e-5f); });
  const double bn_b = best_ms([&] { cpu.batchnorm_bwd(by, bx, g, sm, si, bdx, dg, db, false); });
  const double re_f = best_ms([&] { cpu.relu_fwd(bx, by); });
  const double re_b = best_ms([&] { cpu.relu_bwd(by, bx, bdx); });
  fmt::print("[{}x{}] batchnorm fwd {:.2f} bwd {:.2f}; relu fwd {:.2f} bwd {:.2f} ms\n", M, C, bn_f,
             bn_b, re_f, re_b);
  CHECK(step[0] > 0);
}
}

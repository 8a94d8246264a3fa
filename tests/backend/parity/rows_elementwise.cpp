// Parity rows: fill, copy, cast, add, axpby, scale, relu, add_bias, sum_rows, sum /
// sum_squares, all_finite. Flat sizes hit the vector kernels' tails (1, 7, 8, 9, primes),
// unaligned pointers (element offsets) and the grid-stride loops (9,000,011: GPU only).
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "harness.h"
#include "ref_ops.h"

namespace dtrain::parity {
namespace {

struct Flat {
  int64_t n, off_x, off_y;
  bool cpu = true;
};
// P2 of the old GPU parity test, the CPU tests' 1001 = 7 x 11 x 13 and a prime
const Flat kFlat[] = {{1, 0, 0},    {7, 0, 0},    {8, 0, 0},    {9, 0, 0},       {1001, 0, 0},
                      {4099, 0, 0}, {4099, 1, 0}, {4099, 0, 3}, {1001, 2, 2},    {100003, 0, 0},
                      {9'000'011, 0, 0, false}};
const Shape kCube{7, 13, 11};  // 1001 elements as a 3-D tensor

std::string tag(const Flat& f) { return fmt::format("n={} off={}/{}", f.n, f.off_x, f.off_y); }

const Opts kExact = ref(Metric::Bits, 0);
Opts exact_everywhere() { return dev(Metric::Max, 0, 0, 0, kExact); }

std::vector<Row> make() {
  std::vector<Row> t;
  auto row = [&](std::string name, std::vector<Op> ops) -> Row& {
    Row r;
    r.family = "elementwise";
    r.name = std::move(name);
    r.ops = std::move(ops);
    r.emul = true;
    r.dev_rerun = true;
    t.push_back(std::move(r));
    return t.back();
  };
  for (const Flat& f : kFlat) {
    const int64_t n = f.n;
    const bool few = n < 1000;  // a few values may all be <= 0 after a ReLU
    {
      Row& r = row("fill " + tag(f), {Op::Fill});
      r.run = [=](Io& io) {
        Opts o = kExact;
        o.offset = f.off_y;
        io.be.fill(io.out("y", {n}, kAct, o), -0.625f);
      };
      r.ref = [=](const Io&, Want& w) { w.put("y", HostVec(size_t(n), -0.625f)); };
      r.cpu = f.cpu;
    }
    {
      Row& r = row("copy " + tag(f), {Op::Copy});
      r.run = [=](Io& io) {
        Tensor y = io.out("y", {n}, kAct, [&] { Opts o = kExact; o.offset = f.off_y; return o; }());
        io.be.copy(io.in("x", {n}, kAct, -1, 1, f.off_x), y);
      };
      r.ref = [](const Io& io, Want& w) { w.put("y", io.h("x")); };
      r.cpu = f.cpu;
    }
    for (DType from : {DType::F32, DType::BF16, DType::F16})
      for (DType to : {DType::F32, DType::BF16, DType::F16}) {
        Row& r = row(fmt::format("cast {}->{} {}", dtype_name(from), dtype_name(to), tag(f)), {Op::Cast});
        r.dtypes = {DType::F32};  // the tensors' dtypes are the row's own
        r.emul = false;
        r.run = [=](Io& io) {
          Opts o = exact_everywhere();
          o.offset = f.off_y;
          Tensor y = io.out("y", {n}, fixed(to), o);
          io.be.cast(io.in("x", {n}, fixed(from), -3, 3, f.off_x), y);
        };
        r.ref = [=](const Io& io, Want& w) { w.put("y", round_to(to, io.h("x"))); };
        r.cpu = f.cpu;
      }
    {
      Row& r = row("add " + tag(f), {Op::Add});
      r.run = [=](Io& io) {
        Opts o = kExact;
        o.offset = f.off_y;
        Tensor x = io.in("x", {n}, kAct, -1, 1, f.off_x), z = io.in("z", {n});
        Tensor y = io.out("y", {n}, kAct, o), ya = io.inout("y_alias", {n}, kAct, -1, 1, o);
        io.be.add(x, z, y);
        io.be.add(x, ya, ya);  // the output may alias an input
      };
      r.ref = [](const Io& io, Want& w) {
        const HostVec &x = io.h("x"), &z = io.h("z"), &ya = io.h("y_alias");
        HostVec y(x.size()), a(x.size());
        for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] + z[i], a[i] = x[i] + ya[i];
        w.put("y", y);
        w.put("y_alias", a);
      };
      r.cpu = f.cpu;
    }
    // (alpha, beta): the CPU tests' (2, -0.5) and (3, 0), the GPU tests' (0.7, -1.3), (-0.5, 0);
    // beta = 0 never reads y (a NaN-filled output stays clean)
    for (auto [alpha, beta] : {std::pair{2.f, -0.5f}, {3.f, 0.f}, {0.7f, -1.3f}, {-0.5f, 0.f}}) {
      Row& r = row(fmt::format("axpby alpha={} beta={} {}", alpha, beta, tag(f)), {Op::Axpby});
      r.run = [=](Io& io) {
        Opts o = kExact;
        o.offset = f.off_y;
        Tensor x = io.in("x", {n}, kAct, -1, 1, f.off_x);
        Tensor y = beta == 0.f ? io.out("y", {n}, kAct, o) : io.inout("y", {n}, kAct, -1, 1, o);
        io.be.axpby(alpha, x, beta, y);
      };
      r.ref = [=](const Io& io, Want& w) {
        const HostVec& x = io.h("x");
        HostVec y(x.size());
        if (beta == 0.f) {
          for (size_t i = 0; i < x.size(); ++i) y[i] = alpha * x[i];
        } else {
          const HostVec& y0 = io.h("y");
          for (size_t i = 0; i < x.size(); ++i) y[i] = alpha * x[i] + beta * y0[i];
        }
        w.put("y", y);
      };
      r.cpu = f.cpu;
    }
    for (float s : {-2.5f, 0.25f}) {
      Row& r = row(fmt::format("scale s={} {}", s, tag(f)), {Op::Scale});
      r.run = [=](Io& io) {
        Opts o = kExact;
        o.offset = f.off_y;
        io.be.scale(io.inout("y", {n}, kAct, -1, 1, o), s);
      };
      r.ref = [=](const Io& io, Want& w) {
        HostVec y = io.h("y");
        for (float& v : y) v *= s;
        w.put("y", y);
      };
      r.cpu = f.cpu;
    }
    {
      Row& r = row("relu fwd / bwd (dx aliasing dy) " + tag(f), {Op::ReluFwd, Op::ReluBwd});
      r.run = [=](Io& io) {
        Opts o = kExact;
        o.nonzero = !few;
        o.offset = f.off_y;
        Tensor x = io.in("x", {n}, kAct, -1, 1, f.off_x), y = io.out("y", {n}, kAct, o);
        io.be.relu_fwd(x, y);
        Tensor dy = io.in("dy", {n}), dx = io.out("dx", {n}, kAct, o);
        io.be.relu_bwd(y, dy, dx);
        Tensor da = io.inout("dx_alias", {n}, kAct, -1, 1, o);
        io.be.relu_bwd(y, da, da);
      };
      r.ref = [](const Io& io, Want& w) {
        const HostVec &x = io.h("x"), &dy = io.h("dy"), &da = io.h("dx_alias");
        HostVec y(x.size()), dx(x.size()), dxa(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
          y[i] = std::max(x[i], 0.f);
          dx[i] = x[i] > 0 ? dy[i] : 0.f;
          dxa[i] = x[i] > 0 ? da[i] : 0.f;
        }
        w.put("y", y), w.put("dx", dx), w.put("dx_alias", dxa);
      };
      r.cpu = f.cpu;
    }
  }
  {  // the old tests' 3-D shapes and the ReLU's gradient check
    Row& r = row("relu fwd / bwd x[2,7,6,3] (gradient check)", {Op::ReluFwd, Op::ReluBwd});
    const Shape s{2, 7, 6, 3};
    r.run = [=](Io& io) {
      Tensor y = io.out("y", s, kAct, kExact), dx = io.out("dx", s, kAct, kExact);
      io.be.relu_fwd(io.in("x", s), y);
      io.be.relu_bwd(y, io.in("dy", s), dx);
    };
    r.ref = [](const Io& io, Want& w) {
      const HostVec &x = io.h("x"), &dy = io.h("dy");
      HostVec y(x.size()), dx(x.size());
      for (size_t i = 0; i < x.size(); ++i) y[i] = std::max(x[i], 0.f), dx[i] = x[i] > 0 ? dy[i] : 0.f;
      w.put("y", y), w.put("dx", dx);
    };
    r.grad = Grad{"y", "dy", {{"x", "dx"}}, {}, [](const Io& io, const std::string&, int64_t i) {
                    return std::abs(io.h("x")[size_t(i)]) < 2e-3f;  // the kink
                  }};
  }
  for (auto [shape, name] : {std::pair{kCube, "x[7,13,11]"}, {Shape{7, 11, 13}, "x[7,11,13]"}}) {
    Row& r = row(std::string("add / axpby / scale / fill / copy ") + name, {Op::Add, Op::Axpby, Op::Scale, Op::Fill, Op::Copy});
    r.run = [=](Io& io) {
      Tensor x = io.in("x", shape, kAct, -3, 3), z = io.in("z", shape);
      Tensor a = io.out("add", shape, kAct, kExact), ax = io.inout("axpby", shape, kAct, -1, 1, kExact);
      Tensor sc = io.inout("scale", shape, kAct, -1, 1, kExact), fl = io.out("fill", shape, kAct, kExact);
      Tensor cp = io.out("copy", shape, kAct, kExact);
      io.be.add(x, z, a);
      io.be.axpby(0.7f, x, -1.3f, ax);
      io.be.scale(sc, -2.5f);
      io.be.fill(fl, 0.375f);
      io.be.copy(x, cp);
    };
    r.ref = [](const Io& io, Want& w) {
      const HostVec &x = io.h("x"), &z = io.h("z"), &ax0 = io.h("axpby"), &sc0 = io.h("scale");
      HostVec a(x.size()), ax(x.size()), sc(x.size());
      for (size_t i = 0; i < x.size(); ++i)
        a[i] = x[i] + z[i], ax[i] = 0.7f * x[i] + -1.3f * ax0[i], sc[i] = sc0[i] * -2.5f;
      w.put("add", a), w.put("axpby", ax), w.put("scale", sc), w.put("fill", HostVec(x.size(), 0.375f));
      w.put("copy", x);
    };
  }
  for (auto [M, N] : {std::pair<int64_t, int64_t>{7, 5}, {77, 45}}) {
    Row& r = row(fmt::format("add_bias y[{},{}]", M, N), {Op::AddBias});
    r.run = [=](Io& io) { io.be.add_bias(io.inout("y", {M, N}, kAct, -1, 1, kExact), io.in("bias", {N})); };
    r.ref = [=](const Io& io, Want& w) {
      HostVec y = io.h("y");
      for (size_t i = 0; i < y.size(); ++i) y[i] += io.h("bias")[i % size_t(N)];
      w.put("y", y);
    };
  }
  // sum_rows: N = 1, 7, 64, 20000 over 100003 values (the CPU's chunking), [1031, 67] and
  // batch norm's [3136, 32] (1 thread == 2 threads)
  for (auto [M, N] : {std::pair<int64_t, int64_t>{100003, 1}, {14286, 7}, {1562, 64}, {5, 20000}, {1031, 67}, {3136, 32}}) {
    Row& r = row(fmt::format("sum_rows x[{},{}] (accumulate and not)", M, N), {Op::SumRows});
    r.threads = true;
    r.run = [=](Io& io) {
      Tensor x = io.in("x", {M, N});
      io.be.sum_rows(x, io.out("y", {N}), false);
      io.be.sum_rows(x, io.inout("y_acc", {N}, kAct, -1, 1), true);
    };
    r.ref = [=](const Io& io, Want& w) {
      HostVec s = ref::sum_rows(io.h("x"), N), a = s;
      for (size_t j = 0; j < a.size(); ++j) a[j] += io.h("y_acc")[j];
      w.put("y", s), w.put("y_acc", a);
    };
  }
  // sum and sum of squares (to the host, deterministic), all_finite
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(100003), int64_t(1) << 20, int64_t(3000017)}) {
    Row& r = row(fmt::format("sum / sum_squares / all_finite n={}", n), {Op::SumSquares, Op::AllFinite});
    r.threads = true;
    r.run = [=](Io& io) {
      Tensor x = io.in("x", {n});
      double ss = 0;
      for (float v : io.h("x")) ss += double(v) * v;
      // the plain sum (loss totals): inputs in [-1, 1), so its error scales with n and sqrt(ss)
      // f64 sums of n positive terms in any order: relative error at most n * 2^-53 (Higham)
      const double ss_tol = std::max(1e-13, double(n) * 0x1p-53);
      io.scalar("sum_squares", io.be.sum_squares(x), dev(Metric::Max, 1e-6, 1e-6, 1e-6, ref(Metric::Approx, ss_tol)));
      const double tol = 1e-9 * double(n) + 1e-6 * std::sqrt(ss);
      io.scalar("sum", io.be.sum(x), dev(Metric::Abs, tol, tol, tol, ref(Metric::Abs, tol)));
      io.scalar("all_finite", io.be.all_finite(x) ? 1 : 0, exact_everywhere());
    };
    r.ref = [](const Io& io, Want& w) {
      double ss = 0, s = 0;
      for (float v : io.h("x")) ss += double(v) * v, s += v;
      w.put("sum_squares", Vals{ss}), w.put("sum", Vals{s}), w.put("all_finite", Vals{1});
    };
  }
  for (auto [n, at] : {std::pair<int64_t, int64_t>{100003, 77777}, {4099, 4000}})
    for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
      Row& r = row(fmt::format("all_finite n={} with {} at {}", n, bad, at), {Op::AllFinite});
      r.run = [=](Io& io) {
        HostVec v = io.uniform("x", size_t(n), -1, 1);
        v[size_t(at)] = bad;
        Opts o = exact_everywhere();
        o.nonzero = false;
        io.scalar("all_finite", io.be.all_finite(io.in_vals("x", {n}, kAct, v)) ? 1 : 0, o);
      };
      r.ref = [](const Io&, Want& w) { w.put("all_finite", Vals{0}); };
    }
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

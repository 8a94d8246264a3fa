// Parity rows: bilinear x2 upsampling (align_corners=False, PyTorch's formula) forward and
// backward (the adjoint), channel concatenation and its inverse split (copy units of 16 bytes
// down to 2: channel counts 16+8, 6+2, 3+1, 5+2).
#include <algorithm>
#include <array>
#include <cmath>

#include <fmt/format.h>

#include "harness.h"

namespace dtrain::parity {
namespace {

// calls f(x index, y index, weight) for every tap of bilinear x2 (align_corners=False)
template <typename F>
void up2x_taps(int64_t N, int64_t H, int64_t W, int64_t C, F f) {
  auto src = [](int64_t o, int64_t n, int64_t& i0, int64_t& i1, double& l1) {
    const double s = std::max(0.0, (double(o) + 0.5) / 2.0 - 0.5);
    i0 = std::min(int64_t(std::floor(s)), n - 1);
    i1 = std::min(i0 + 1, n - 1);
    l1 = s - double(i0);
  };
  for (int64_t n = 0; n < N; ++n)
    for (int64_t oh = 0; oh < 2 * H; ++oh)
      for (int64_t ow = 0; ow < 2 * W; ++ow) {
        int64_t h0, h1, w0, w1;
        double lh, lw;
        src(oh, H, h0, h1, lh);
        src(ow, W, w0, w1, lw);
        for (int64_t c = 0; c < C; ++c) {
          const int64_t yi = ((n * 2 * H + oh) * 2 * W + ow) * C + c;
          auto xi = [&](int64_t h, int64_t w) { return ((n * H + h) * W + w) * C + c; };
          f(xi(h0, w0), yi, (1 - lh) * (1 - lw)), f(xi(h0, w1), yi, (1 - lh) * lw);
          f(xi(h1, w0), yi, lh * (1 - lw)), f(xi(h1, w1), yi, lh * lw);
        }
      }
}

Row upsample_row(int64_t N, int64_t H, int64_t W, int64_t C, bool grad) {
  const Shape xs{N, H, W, C}, ys{N, 2 * H, 2 * W, C};
  Row r;
  r.family = "unet";
  r.name = fmt::format("upsample_bilinear2x fwd / bwd x[{},{},{},{}]{}", N, H, W, C, grad ? " (gradient check)" : "");
  r.ops = {Op::UpsampleBilinear2xFwd, Op::UpsampleBilinear2xBwd};
  r.emul = true;
  r.threads = true;
  r.dev_rerun = true;
  r.run = [=](Io& io) {
    const Opts o = dev(Metric::L2, 1e-5, 1e-2, 2e-3, ref(Metric::L2, 1e-6));
    io.be.upsample_bilinear2x_fwd(io.in("x", xs), io.out("y", ys, kAct, o));
    io.be.upsample_bilinear2x_bwd(io.in("dy", ys), io.out("dx", xs, kAct, o));
  };
  r.ref = [=](const Io& io, Want& w) {
    Vals y(size_t(ys.numel()), 0.0), dx(size_t(xs.numel()), 0.0);
    const HostVec &x = io.h("x"), &dy = io.h("dy");
    up2x_taps(N, H, W, C, [&](int64_t xi, int64_t yi, double k) {
      y[size_t(yi)] += k * x[size_t(xi)];
      dx[size_t(xi)] += k * dy[size_t(yi)];
    });
    w.put("y", y), w.put("dx", dx);
  };
  r.check = [](const Io& io, const Outs& o, Report& rep) {  // the backward is the forward's adjoint
    if (!io.on_cpu() || io.storage(kAct) != DType::F32) return;
    rep.compared++;
    double a = 0, b = 0;
    for (size_t i = 0; i < o.at("y").v.size(); ++i) a += o.at("y").v[i] * io.h("dy")[i];
    for (size_t i = 0; i < o.at("dx").v.size(); ++i) b += o.at("dx").v[i] * io.h("x")[i];
    if (!(std::fabs(a - b) < 1e-4)) rep.fail(fmt::format("upsample: <up(x), dy> = {} but <x, up_bwd(dy)> = {}", a, b));
  };
  if (grad) r.grad = Grad{"y", "dy", {{"x", "dx"}}};
  return r;
}

Row concat_row(int64_t N, int64_t H, int64_t W, int64_t Ca, int64_t Cb, bool cpu, bool grad) {
  const Shape as{N, H, W, Ca}, bs{N, H, W, Cb}, ys{N, H, W, Ca + Cb};
  Row r;
  r.family = "unet";
  r.name = fmt::format("concat_channels / split_channels [{},{},{}] {}+{}{}", N, H, W, Ca, Cb, grad ? " (gradient check)" : "");
  r.ops = {Op::ConcatChannels, Op::SplitChannels};
  r.emul = true;
  r.cpu = cpu;
  r.run = [=](Io& io) {
    const Opts exact = dev(Metric::Max, 0, 0, 0, ref(Metric::Bits, 0));
    Tensor a = io.in("a", as), b = io.in("b", bs), y = io.out("y", ys, kAct, exact);
    io.be.concat_channels(a, b, y);
    Tensor dy = io.in("dy", ys), none;
    io.be.split_channels(dy, io.out("da", as, kAct, exact), io.out("db", bs, kAct, exact));
    io.be.split_channels(dy, none, io.out("db_only", bs, kAct, exact));  // an undefined part is skipped
    io.be.split_channels(dy, io.out("da_only", as, kAct, exact), none);
  };
  r.ref = [=](const Io& io, Want& w) {
    HostVec y, da, db;
    const HostVec &a = io.h("a"), &b = io.h("b"), &dy = io.h("dy");
    for (int64_t p = 0; p < N * H * W; ++p) {
      y.insert(y.end(), a.begin() + p * Ca, a.begin() + (p + 1) * Ca);
      y.insert(y.end(), b.begin() + p * Cb, b.begin() + (p + 1) * Cb);
      da.insert(da.end(), dy.begin() + p * (Ca + Cb), dy.begin() + p * (Ca + Cb) + Ca);
      db.insert(db.end(), dy.begin() + p * (Ca + Cb) + Ca, dy.begin() + (p + 1) * (Ca + Cb));
    }
    w.put("y", y), w.put("da", da), w.put("db", db), w.put("db_only", db), w.put("da_only", da);
  };
  if (grad) r.grad = Grad{"y", "dy", {{"a", "da"}, {"b", "db"}}};  // split is concat's backward
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  // the CPU tests' shapes (1x1 and single-column inputs), its gradient check's, the GPU test's
  for (auto [N, H, W, C] : {std::array<int64_t, 4>{2, 3, 5, 3}, {1, 1, 1, 2}, {1, 4, 1, 5}, {2, 7, 9, 5}, {1, 5, 6, 16}, {1, 3, 5, 6},
                            {2, 4, 4, 3}})
    t.push_back(upsample_row(N, H, W, C, false));
  t.push_back(upsample_row(2, 3, 4, 2, true));
  t.push_back(concat_row(2, 3, 3, 2, 5, true, true));
  for (auto [N, H, W, Ca, Cb] : {std::array<int64_t, 5>{2, 7, 9, 5, 2}, {1, 5, 6, 16, 8}, {1, 3, 5, 6, 2}, {2, 4, 4, 3, 1},
                                 {4, 512, 640, 8, 8}})
    t.push_back(concat_row(N, H, W, Ca, Cb, N * H * W <= 4096, false));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

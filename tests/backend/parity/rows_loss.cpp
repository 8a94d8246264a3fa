// Parity rows: softmax cross-entropy (label smoothing, huge logits, rows per thread / warp /
// block, many rows), its masked form over a padded vocabulary (GPT), the soft Dice loss
// (U-Net); the losses' gradients by finite differences.
#include <algorithm>
#include <array>
#include <initializer_list>
#include <cmath>

#include <fmt/format.h>

#include "ref_ops.h"
#include "harness.h"

namespace dtrain::parity {
namespace {

IntVec labels(const Io& io, int64_t n, int64_t classes) {
  Rng r = io.rng("labels");
  IntVec v(static_cast<size_t>(n));
  for (auto& l : v) l = int32_t(r.below(uint64_t(classes)));
  return v;
}

struct Xent {
  int64_t N, C;
  float ls, gs, lo, hi, shift;
  IntVec fixed_labels;  // empty: seeded
  Opts loss_opts, dz_opts;
};

Row xent_row(const Xent& c, bool grad) {
  Row r;
  r.family = "loss";
  r.name = fmt::format("softmax_xent N={} C={} smoothing={} grad_scale={} logits in [{},{}){}", c.N, c.C, c.ls, c.gs,
                       c.lo + c.shift, c.hi + c.shift, grad ? " (gradient check)" : "");
  r.ops = {Op::SoftmaxXent};
  r.emul = c.N * c.C <= 50;
  r.threads = c.N == 1000;
  r.dev_rerun = true;
  r.run = [=](Io& io) {
    HostVec z = io.uniform("logits", size_t(c.N * c.C), c.lo, c.hi);
    for (float& v : z) v += c.shift;
    Tensor tz = io.in_vals("logits", {c.N, c.C}, kAct, z);
    Tensor lab = io.ids("labels", {c.N}, c.fixed_labels.empty() ? labels(io, c.N, c.C) : c.fixed_labels);
    io.be.softmax_xent(tz, lab, c.ls, c.gs, io.out("losses", {c.N}, kF32, c.loss_opts), io.out("dlogits", {c.N, c.C}, kAct, c.dz_opts));
    Tensor none;  // the loss only
    io.be.softmax_xent(tz, lab, c.ls, c.gs, io.out("losses_only", {c.N}, kF32, c.loss_opts), none);
  };
  r.ref = [=](const Io& io, Want& w) {
    HostVec l(size_t(c.N)), dz(size_t(c.N * c.C));
    for (int64_t i = 0; i < c.N; ++i)
      l[size_t(i)] = float(ref::xent_row(&io.h("logits")[size_t(i * c.C)], c.C, io.hi("labels")[size_t(i)], c.ls,
                                         &dz[size_t(i * c.C)], c.gs));
    w.put("losses", l), w.put("losses_only", l), w.put("dlogits", dz);
  };
  if (grad) r.grad = Grad{"losses", "", {{"logits", "dlogits"}}};
  return r;
}

// softmax_xent_masked: columns >= V of logits [N, Vp] are never predicted (dlogits 0)
struct Masked {
  int64_t N, V, Vp;
  float gs, lo, hi;
  bool huge_padding;  // a padded logit of 50 in every row
  Opts loss_opts, dz_opts;
};

Row masked_row(const Masked& c, bool grad) {
  Row r;
  r.family = "loss";
  r.name = fmt::format("softmax_xent_masked N={} V={} Vp={} grad_scale={}{}", c.N, c.V, c.Vp, c.gs,
                       grad ? " (gradient check)" : "");
  r.ops = {Op::SoftmaxXentMasked};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.run = [=](Io& io) {
    HostVec z = io.uniform("logits", size_t(c.N * c.Vp), c.lo, c.hi);
    if (c.huge_padding)
      for (int64_t i = 0; i < c.N; ++i) z[size_t(i * c.Vp + c.V + 1)] = 50.f;
    Tensor tz = io.in_vals("logits", {c.N, c.Vp}, kAct, z), lab = io.ids("labels", {c.N}, labels(io, c.N, c.V));
    io.be.softmax_xent_masked(tz, lab, c.V, c.gs, io.out("losses", {c.N}, kF32, c.loss_opts),
                              io.out("dlogits", {c.N, c.Vp}, kAct, c.dz_opts));
  };
  r.ref = [=](const Io& io, Want& w) {
    Vals l(size_t(c.N)), dz(size_t(c.N * c.Vp), 0.0);
    for (int64_t i = 0; i < c.N; ++i) {
      HostVec d(size_t(c.V));
      l[size_t(i)] = ref::xent_row(&io.h("logits")[size_t(i * c.Vp)], c.V, io.hi("labels")[size_t(i)], 0.0, d.data(), c.gs);
      for (int64_t k = 0; k < c.V; ++k) dz[size_t(i * c.Vp + k)] = d[size_t(k)];
    }
    w.put("losses", l), w.put("dlogits", dz);
  };
  r.check = [=](const Io& io, const Outs& o, Report& rep) {  // padded columns: exactly 0 everywhere
    rep.compared++;
    const Vals& dz = o.at("dlogits").v;
    for (int64_t i = 0; i < c.N; ++i)
      for (int64_t k = c.V; k < c.Vp; ++k)
        if (dz[size_t(i * c.Vp + k)] != 0.0) {
          rep.fail(fmt::format("{} {}: dlogits[{},{}] = {} in a padded column", io.be.name(), dtype_name(io.dt), i, k,
                               dz[size_t(i * c.Vp + k)]));
          return;
        }
  };
  if (grad) {
    testing::GradCheckOptions o;
    o.max_checks = 200;
    r.grad = Grad{"losses", "", {{"logits", "dlogits"}}, o};
  }
  return r;
}

// vocabulary-parallel cross-entropy, one rank's three passes: its logits [N, Vl] hold classes
// [offset, offset + Vl) of `classes`, the first `valid` real; the labels fall on this rank's
// columns and on others' (whose target logit is 0 here); the rank's max stands for the group's
Row vocab_row(int64_t N, int64_t Vl, int64_t valid, int64_t offset, int64_t classes, float gs, const Opts& loss_o,
              const Opts& dz_o) {
  Row r;
  r.family = "loss";
  r.name = fmt::format("vocab_xent N={} Vl={} valid={} offset={} classes={} grad_scale={}", N, Vl, valid, offset,
                       classes, gs);
  r.ops = {Op::VocabXent};
  r.same_dtype = true;
  r.dev_rerun = true;
  auto lab = [=](const Io& io) {  // every other label one of this rank's columns
    IntVec v = labels(io, N, classes);
    for (int64_t i = 0; i < N; i += 2) v[size_t(i)] = int32_t(offset + v[size_t(i)] % std::max<int64_t>(valid, 1));
    return v;
  };
  r.run = [=](Io& io) {
    Tensor z = io.in("logits", {N, Vl}, kAct, -3, 3), y = io.ids("labels", {N}, lab(io));
    Tensor mx = io.out("mx", {N}, kF32, dev(Metric::Max, 0, 0, 0, ref(Metric::Max, 0)));
    io.be.vocab_xent_max(z, valid, mx);
    Tensor parts = io.out("parts", {N, 2}, kF32, loss_o);
    io.be.vocab_xent_parts(z, y, offset, valid, classes, mx, parts);
    io.be.vocab_xent_finish(z, y, offset, valid, mx, parts, gs, io.out("losses", {N}, kF32, loss_o),
                            io.out("dlogits", {N, Vl}, kAct, dz_o));
  };
  r.ref = [=](const Io& io, Want& w) {
    const HostVec& z = io.h("logits");
    const IntVec& y = io.hi("labels");
    Vals mx(static_cast<size_t>(N)), parts(static_cast<size_t>(2 * N)), loss(static_cast<size_t>(N)),
        dz(static_cast<size_t>(N * Vl), 0.0);
    for (int64_t i = 0; i < N; ++i) {
      double m = -INFINITY, se = 0;
      for (int64_t c = 0; c < valid; ++c) m = std::max(m, double(z[size_t(i * Vl + c)]));
      for (int64_t c = 0; c < valid; ++c) se += std::exp(double(z[size_t(i * Vl + c)]) - m);
      const int64_t t = y[size_t(i)] - offset;
      const double target = t >= 0 && t < valid ? double(z[size_t(i * Vl + t)]) : 0.0;
      mx[size_t(i)] = m, parts[size_t(2 * i)] = se, parts[size_t(2 * i + 1)] = target;
      loss[size_t(i)] = m + std::log(se) - target;
      for (int64_t c = 0; c < valid; ++c)
        dz[size_t(i * Vl + c)] = gs * (std::exp(double(z[size_t(i * Vl + c)]) - m) / se - (c == t ? 1.0 : 0.0));
    }
    w.put("mx", mx), w.put("parts", parts), w.put("losses", loss), w.put("dlogits", dz);
  };
  return r;
}

// soft Dice over a batch: logits [N,H,W,K], labels [N,H,W]
struct Dice {
  int N, H, W, K;
  float gs;
};

double ref_dice(const HostVec& x, const IntVec& y, int64_t P, int K, double smooth) {
  std::vector<double> sp(static_cast<size_t>(K)), inter(static_cast<size_t>(K)), st(static_cast<size_t>(K));
  for (int64_t i = 0; i < P; ++i) {
    double m = -1e300, s = 0;
    for (int k = 0; k < K; ++k) m = std::max(m, double(x[size_t(i * K + k)]));
    for (int k = 0; k < K; ++k) s += std::exp(double(x[size_t(i * K + k)]) - m);
    for (int k = 0; k < K; ++k) {
      const double p = std::exp(double(x[size_t(i * K + k)]) - m) / s;
      sp[size_t(k)] += p;
      if (y[size_t(i)] == k) inter[size_t(k)] += p, st[size_t(k)] += 1;
    }
  }
  double d = 0;
  for (int k = 0; k < K; ++k) d += (2 * inter[size_t(k)] + smooth) / (sp[size_t(k)] + st[size_t(k)] + smooth);
  return 1 - d / K;
}

Row dice_row(const Dice& c, bool grad) {
  const int64_t P = int64_t(c.N) * c.H * c.W;
  const Shape ls{c.N, c.H, c.W, c.K};
  Row r;
  r.family = "loss";
  r.name = fmt::format("softmax_dice x[{},{},{},{}] grad_scale={}{}", c.N, c.H, c.W, c.K, c.gs, grad ? " (gradient check)" : "");
  r.ops = {Op::SoftmaxDice};
  r.dev_rerun = true;
  r.run = [=](Io& io) {
    Tensor x = io.in("logits", ls, kAct, -2, 2), lab = io.ids("labels", {c.N, c.H, c.W}, labels(io, P, c.K));
    io.be.softmax_dice(x, lab, 1.f, c.gs, io.out("loss", {1}, kF32, dev(Metric::Abs, 1e-5, 1e-5, 1e-5, ref(Metric::Abs, 1e-6))),
                       io.out("dlogits", ls, kAct, dev(Metric::L2, 1e-4, 1e-1, 2e-2)));
    Tensor none;  // grad_scale scales dlogits
    io.be.softmax_dice(x, lab, 1.f, c.gs * 0.5f, none, io.out("dlogits_half", ls, kAct, dev(Metric::L2, 1e-4, 1e-1, 2e-2)));
  };
  r.ref = [=](const Io& io, Want& w) { w.put("loss", Vals{ref_dice(io.h("logits"), io.hi("labels"), P, c.K, 1.0)}); };
  r.check = [](const Io& io, const Outs& o, Report& rep) {
    rep.compared++;
    if (!(o.at("loss").v[0] > 0)) rep.fail("softmax_dice: loss not positive");
    if (!io.on_cpu()) return;
    const Vals &d = o.at("dlogits").v, &h = o.at("dlogits_half").v;
    double mx = 0;
    for (double v : d) mx = std::max(mx, std::fabs(v));
    // dlogits and dlogits_half are each rounded once to the run's dtype: in 16 bits they may
    // differ by the dtype's spacing at 0.5 * |d| (f16: 2^-11 relative, 2^-24 absolute below
    // its normal range; bf16: 2^-8 relative)
    const double rel = io.dt == DType::F16 ? 0x1p-11 : io.dt == DType::BF16 ? 0x1p-8 : 0.0;
    const double sub = io.dt == DType::F16 ? 0x1p-24 : 0.0;
    for (size_t i = 0; i < d.size(); ++i)
      if (std::fabs(h[i] - 0.5 * d[i]) > 1e-6 * mx + std::max(rel * 0.5 * std::fabs(d[i]), sub)) {
        rep.fail(fmt::format("softmax_dice {}: grad_scale 0.5 gives {} at {}, not half of {}", dtype_name(io.dt), h[i], i, d[i]));
        return;
      }
  };
  if (grad) {
    testing::GradCheckOptions o;
    o.eps = 1e-2;
    o.threshold = 2e-2;
    r.grad = Grad{"loss", "", {{"logits", "dlogits"}}, o};
  }
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  const Opts exact_loss = dev(Metric::Max, 1e-5, 1e-5, 1e-5, ref(Metric::L2, 1e-6));  // f32 math on equal inputs
  const Opts dz = ref(Metric::L2, 1e-6);
  // the CPU test (huge logits: stable), its gradient check, the threads and emulation cases
  for (float ls : {0.f, 0.1f})
    for (float shift : {0.f, 1000.f}) t.push_back(xent_row({5, 7, ls, 0.5f, -4, 4, shift, {0, 6, 3, 3, 1}, exact_loss, dz}, false));
  for (float ls : {0.f, 0.2f}) t.push_back(xent_row({4, 5, ls, 1.f, -3, 3, 0, {1, 4, 0, 2}, exact_loss, dz}, true));
  t.push_back(xent_row({6, 5, 0.1f, 1.f, -1, 1, 0, {0, 1, 2, 3, 0, 1}, exact_loss, dz}, false));
  t.push_back(xent_row({1000, 10, 0.1f, 1e-3f, -1, 1, 0, {}, exact_loss, dz}, false));
  // rows per thread (C <= 16), per warp (C <= 1024), per block; many rows (segmentation pixels)
  for (auto [N, C] : {std::pair<int64_t, int64_t>{9, 2}, {9, 10}, {9, 16}, {9, 17}, {9, 1000}, {9, 1025}, {9, 50257},
                      {1'100'003, 2}, {40'000, 21}})
    for (float ls : {0.f, 0.1f}) t.push_back(xent_row({N, C, ls, 0.5f, -8, 8, 0, {}, exact_loss, dz}, false));
  // masked: GPT ops' case (a huge padded logit), its gradient check, the CUDA kernels' widths
  const Opts m_loss = dev(Metric::L2, 1e-5, 1e-4, 1e-4, ref(Metric::Approx, 1e-5));
  const Opts m_dz = dev(Metric::L2, 1e-5, 1e-2, 2e-3);
  t.push_back(masked_row({14, 21, 32, 1.f / 14, -3, 3, true, m_loss, m_dz}, false));
  t.push_back(masked_row({14, 21, 32, 1.f, -3, 3, true, m_loss, m_dz}, true));
  const Opts k_loss = dev(Metric::L2, 1e-4, 1e-4, 1e-4, ref(Metric::Approx, 1e-5));
  for (auto [M, C] : {std::pair<int64_t, int64_t>{37, 768}, {9, 20}, {4, 2056}, {64, 64}})
    t.push_back(masked_row({M, C - 3, C, 0.25f, -2, 2, false, k_loss, m_dz}, false));
  // vocabulary-parallel cross-entropy: ranks with and without padding columns, CUDA block widths
  for (auto [N, Vl, valid, offset] : std::initializer_list<std::array<int64_t, 4>>{
           {14, 32, 21, 32}, {37, 384, 384, 384}, {9, 16, 3, 64}, {5, 2056, 2050, 2056}})
    t.push_back(vocab_row(N, Vl, valid, offset, offset + std::max<int64_t>(valid, 1) + 100, 0.25f, m_loss, m_dz));
  // Dice: the CPU test and its gradient check; the GPU test's register widths (K <= 4, <= 16,
  // <= 64) and a million pixels (grid-stride loops); grad_scale ~ pixels keeps f16 out of subnormals
  t.push_back(dice_row({2, 3, 5, 4, 1.f}, true));
  for (auto [N, H, W, K] : {std::array<int, 4>{2, 7, 9, 3}, {1, 5, 6, 2}, {1, 3, 5, 7}, {2, 4, 4, 20}, {4, 512, 640, 2}})
    t.push_back(dice_row({N, H, W, K, float(N * H * W) / 16.f}, false));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

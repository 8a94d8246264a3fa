// Parity rows: SGD (momentum, dampening, Nesterov, weight decay per segment, gradient scale)
// and AdamW (decoupled decay, bias correction) over flat f32 buffers for several steps, against
// PyTorch's update formulas in double; elements outside every segment stay untouched.
#include <cmath>

#include <fmt/format.h>

#include "harness.h"

namespace dtrain::parity {
namespace {

const Opts kOpt = dev(Metric::Max, 1e-6, 1e-6, 1e-6, ref(Metric::Approx, 1e-5));

std::string segs_str(const std::vector<ParamSegment>& segs) {
  std::string s;
  for (const auto& g : segs) s += fmt::format("{}{}+{}{}", s.empty() ? "" : " ", g.offset, g.count, g.decay ? "" : "n");
  return s;
}

// Elements in no segment, as a derived output that must equal the initial values bit for bit.
void untouched(Io& io, int64_t n, const std::vector<ParamSegment>& segs) {
  std::vector<size_t> idx;
  for (int64_t i = 0; i < n; ++i) {
    bool in = false;
    for (const auto& g : segs) in = in || (i >= g.offset && i < g.offset + g.count);
    if (!in) idx.push_back(static_cast<size_t>(i));
  }
  if (idx.empty()) return;
  io.derive("untouched", dev(Metric::Max, 0, 0, 0, ref(Metric::Bits, 0)), [idx](const Outs& o) {
    Vals v;
    for (size_t i : idx) v.push_back(o.at("params").v[i]);
    return v;
  });
}
Vals untouched_ref(const HostVec& p0, const std::vector<ParamSegment>& segs) {
  Vals v;
  for (size_t i = 0; i < p0.size(); ++i) {
    bool in = false;
    for (const auto& g : segs) in = in || (int64_t(i) >= g.offset && int64_t(i) < g.offset + g.count);
    if (!in) v.push_back(p0[i]);
  }
  return v;
}

Row sgd_row(int64_t n, std::vector<ParamSegment> segs, SgdArgs a, int steps) {
  Row r;
  r.family = "optim";
  r.name = fmt::format("sgd_step n={} segments {} lr={} momentum={} dampening={} nesterov={} decay={} grad_scale={} steps={}",
                       n, segs_str(segs), a.lr, a.momentum, a.dampening, a.nesterov, a.weight_decay, a.grad_scale, steps);
  r.ops = {Op::SgdStep};
  r.dtypes = {DType::F32};
  r.dev_rerun = true;
  r.run = [=](Io& io) {
    Tensor p = io.inout("params", {n}, kF32, -1, 1, kOpt), g = io.in("grads", {n}, kF32);
    Opts unused = kOpt;  // without momentum the buffer is not part of the contract
    unused.cross = false;
    Tensor m = io.inout("momentum", {n}, kF32, -1, 1, a.momentum == 0 ? unused : kOpt);
    for (int s = 0; s < steps; ++s) {
      SgdArgs as = a;
      as.first_step = s == 0;
      io.be.sgd_step(p, g, m, segs, as);
    }
    untouched(io, n, segs);
  };
  r.ref = [=](const Io& io, Want& w) {
    const HostVec &p0 = io.h("params"), &g0 = io.h("grads");
    std::vector<double> pp(p0.begin(), p0.end()), buf(io.h("momentum").begin(), io.h("momentum").end());
    for (int s = 0; s < steps; ++s)
      for (const auto& sg : segs)
        for (int64_t i = sg.offset; i < sg.offset + sg.count; ++i) {
          double d = g0[size_t(i)] * double(a.grad_scale) + (sg.decay ? double(a.weight_decay) : 0.0) * pp[size_t(i)];
          if (a.momentum != 0) {  // the buffer starts as the gradient (PyTorch)
            buf[size_t(i)] = s == 0 ? d : double(a.momentum) * buf[size_t(i)] + (1 - double(a.dampening)) * d;
            d = a.nesterov ? d + double(a.momentum) * buf[size_t(i)] : buf[size_t(i)];
          }
          pp[size_t(i)] -= double(a.lr) * d;
        }
    w.put("params", Vals(pp.begin(), pp.end()));
    if (a.momentum != 0) w.put("momentum", Vals(buf.begin(), buf.end()));
    if (!untouched_ref(p0, segs).empty()) w.put("untouched", untouched_ref(p0, segs));
  };
  return r;
}

Row adamw_row(int64_t n, std::vector<ParamSegment> segs, AdamWArgs a, int steps, int redecay_at) {
  Row r;
  r.family = "optim";
  r.name = fmt::format("adamw_step n={} segments {} lr={} betas={}/{} eps={} decay={} grad_scale={} steps={}{}", n,
                       segs_str(segs), a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale, steps,
                       redecay_at ? fmt::format(" (segment 1 decays from step {})", redecay_at) : "");
  r.ops = {Op::AdamWStep};
  r.dtypes = {DType::F32};
  r.dev_rerun = true;
  auto segs_at = [segs, redecay_at](int step) {  // a changed table must be re-uploaded
    auto s = segs;
    if (redecay_at && step >= redecay_at) s[1].decay = true;
    return s;
  };
  r.run = [=](Io& io) {
    Tensor p = io.inout("params", {n}, kF32, -1, 1, kOpt), g = io.in("grads", {n}, kF32);
    Tensor m = io.inout_vals("m", {n}, kF32, HostVec(size_t(n), 0.f), kOpt);
    Tensor v = io.inout_vals("v", {n}, kF32, HostVec(size_t(n), 0.f), kOpt);
    for (int s = 1; s <= steps; ++s) {
      AdamWArgs as = a;
      as.step = s;
      io.be.adamw_step(p, g, m, v, segs_at(s), as);
    }
    untouched(io, n, segs);
  };
  r.ref = [=](const Io& io, Want& w) {
    const HostVec &p0 = io.h("params"), &g0 = io.h("grads");
    std::vector<double> pp(p0.begin(), p0.end()), mm(static_cast<size_t>(n), 0.0), vv(static_cast<size_t>(n), 0.0);
    const double b1 = a.beta1, b2 = a.beta2, lr = a.lr;
    for (int s = 1; s <= steps; ++s)
      for (const auto& sg : segs_at(s))
        for (int64_t i = sg.offset; i < sg.offset + sg.count; ++i) {
          const size_t k = size_t(i);
          const double gi = double(a.grad_scale) * g0[k];
          if (sg.decay) pp[k] *= 1 - lr * double(a.weight_decay);
          mm[k] = b1 * mm[k] + (1 - b1) * gi;
          vv[k] = b2 * vv[k] + (1 - b2) * gi * gi;
          const double bc1 = 1 - std::pow(b1, s), bc2 = 1 - std::pow(b2, s);
          pp[k] -= lr / bc1 * mm[k] / (std::sqrt(vv[k]) / std::sqrt(bc2) + double(a.eps));
        }
    w.put("params", Vals(pp.begin(), pp.end())), w.put("m", Vals(mm.begin(), mm.end())), w.put("v", Vals(vv.begin(), vv.end()));
    if (!untouched_ref(p0, segs).empty()) w.put("untouched", untouched_ref(p0, segs));
  };
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  // the CPU test: plain, dampened and Nesterov momentum over 3 segments (one without decay)
  // with a gap; the GPU test: 10000 elements, an empty segment, gaps
  for (int variant = 0; variant < 3; ++variant) {
    SgdArgs s;
    s.lr = 0.05f, s.momentum = variant == 0 ? 0.f : 0.9f, s.weight_decay = 5e-4f;
    s.dampening = variant == 1 ? 0.1f : 0.f, s.nesterov = variant == 2, s.grad_scale = 0.25f;
    t.push_back(sgd_row(300, {{0, 100, true}, {100, 50, false}, {200, 100, true}}, s, 3));
  }
  const std::vector<ParamSegment> big{{0, 4000, true}, {4000, 33, false}, {4033, 0, true}, {5000, 4999, true}};
  for (bool nesterov : {false, true}) {
    SgdArgs s;
    s.lr = 0.05f, s.momentum = 0.9f, s.dampening = nesterov ? 0.f : 0.1f, s.weight_decay = 5e-4f;
    s.nesterov = nesterov, s.grad_scale = 0.5f;
    t.push_back(sgd_row(10000, big, s, 3));
  }
  AdamWArgs a;
  a.lr = 3e-3f, a.beta1 = 0.8f, a.beta2 = 0.99f, a.eps = 1e-6f, a.weight_decay = 0.1f, a.grad_scale = 2.f;
  t.push_back(adamw_row(257, {{0, 200, true}, {200, 57, false}}, a, 4, 0));
  AdamWArgs b;
  b.lr = 1e-2f, b.weight_decay = 0.1f, b.grad_scale = 2.f;
  t.push_back(adamw_row(10000, big, b, 3, 3));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

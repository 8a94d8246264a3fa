// Parity rows: max pooling (forward with and without argmax, the argmax bytes themselves,
// backward, accumulating backward), average pooling (count_include_pad) and global average
// pooling, forward and backward. Channel counts pick the kernels (19: scalar; 24, 64: 16-byte
// vectors); distinct values (no ties) and ReLU-like values (many ties: the first max in scan
// order wins on every backend).
#include <fmt/format.h>

#include "ref_ops.h"
#include "harness.h"

namespace dtrain::parity {
namespace {

// Pairwise-distinct values exact in bf16 and f16 (+-(1+m/128)*2^e, e in [-10,9]), shuffled.
HostVec distinct(Io& io, size_t n) {
  DTRAIN_CHECK(n <= 256 * 20, "distinct: {} values", n);
  HostVec v(n);
  for (size_t k = 0; k < n; ++k) {
    const float mag = std::ldexp(1.f + float(k % 128) / 128.f, int(k / 256) - 10);
    v[k] = (k / 128) % 2 ? -mag : mag;
  }
  Rng r = io.rng("x.shuffle");
  for (size_t k = n; k > 1; --k) std::swap(v[k - 1], v[r.below(k)]);
  return v;
}
HostVec ties(Io& io, size_t n) {  // ReLU outputs: many equal zeros, few distinct values
  const float levels[] = {0.f, 0.f, 0.f, 0.5f, 1.f, -1.f};
  Rng r = io.rng("x.levels");
  HostVec v(n);
  for (float& f : v) f = levels[r.below(6)];
  return v;
}

enum class Values { Uniform, Distinct, Ties };

Row pool_row(int64_t N, int64_t H, int64_t W, int64_t C, Pool2dParams p, Values vals, bool grad) {
  const ref::Pool g{N, H, W, C, p};
  const Shape xs{N, H, W, C}, ys{N, g.OH(), g.OW(), C};
  Row r;
  r.family = "pool";
  r.name = fmt::format("max / avg pool k{}x{} s{}x{} p{}x{} x[{},{},{},{}]{}{}", p.kernel_h, p.kernel_w, p.stride_h,
                       p.stride_w, p.pad_h, p.pad_w, N, H, W, C,
                       vals == Values::Distinct ? " distinct" : vals == Values::Ties ? " ties" : "",
                       grad ? " (gradient check)" : "");
  r.ops = {Op::MaxPoolFwd, Op::MaxPoolBwd, Op::AvgPoolFwd, Op::AvgPoolBwd};
  r.emul = true;
  r.dev_rerun = true;
  r.run = [=](Io& io) {
    const size_t n = size_t(xs.numel());
    Tensor x = vals == Values::Distinct ? io.in_vals("x", xs, kAct, distinct(io, n))
               : vals == Values::Ties   ? io.in_vals("x", xs, kAct, ties(io, n))
                                        : io.in("x", xs);
    const Opts exact = dev(Metric::Max, 0, 0, 0, ref(Metric::Bits, 0, vals == Values::Ties ? may_be_zero() : Opts{}));
    const Opts grad_tol = ref(Metric::L2, 1e-6);
    Tensor y = io.out("max.y", ys, kAct, exact), am = io.out("max.argmax", ys, fixed(DType::U8), may_be_zero(exact));
    Tensor none;
    io.be.maxpool2d_fwd(x, y, am, p);
    io.be.maxpool2d_fwd(x, io.out("max.y_noargmax", ys, kAct, exact), none, p);  // no backward follows
    Tensor dy = io.in("dy", ys);
    io.be.maxpool2d_bwd(am, dy, io.out("max.dx", xs, kAct, grad_tol), p, false);
    // dx += the gradient: on the CPU bit-identical to a separate add (check)
    io.be.maxpool2d_bwd(am, dy, io.inout("max.dx_acc", xs, kAct, -1, 1, no_emul(grad_tol)), p, true);
    io.be.avgpool2d_fwd(x, io.out("avg.y", ys, kAct, grad_tol), p);
    io.be.avgpool2d_bwd(dy, io.out("avg.dx", xs, kAct, grad_tol), p);
  };
  r.ref = [=](const Io& io, Want& w) {
    const HostVec &x = io.h("x"), &dy = io.h("dy");
    std::vector<int64_t> arg;
    w.put("max.y", ref::maxpool_fwd(g, x, &arg));
    w.put("max.y_noargmax", ref::maxpool_fwd(g, x));
    Vals am(arg.size());  // the winner's offset in its window
    for (int64_t n = 0, i = 0; n < N; ++n)
      for (int64_t oh = 0; oh < g.OH(); ++oh)
        for (int64_t ow = 0; ow < g.OW(); ++ow)
          for (int64_t c = 0; c < C; ++c, ++i) {
            const int64_t xi = arg[size_t(i)] / C, ih = xi / W % H, iw = xi % W;
            am[size_t(i)] = double((ih - oh * p.stride_h + p.pad_h) * p.kernel_w + (iw - ow * p.stride_w + p.pad_w));
          }
    w.put("max.argmax", am);
    const HostVec dx = ref::maxpool_bwd(g, x, dy);
    Vals acc(dx.size());
    for (size_t i = 0; i < dx.size(); ++i) acc[i] = double(io.h("max.dx_acc")[i]) + dx[i];
    w.put("max.dx", dx), w.put("max.dx_acc", acc);
    w.put("avg.y", ref::avgpool_fwd(g, x)), w.put("avg.dx", ref::avgpool_bwd(g, dy));
  };
  r.check = [](const Io& io, const Outs& o, Report& rep) {
    rep.compared++;
    if (o.at("max.y").v != o.at("max.y_noargmax").v) rep.fail(io.be.name() + ": maxpool2d_fwd differs without argmax");
    if (!io.on_cpu()) return;
    const Vals &dx = o.at("max.dx").v, &acc = o.at("max.dx_acc").v;
    size_t bad = 0;
    for (size_t i = 0; i < dx.size(); ++i)
      bad += double(round_to(io.storage(kAct), io.h("max.dx_acc")[i] + float(dx[i]))) != acc[i];
    if (bad) rep.fail(fmt::format("maxpool2d_bwd accumulate on the cpu {}: {} values differ from the op then an add",
                                  dtype_name(io.dt), bad));
  };
  if (grad) r.grad = Grad{"max.y", "dy", {{"x", "max.dx"}}};
  return r;
}

// avg pool's gradient check alone (a row of its own: the loss is the average's)
Row avg_grad_row() {
  const Pool2dParams p{3, 3, 2, 2, 1, 1};
  const ref::Pool g{2, 7, 6, 3, p};
  const Shape xs{2, 7, 6, 3}, ys{2, g.OH(), g.OW(), 3};
  Row r;
  r.family = "pool";
  r.name = "avg pool k3x3 s2x2 p1x1 x[2,7,6,3] (gradient check)";
  r.ops = {Op::AvgPoolFwd, Op::AvgPoolBwd};
  r.run = [=](Io& io) {
    io.be.avgpool2d_fwd(io.in("x", xs), io.out("y", ys), p);
    io.be.avgpool2d_bwd(io.in("dy", ys), io.out("dx", xs), p);
  };
  r.ref = [=](const Io& io, Want& w) {
    w.put("y", ref::avgpool_fwd(g, io.h("x"))), w.put("dx", ref::avgpool_bwd(g, io.h("dy")));
  };
  r.grad = Grad{"y", "dy", {{"x", "dx"}}};
  return r;
}

Row global_row(int64_t N, int64_t H, int64_t W, int64_t C, bool grad) {
  const ref::Pool whole{N, H, W, C, {int(H), int(W), 1, 1, 0, 0}};
  Row r;
  r.family = "pool";
  r.name = fmt::format("global avg pool x[{},{},{},{}]{}", N, H, W, C, grad ? " (gradient check)" : "");
  r.ops = {Op::GlobalAvgPoolFwd, Op::GlobalAvgPoolBwd};
  r.emul = true;
  r.dev_rerun = true;
  r.run = [=](Io& io) {
    const Opts o = ref(Metric::L2, 1e-6);
    io.be.global_avgpool_fwd(io.in("x", {N, H, W, C}), io.out("y", {N, C}, kAct, o));
    io.be.global_avgpool_bwd(io.in("dy", {N, C}), io.out("dx", {N, H, W, C}, kAct, o));
  };
  r.ref = [=](const Io& io, Want& w) {
    w.put("y", ref::avgpool_fwd(whole, io.h("x"))), w.put("dx", ref::avgpool_bwd(whole, io.h("dy")));
  };
  if (grad) r.grad = Grad{"y", "dy", {{"x", "dx"}}};
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  // the CPU tests' windows over x[2,7,9,3] (and their gradient check's), the GPU tests'
  for (const Pool2dParams& p : {Pool2dParams{3, 3, 2, 2, 1, 1}, {2, 2, 2, 2, 0, 0}, {3, 2, 1, 2, 1, 0}, {1, 1, 2, 2, 0, 0}})
    t.push_back(pool_row(2, 7, 9, 3, p, Values::Uniform, false));
  t.push_back(pool_row(2, 7, 6, 3, {3, 3, 2, 2, 1, 1}, Values::Uniform, true));
  t.push_back(avg_grad_row());
  const Pool2dParams gpu_params[] = {{2, 2, 2, 2, 0, 0}, {3, 3, 2, 2, 1, 1}, {3, 3, 1, 1, 1, 1}};
  for (auto [N, H, W, C] : {std::array<int64_t, 4>{2, 13, 10, 19}, {1, 7, 9, 64}, {2, 9, 11, 24}})
    for (const Pool2dParams& p : gpu_params) t.push_back(pool_row(N, H, W, C, p, Values::Distinct, false));
  for (int64_t C : {19, 64})
    for (const Pool2dParams& p : gpu_params) t.push_back(pool_row(2, 11, 9, C, p, Values::Ties, false));
  t.push_back(global_row(2, 7, 9, 3, false));
  t.push_back(global_row(3, 7, 5, 37, false));
  t.push_back(global_row(2, 7, 6, 3, true));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

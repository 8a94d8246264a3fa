// Parity rows: conv2d forward (with and without bias), backward data (overwriting and
// accumulating), backward filter (with and without the bias gradient, overwriting and
// accumulating) on awkward geometries: odd sizes, stride 2, padding, dilation 2, 1x1, 7x7,
// non-square kernels and strides, ResNet's stride-2 1x1 shortcut (oneDNN 2.6's AVX2 1x1
// backward-weights kernel got those wrong on an AVX2-only CPU); on the CPU under oneDNN and
// im2col. And the convolution over cat(a, b) (Op::Conv2dCat, the U-Net decoder's; CUDA splits
// the filter, the CPU concatenates and convolves).
#include <fmt/format.h>

#include "ref_ops.h"
#include "harness.h"
#ifdef DTRAIN_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace dtrain::parity {
namespace {

Conv2dParams cp(int sh, int sw, int ph, int pw, int dh = 1, int dw = 1) {
  Conv2dParams p;
  p.stride_h = sh, p.stride_w = sw, p.pad_h = ph, p.pad_w = pw, p.dil_h = dh, p.dil_w = dw;
  return p;
}
Shape xs(const ref::Conv& g) { return {g.N, g.H, g.W, g.C}; }
Shape ws(const ref::Conv& g) { return {g.O, g.KH, g.KW, g.C}; }
Shape ys(const ref::Conv& g) { return {g.N, g.OH(), g.OW(), g.O}; }

// {N, H, W, C, O, KH, KW, params}
const ref::Conv kConvCases[] = {
    // the CPU tests' geometries
    {2, 7, 5, 3, 4, 3, 3, cp(1, 1, 1, 1)}, {3, 9, 8, 5, 6, 3, 3, cp(2, 2, 1, 1)}, {2, 10, 9, 3, 2, 3, 3, cp(1, 1, 2, 2, 2, 2)},
    {2, 6, 5, 7, 3, 1, 1, cp(1, 1, 0, 0)}, {2, 6, 6, 4, 5, 1, 1, cp(2, 2, 0, 0)}, {1, 11, 13, 3, 4, 7, 7, cp(2, 2, 3, 3)},
    {2, 8, 7, 3, 5, 3, 1, cp(2, 1, 1, 0)}, {2, 5, 9, 2, 3, 1, 5, cp(1, 2, 0, 2, 1, 1)},
    // ResNet's stride-2 1x1 shortcut (oneDNN's AVX2 1x1 backward-weights kernel)
    {4, 8, 8, 4, 8, 1, 1, cp(2, 2, 0, 0)}, {4, 8, 8, 1, 16, 1, 1, cp(2, 2, 0, 0)}, {1, 8, 8, 3, 4, 1, 1, cp(2, 2, 0, 0)},
    // the GPU tests' geometries (cuDNN NHWC, 1x1 convolutions as GEMMs; the stride-2 1x1 goes
    // to cuDNN, and with an odd size some dx pixels get no gradient and keep their value
    // when accumulating)
    {2, 9, 11, 8, 16, 3, 3, cp(1, 1, 1, 1)}, {3, 16, 16, 16, 32, 3, 3, cp(2, 2, 1, 1)}, {2, 7, 7, 32, 24, 1, 1, cp(1, 1, 0, 0)},
    {1, 23, 19, 3, 8, 7, 7, cp(2, 2, 3, 3)}, {2, 12, 12, 8, 8, 3, 3, cp(1, 1, 2, 2, 2, 2)},
    {2, 9, 9, 16, 32, 1, 1, cp(2, 2, 0, 0)},
    // determinism at a size where the CPU's loops split (1 thread vs 2, reruns)
    {16, 14, 14, 32, 32, 3, 3, cp(1, 1, 1, 1)},
};
// the finite-difference gradient checks' geometries
const ref::Conv kGradCases[] = {{2, 6, 5, 3, 4, 3, 3, cp(2, 2, 1, 1)}, {1, 7, 7, 2, 3, 3, 3, cp(1, 1, 2, 2, 2, 2)}};

std::string tag(const ref::Conv& g) {
  return fmt::format("x[{},{},{},{}] w[{},{},{},{}] s{}x{} p{}x{} d{}x{}", g.N, g.H, g.W, g.C, g.O, g.KH, g.KW, g.C,
                     g.p.stride_h, g.p.stride_w, g.p.pad_h, g.p.pad_w, g.p.dil_h, g.p.dil_w);
}

Row conv_row(const ref::Conv& g, bool grad) {
  Row r;
  r.family = "conv";
  r.name = "conv2d fwd / bwd_data / bwd_filter " + tag(g) + (grad ? " (gradient check)" : "");
  r.ops = {Op::Conv2dFwd, Op::Conv2dBwdData, Op::Conv2dBwdFilter};
  r.conv_impls = true;
  r.emul = true;
  r.threads = g.N == 16;
  r.run = [g](Io& io) {
    Tensor x = io.in("x", xs(g)), w = io.in("w", ws(g)), b = io.in("bias", {g.O}), dy = io.in("dy", ys(g));
    Tensor none;
    io.be.conv2d_fwd(x, w, b, io.out("y", ys(g)), g.p);
    io.be.conv2d_fwd(x, w, none, io.out("y_nobias", ys(g)), g.p);
    io.be.conv2d_bwd_data(dy, w, io.out("dx", xs(g)), g.p, false);
    // dx += the gradient (a residual's sum): on the CPU bit-identical to the op then an add (check)
    io.be.conv2d_bwd_data(dy, w, io.inout("dx_acc", xs(g), kAct, -1, 1, no_emul()), g.p, true);
    Tensor dw = io.out("dw", ws(g), kF32, thread_split()), db = io.out("dbias", {g.O}, kF32);
    io.be.conv2d_bwd_filter(x, dy, dw, db, g.p, false);
    Tensor dwa = io.inout("dw_acc", ws(g), kF32, -1, 1, thread_split()), dba = io.inout("dbias_acc", {g.O}, kF32, -1, 1);
    io.be.conv2d_bwd_filter(x, dy, dwa, dba, g.p, true);
    io.be.conv2d_bwd_filter(x, dy, io.out("dw_nobias", ws(g), kF32, thread_split()), none, g.p, false);
  };
  r.ref = [g](const Io& io, Want& w) {
    const HostVec &x = io.h("x"), &wt = io.h("w"), &b = io.h("bias"), &dy = io.h("dy");
    w.put("y", ref::conv2d_fwd(g, x, wt, &b));
    w.put("y_nobias", ref::conv2d_fwd(g, x, wt, nullptr));
    const HostVec dx = ref::conv2d_bwd_data(g, dy, wt), dw = ref::conv2d_bwd_filter(g, x, dy), db = ref::sum_rows(dy, g.O);
    w.put("dx", dx), w.put("dw", dw), w.put("dbias", db), w.put("dw_nobias", dw);
    Vals acc(dx.size()), dwa(dw.size()), dba(db.size());
    for (size_t i = 0; i < dx.size(); ++i) acc[i] = double(io.h("dx_acc")[i]) + dx[i];
    for (size_t i = 0; i < dw.size(); ++i) dwa[i] = double(io.h("dw_acc")[i]) + dw[i];
    for (size_t i = 0; i < db.size(); ++i) dba[i] = double(io.h("dbias_acc")[i]) + db[i];
    w.put("dx_acc", acc), w.put("dw_acc", dwa), w.put("dbias_acc", dba);
  };
  r.check = [](const Io& io, const Outs& o, Report& rep) {
    if (!io.on_cpu()) return;  // CUDA may round the accumulated sum once (cuDNN's beta = 1)
    const Vals &dx = o.at("dx").v, &acc = o.at("dx_acc").v;
    const HostVec& base = io.h("dx_acc");
    size_t bad = 0;
    for (size_t i = 0; i < dx.size(); ++i)
      bad += double(round_to(io.storage(kAct), base[i] + float(dx[i]))) != acc[i];
    rep.compared++;
    if (bad) rep.fail(fmt::format("conv2d_bwd_data accumulate on {} {}: {} values differ from the op then an add",
                                  io.be.name(), dtype_name(io.dt), bad));
  };
  if (grad) r.grad = Grad{"y", "dy", {{"x", "dx"}, {"w", "dw"}, {"bias", "dbias"}}};
  return r;
}

struct CatCase {
  int N, H, W, Ca, Cb, O, k;
};

Row cat_row(const CatCase& c, bool bench) {
  Row r;
  r.family = "conv";
  r.name = fmt::format("conv2d over cat(a b) a[{},{},{},{}] b[..,{}] O={} k={}{}", c.N, c.H, c.W, c.Ca, c.Cb, c.O, c.k,
                       bench ? " (cudnn_benchmark)" : "");
  r.ops = {Op::Conv2dCat, Op::ConcatChannels, Op::SplitChannels, Op::Conv2dFwd, Op::Conv2dBwdData, Op::Conv2dBwdFilter};
  r.same_dtype = true;
  r.cpu = !bench;
  Conv2dParams p;
  p.pad_h = p.pad_w = c.k / 2;
  const Shape as{c.N, c.H, c.W, c.Ca}, bs{c.N, c.H, c.W, c.Cb}, xs{c.N, c.H, c.W, c.Ca + c.Cb};
  const Shape ws{c.O, c.k, c.k, c.Ca + c.Cb}, ys{c.N, c.H, c.W, c.O};
  r.run = [=](Io& io) {
    const Opts o = dev(Metric::L2, 2e-5, 2e-2, 4e-3);
    // f32 master gradient; CUDA rounds a 16-bit filter gradient to the dtype before widening it
    const Opts ow = dev(Metric::L2, 1e-4, 2e-2, 4e-3);
    Tensor a = io.in("a", as), b = io.in("b", bs), w = io.in("w", ws, kAct, -0.2f, 0.2f), dy = io.in("dy", ys);
    Tensor y = io.out("y", ys, kAct, o), da = io.out("da", as, kAct, o), db = io.out("db", bs, kAct, o);
    Tensor dw = io.inout("dw", ws, kF32, -1, 1, ow);
    if (io.be.supports(Op::Conv2dCat, io.dt)) {  // never concatenated
      io.be.conv2d_fwd_cat(a, b, w, y, p);
      io.be.conv2d_bwd_data_cat(dy, w, da, db, p);
      io.be.conv2d_bwd_filter_cat(a, b, dy, dw, p, true);
    } else {  // the definition: concatenate, then the plain ops
      Tensor x = io.temp(xs), dx = io.temp(xs), none;
      io.be.concat_channels(a, b, x);
      io.be.conv2d_fwd(x, w, none, y, p);
      io.be.conv2d_bwd_data(dy, w, dx, p, false);
      io.be.split_channels(dx, da, db);
      io.be.conv2d_bwd_filter(x, dy, dw, none, p, true);
    }
  };
  r.ref = [=](const Io& io, Want& w) {
    const ref::Conv g{c.N, c.H, c.W, c.Ca + c.Cb, c.O, c.k, c.k, p};
    const HostVec &a = io.h("a"), &b = io.h("b");
    HostVec x(size_t(xs.numel()));
    for (size_t px = 0; px < size_t(c.N * c.H * c.W); ++px) {
      for (int k = 0; k < c.Ca; ++k) x[px * size_t(c.Ca + c.Cb) + size_t(k)] = a[px * size_t(c.Ca) + size_t(k)];
      for (int k = 0; k < c.Cb; ++k) x[px * size_t(c.Ca + c.Cb) + size_t(c.Ca + k)] = b[px * size_t(c.Cb) + size_t(k)];
    }
    w.put("y", ref::conv2d_fwd(g, x, io.h("w"), nullptr));
    const HostVec dx = ref::conv2d_bwd_data(g, io.h("dy"), io.h("w"));
    HostVec da, db;
    for (size_t px = 0; px < size_t(c.N * c.H * c.W); ++px) {
      for (int k = 0; k < c.Ca; ++k) da.push_back(dx[px * size_t(c.Ca + c.Cb) + size_t(k)]);
      for (int k = 0; k < c.Cb; ++k) db.push_back(dx[px * size_t(c.Ca + c.Cb) + size_t(c.Ca + k)]);
    }
    w.put("da", da), w.put("db", db);
    const HostVec dw = ref::conv2d_bwd_filter(g, x, io.h("dy"));
    Vals acc(dw.size());
    for (size_t i = 0; i < dw.size(); ++i) acc[i] = double(io.h("dw")[i]) + dw[i];
    w.put("dw", acc);
  };
  r.setup = [bench](Backend& be, bool on) {  // the second pass times cuDNN's algorithms for each half
#ifdef DTRAIN_WITH_CUDA
    if (auto* cu = dynamic_cast<CudaBackend*>(&be)) cu->set_cudnn_benchmark(on && bench);
#else
    (void)be, (void)on, (void)bench;
#endif
  };
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  for (const ref::Conv& g : kConvCases) t.push_back(conv_row(g, false));
  for (const ref::Conv& g : kGradCases) t.push_back(conv_row(g, true));
  for (const CatCase& c : {CatCase{2, 16, 16, 32, 32, 32, 3}, {1, 9, 7, 8, 16, 24, 3}, {2, 8, 8, 16, 16, 8, 1}})
    for (bool bench : {false, true}) t.push_back(cat_row(c, bench));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

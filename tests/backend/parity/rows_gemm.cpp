// Parity rows: gemm (every transpose, alpha/beta, odd sizes and a split by rows and by
// columns on the CPU), the Linear layer's fused forms: gemm_bias, gemm_bias_gelu,
// gemm_dgelu (cuBLASLt epilogues on CUDA) and linear_wgrad (bias gradient in the same GEMM);
// TF32 on CUDA; gemm's gradient by finite differences.
#include <cmath>

#include <fmt/format.h>

#include "ref_ops.h"
#include "harness.h"
#ifdef DTRAIN_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace dtrain::parity {
namespace {

double gelu(double v) { return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))); }
double dgelu(double v) {
  const double k = std::sqrt(2 / M_PI), u = k * (v + 0.044715 * v * v * v), th = std::tanh(u);
  return 0.5 * (1 + th) + 0.5 * v * (1 - th * th) * k * (1 + 3 * 0.044715 * v * v);
}

struct Mnk {
  int64_t M, N, K;
};

std::vector<Row> make() {
  std::vector<Row> t;
  auto row = [&](std::string name) -> Row& {
    Row r;
    r.family = "gemm";
    r.name = std::move(name);
    r.ops = {Op::Gemm};
    t.push_back(std::move(r));
    return t.back();
  };
  // the CPU tests' sizes (1e-6 against the reference; 130x67: split by rows, 3x200: by
  // columns) and the GPU tests' (tile edges; 1 row), every transpose
  struct Case {
    Mnk s;
    float alpha, beta;
    double ref_tol;
  };
  std::vector<Case> cases;
  for (Mnk s : {Mnk{7, 5, 9}, {33, 65, 17}, {1, 3, 1}, {130, 67, 45}, {3, 200, 400}}) cases.push_back({s, 1.5f, 0.5f, 1e-6});
  for (Mnk s : {Mnk{37, 53, 71}, {1, 129, 64}, {128, 256, 96}, {300, 7, 513}})
    for (float beta : {0.f, 0.5f}) cases.push_back({s, 1.25f, beta, 1e-5});
  for (const Case& c : cases)
    for (int tr = 0; tr < 4; ++tr) {
      const bool ta = tr & 1, tb = tr & 2;
      const auto [M, N, K] = c.s;
      Row& r = row(fmt::format("gemm M={} N={} K={} ta={} tb={} alpha={} beta={}", M, N, K, ta, tb, c.alpha, c.beta));
      r.ops = {Op::Gemm, Op::AddBias};
      r.emul = c.ref_tol == 1e-6 && tr == 0;
      r.run = [=](Io& io) {
        Tensor a = io.in("a", ta ? Shape{K, M} : Shape{M, K}), b = io.in("b", tb ? Shape{N, K} : Shape{K, N});
        Tensor y = c.beta == 0.f ? io.out("c", {M, N}, kAct, ref(Metric::L2, c.ref_tol))
                                 : io.inout("c", {M, N}, kAct, -1, 1, ref(Metric::L2, c.ref_tol));
        io.be.gemm(ta, tb, c.alpha, a, b, c.beta, y);
        // the Linear forward: c = op(a) op(b) + bias (cuBLASLt's bias epilogue on CUDA)
        Tensor yb = io.out("gemm_bias", {M, N}, kAct, no_emul());  // 16-bit: rounded after the gemm and the add
        io.be.gemm_bias(ta, tb, a, b, io.in("bias", {N}), yb);
      };
      r.ref = [=](const Io& io, Want& w) {
        HostVec y = c.beta == 0.f ? HostVec(size_t(M * N)) : io.h("c"), yb(size_t(M * N));
        ref::gemm(ta, tb, M, N, K, c.alpha, io.h("a"), io.h("b"), c.beta, y);
        ref::gemm(ta, tb, M, N, K, 1.0, io.h("a"), io.h("b"), 0.0, yb);
        for (size_t i = 0; i < yb.size(); ++i) yb[i] += io.h("bias")[i % size_t(N)];
        w.put("c", y), w.put("gemm_bias", yb);
      };
    }
  {  // TF32 (opt-in on CUDA): the same answer within TF32's 10-bit mantissa
    Row& r = row("gemm M=256 N=384 K=512 with TF32 allowed");
    r.dtypes = {DType::F32};
    r.run = [](Io& io) {
      Tensor y = io.out("c", {256, 384}, kF32, dev(Metric::Max, 5e-3, 5e-3, 5e-3));
      io.be.gemm(false, false, 1.f, io.in("a", {256, 512}), io.in("b", {512, 384}), 0.f, y);
    };
    r.ref = [](const Io& io, Want& w) {
      HostVec y(256 * 384);
      ref::gemm(false, false, 256, 384, 512, 1.0, io.h("a"), io.h("b"), 0.0, y);
      w.put("c", y);
    };
    r.setup = [](Backend& be, bool on) {
#ifdef DTRAIN_WITH_CUDA
      if (auto* cu = dynamic_cast<CudaBackend*>(&be)) cu->set_allow_tf32(on);
#else
      (void)be, (void)on;
#endif
    };
  }
  {  // the gradient of c = a b^T: da = r b, db = r^T a (gemm calls), by finite differences
    Row& r = row("gemm c = a b^T and its gradients M=5 N=4 K=7");
    r.run = [](Io& io) {
      Tensor a = io.in("a", {5, 7}), b = io.in("b", {4, 7}), dc = io.in("r", {5, 4});
      Tensor c = io.out("c", {5, 4}), da = io.out("da", {5, 7}), db = io.out("db", {4, 7});
      io.be.gemm(false, true, 1.f, a, b, 0.f, c);
      io.be.gemm(false, false, 1.f, dc, b, 0.f, da);
      io.be.gemm(true, false, 1.f, dc, a, 0.f, db);
    };
    r.ref = [](const Io& io, Want& w) {
      HostVec c(20), da(35), db(28);
      ref::gemm(false, true, 5, 4, 7, 1.0, io.h("a"), io.h("b"), 0.0, c);
      ref::gemm(false, false, 5, 7, 4, 1.0, io.h("r"), io.h("b"), 0.0, da);
      ref::gemm(true, false, 4, 7, 5, 1.0, io.h("r"), io.h("a"), 0.0, db);
      w.put("c", c), w.put("da", da), w.put("db", db);
    };
    r.grad = Grad{"c", "r", {{"a", "da"}, {"b", "db"}}};
  }
  // GPT's MLP: pre = x W + bias, y = gelu(pre); the next Linear's backward dpre =
  // gelu'(pre) * (dy W'^T). GPT-2's Conv1D weights are [in, out], so GPT calls
  // gemm_bias_gelu with trans_b = false and gemm_dgelu with trans_b = true; the other
  // combination is a Linear's [out, in]. N = 3072 and 96 take CUDA's fused epilogues, N = 36
  // (not a multiple of 8) falls back to gemm + gelu there too. Both sides store the same dtype.
  for (auto [M, K, N] : {Mnk{64, 768, 3072}, {37, 64, 96}, {9, 20, 36}})
    for (bool gpt : {true, false}) {
      const bool fwd_tb = !gpt, bwd_tb = gpt;
      Row& r = row(fmt::format("gemm_bias_gelu (trans_b {}) and gemm_dgelu (trans_b {}) M={} K={} N={}", fwd_tb,
                               bwd_tb, M, K, N));
      r.ops = {Op::Gemm, Op::GeluFwd, Op::GeluBwd};
      r.same_dtype = true;
      r.dev_rerun = true;
      r.run = [=](Io& io) {
        // f32: a K-term sum in another order (no TF32: precision.tf32 is off by default)
        Opts o = dev(Metric::L2, 1e-5, 1e-2, 2e-3);
        o.rerun = false;  // only the gradient's rerun is required to be bit-identical
        const Shape ws = fwd_tb ? Shape{N, K} : Shape{K, N}, w2s = bwd_tb ? Shape{N, K} : Shape{K, N};
        Tensor x = io.in("x", {M, K}), w = io.in("w", ws, kAct, -0.1f, 0.1f), b = io.in("bias", {N}, kAct, -0.5f, 0.5f);
        Tensor pre = io.out("pre", {M, N}, kAct, o), y = io.out("gelu", {M, N}, kAct, o);
        io.be.gemm_bias_gelu(false, fwd_tb, x, w, b, pre, y);
        Tensor dy = io.in("dy", {M, K}), w2 = io.in_vals("w2", w2s, kAct, io.h("w"));
        Tensor dpre = io.out("dgelu", {M, N}, kAct, dev(Metric::L2, 1e-5, 1e-2, 2e-3));
        io.be.gemm_dgelu(false, bwd_tb, dy, w2, pre, dpre);
      };
      r.ref = [=](const Io& io, Want& w) {
        HostVec pre(size_t(M * N)), g(size_t(M * N)), d(size_t(M * N));
        ref::gemm(false, fwd_tb, M, N, K, 1.0, io.h("x"), io.h("w"), 0.0, pre);
        ref::gemm(false, bwd_tb, M, N, K, 1.0, io.h("dy"), io.h("w2"), 0.0, d);
        std::vector<double> p(pre.size());
        for (size_t i = 0; i < pre.size(); ++i) p[i] = double(pre[i]) + io.h("bias")[i % size_t(N)];
        Vals pv(p.begin(), p.end()), gv(p.size()), dv(p.size());
        for (size_t i = 0; i < p.size(); ++i) gv[i] = gelu(p[i]), dv[i] = dgelu(p[i]) * d[i];
        w.put("pre", pv), w.put("gelu", gv), w.put("dgelu", dv);
      };
    }
  // A Linear's weight and bias gradients (linear_wgrad, called twice: both accumulate into
  // the f32 master gradients); CUDA computes the bias gradient in the weight GEMM (BGRADA
  // for [in,out] weights, BGRADB for [out,in]).
  for (auto [M, in, out] : {Mnk{256, 768, 2304}, {37, 64, 96}, {9, 20, 36}})
    for (bool in_out : {true, false}) {
      Row& r = row(fmt::format("linear_wgrad M={} in={} out={} in_out={}", M, in, out, in_out));
      r.ops = {Op::Gemm, Op::SumRows};
      r.same_dtype = true;
      r.run = [=](Io& io) {
        const Opts o = dev(Metric::L2, 1e-4, 1e-4, 1e-4);
        Tensor dy = io.in("dy", {M, out}), x = io.in("x", {M, in});
        Tensor dw = io.inout("dw", in_out ? Shape{in, out} : Shape{out, in}, kF32, -1, 1, o);
        Tensor db = io.inout("dbias", {out}, kF32, -1, 1, o);
        io.be.linear_wgrad(dy, x, in_out, dw, db);
        io.be.linear_wgrad(dy, x, in_out, dw, db);
      };
      r.ref = [=](const Io& io, Want& w) {
        HostVec g(size_t(in * out));
        if (in_out)
          ref::gemm(true, false, in, out, M, 1.0, io.h("x"), io.h("dy"), 0.0, g);
        else
          ref::gemm(true, false, out, in, M, 1.0, io.h("dy"), io.h("x"), 0.0, g);
        const HostVec s = ref::sum_rows(io.h("dy"), out);
        Vals dw(g.size()), db(s.size());
        for (size_t i = 0; i < g.size(); ++i) dw[i] = io.h("dw")[i] + 2.0 * g[i];
        for (size_t i = 0; i < s.size(); ++i) db[i] = io.h("dbias")[i] + 2.0 * s[i];
        w.put("dw", dw), w.put("dbias", db);
      };
    }
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

// Parity rows: GELU (tanh) forward and backward, token + position embedding forward and
// backward (repeated ids, unused rows, accumulating and not; and without a position embedding,
// as the Llama family), one incremental-decoding step of attention against a K/V cache
// (multi-head, grouped-query and multi-query).
#include <cmath>

#include <fmt/format.h>

#include "harness.h"

namespace dtrain::parity {
namespace {

double gelu(double v) { return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))); }
double dgelu(double v) {
  const double k = std::sqrt(2 / M_PI), th = std::tanh(k * (v + 0.044715 * v * v * v));
  return 0.5 * (1 + th) + 0.5 * v * (1 - th * th) * k * (1 + 3 * 0.044715 * v * v);
}

Row gelu_row(int64_t M, int64_t C, float lo, float hi, bool grad) {
  Row r;
  r.family = "gpt";
  r.name = fmt::format("gelu fwd / bwd x[{},{}] in [{},{}){}", M, C, lo, hi, grad ? " (gradient check)" : "");
  r.ops = {Op::GeluFwd, Op::GeluBwd};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.emul = true;
  r.run = [=](Io& io) {
    const Opts o = dev(Metric::L2, 1e-5, 1e-2, 2e-3, ref(Metric::Approx, 1e-5));
    Tensor x = io.in("x", {M, C}, kAct, lo, hi);
    io.be.gelu_fwd(x, io.out("y", {M, C}, kAct, o));
    io.be.gelu_bwd(x, io.in("dy", {M, C}), io.out("dx", {M, C}, kAct, o));
  };
  r.ref = [](const Io& io, Want& w) {
    const HostVec &x = io.h("x"), &dy = io.h("dy");
    Vals y(x.size()), dx(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = gelu(x[i]), dx[i] = dgelu(x[i]) * dy[i];
    w.put("y", y), w.put("dx", dx);
  };
  if (grad) r.grad = Grad{"y", "dy", {{"x", "dx"}}};
  return r;
}

// y[b,t] = wte[ids[b,t]] + wpe[t]; the backward scatters dy into dwte / dwpe (f32)
struct Emb {
  int64_t B, T, C, V, Tmax;
  int id_step;  // ids are below(5) * id_step: repeats, and unused rows between them
  double tol;   // across backends for the f32 gradients
  bool wpe = true;  // false: no position embedding (wpe and dwpe undefined)
};

Row emb_row(const Emb& e, bool grad) {
  Row r;
  r.family = "gpt";
  r.name = fmt::format("embedding fwd / bwd B={} T={} C={} V={} Tmax={} ids step {}{}{}", e.B, e.T, e.C, e.V, e.Tmax, e.id_step,
                       e.wpe ? "" : " no wpe", grad ? " (gradient check)" : "");
  r.ops = {Op::EmbeddingFwd, Op::EmbeddingBwd};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.emul = true;
  r.run = [=](Io& io) {
    const Opts f = dev(Metric::L2, e.tol, e.tol, e.tol, ref(Metric::L2, 1e-6));
    IntVec ids(size_t(e.B * e.T));
    Rng rg = io.rng("ids");
    for (auto& i : ids) i = int32_t(rg.below(5)) * e.id_step;
    Tensor tid = io.ids("ids", {e.B, e.T}, ids);
    Tensor wte = io.in("wte", {e.V, e.C}, kF32), wpe = e.wpe ? io.in("wpe", {e.Tmax, e.C}, kF32) : Tensor();
    io.be.embedding_fwd(tid, wte, wpe, io.out("y", {e.B, e.T, e.C}, kAct, dev(Metric::L2, 1e-5, 1e-5, 1e-5, ref(Metric::Bits, 0))));
    Tensor dy = io.in("dy", {e.B, e.T, e.C}), none;
    io.be.embedding_bwd(dy, tid, io.out("dwte", {e.V, e.C}, kF32, f), e.wpe ? io.out("dwpe", {e.Tmax, e.C}, kF32, f) : none, false);
    io.be.embedding_bwd(dy, tid, io.inout("dwte_acc", {e.V, e.C}, kF32, -1, 1, f),
                        e.wpe ? io.inout_vals("dwpe_acc", {e.Tmax, e.C}, kF32, HostVec(size_t(e.Tmax * e.C), 1.f), f) : none, true);
  };
  r.ref = [=](const Io& io, Want& w) {
    const HostVec zeros(size_t(e.Tmax * e.C), 0.f);
    const HostVec &wte = io.h("wte"), &wpe = e.wpe ? io.h("wpe") : zeros, &dy = io.h("dy");
    const IntVec& ids = io.hi("ids");
    HostVec y(size_t(e.B * e.T * e.C));
    Vals dwte(size_t(e.V * e.C), 0.0), dwpe(size_t(e.Tmax * e.C), 0.0);
    for (int64_t i = 0; i < e.B * e.T; ++i)
      for (int64_t j = 0; j < e.C; ++j) {
        const size_t k = size_t(i * e.C + j), te = size_t(ids[size_t(i)] * e.C + j), pe = size_t((i % e.T) * e.C + j);
        y[k] = wte[te] + wpe[pe];
        dwte[te] += dy[k], dwpe[pe] += dy[k];
      }
    Vals ta = dwte, pa = dwpe;
    for (size_t k = 0; k < ta.size(); ++k) ta[k] += io.h("dwte_acc")[k];
    for (double& v : pa) v += 1.0;
    w.put("y", y), w.put("dwte", dwte), w.put("dwte_acc", ta);
    if (e.wpe) w.put("dwpe", dwpe), w.put("dwpe_acc", pa);
  };
  if (grad && e.wpe) r.grad = Grad{"y", "dy", {{"wte", "dwte"}, {"wpe", "dwpe"}}, {}, nullptr, true};
  if (grad && !e.wpe) r.grad = Grad{"y", "dy", {{"wte", "dwte"}}, {}, nullptr, true};
  return r;
}

// attention_decode: position `pos` of a K/V cache [B,Hkv,Tmax,hs] (earlier rows hold keys and
// values already), out [B,C]; query head h reads cache head h / (H / Hkv)
Row decode_row(int64_t B, int64_t H, int64_t hs, int64_t Tmax, int64_t pos, int64_t Hkv = 0) {
  if (Hkv == 0) Hkv = H;
  const int64_t C = H * hs, W = (H + 2 * Hkv) * hs, g = H / Hkv;
  Row r;
  r.family = "gpt";
  r.name = fmt::format("attention_decode B={} H={}{} hs={} Tmax={} pos={}", B, H, Hkv == H ? "" : fmt::format(" Hkv={}", Hkv),
                       hs, Tmax, pos);
  r.ops = {Op::AttentionDecode};
  r.same_dtype = true;
  r.dev_rerun = true;
  r.run = [=](Io& io) {
    const Opts cache = dev(Metric::Max, 0, 0, 0, ref(Metric::Bits, 0));
    Tensor qkv = io.in("qkv", {B, W}, kAct, -1.5f, 1.5f);
    Tensor k = io.inout("kcache", {B, Hkv, Tmax, hs}, kAct, -1.5f, 1.5f, cache);
    Tensor v = io.inout("vcache", {B, Hkv, Tmax, hs}, kAct, -1.f, 1.f, cache);
    io.be.attention_decode(qkv, k, v, pos, io.out("out", {B, C}, kAct, dev(Metric::L2, 1e-5, 1e-2, 2e-3)), int(H), int(Hkv));
  };
  r.ref = [=](const Io& io, Want& w) {
    const HostVec& q = io.h("qkv");
    HostVec K = io.h("kcache"), V = io.h("vcache");
    Vals out(size_t(B * C));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kv = 0; kv < Hkv; ++kv)
        for (int64_t j = 0; j < hs; ++j) {
          const size_t at = size_t((b * Hkv + kv) * Tmax * hs + pos * hs + j);
          K[at] = q[size_t(b * W + C + kv * hs + j)];
          V[at] = q[size_t(b * W + C + (Hkv + kv) * hs + j)];
        }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const size_t base = size_t((b * Hkv + h / g) * Tmax * hs);
        std::vector<double> s(size_t(pos + 1));
        double mx = -1e300, se = 0;
        for (int64_t t = 0; t <= pos; ++t) {
          double d = 0;
          for (int64_t j = 0; j < hs; ++j) d += double(q[size_t(b * W + h * hs + j)]) * K[base + size_t(t * hs + j)];
          s[size_t(t)] = d / std::sqrt(double(hs)), mx = std::max(mx, s[size_t(t)]);
        }
        for (double& x : s) se += x = std::exp(x - mx);
        for (int64_t j = 0; j < hs; ++j) {
          double o = 0;
          for (int64_t t = 0; t <= pos; ++t) o += s[size_t(t)] / se * V[base + size_t(t * hs + j)];
          out[size_t(b * C + h * hs + j)] = o;
        }
      }
    w.put("kcache", K), w.put("vcache", V), w.put("out", out);
  };
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  // the GPT ops test's sizes (and its gradient check over [-4, 4)), the CUDA kernels' paths
  t.push_back(gelu_row(5, 10, -4, 4, true));
  t.push_back(gelu_row(14, 12, -2, 2, false));
  for (auto [M, C] : {std::pair<int64_t, int64_t>{37, 768}, {9, 20}, {4, 2056}, {64, 64}}) t.push_back(gelu_row(M, C, -2, 2, false));
  // GPT ops: B=2 T=7 C=12 V=21, ids 0..16 step 4; the CUDA kernels' sort-based backward:
  // M positions as [1, M], V = 11, ids 0, 2, .., 8 (odd rows unused)
  t.push_back(emb_row({2, 7, 12, 21, 10, 4, 1e-5}, true));
  for (auto [M, C] : {std::pair<int64_t, int64_t>{37, 768}, {9, 20}, {4, 2056}, {64, 64}})
    t.push_back(emb_row({1, M, C, 11, M, 2, 1e-4}, false));
  // no position embedding (the Llama family)
  t.push_back(emb_row({2, 7, 12, 21, 10, 4, 1e-5, false}, true));
  t.push_back(emb_row({1, 37, 768, 11, 37, 2, 1e-4, false}, false));
  for (int64_t pos : {0, 5, 8}) t.push_back(decode_row(2, 3, 4, 9, pos));
  t.push_back(decode_row(1, 2, 64, 130, 128));
  t.push_back(decode_row(3, 12, 64, 40, 17));
  // grouped-query (2 query heads a cache head) and multi-query
  for (int64_t pos : {0, 7}) t.push_back(decode_row(2, 4, 8, 9, pos, 2));
  t.push_back(decode_row(1, 6, 64, 70, 66, 1));
  t.push_back(decode_row(2, 8, 32, 20, 11, 2));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

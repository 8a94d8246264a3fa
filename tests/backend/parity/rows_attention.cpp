// Parity rows: causal multi-head attention, forward and backward. The CPU saves the
// probabilities; CUDA runs flash attention (flash_attn.cu) for bf16/f16 with head sizes 16,
// 32, 64 and 128 (saving the log-sum-exp of each row, checked against a double reference)
// and the probabilities path otherwise (hs = 24 here). Partial tiles: T = 1, 17, 100, 257...
//
// Tolerance across backends: relative L2 error of out and of each of dq, dk, dv (slices of
// dqkv) <= 4u, u = 2^-8 (bf16) or 2^-11 (f16). The outputs are rounded to 16 bits (error
// ~u/2 per element alone), and the kernels round P and dS to 16 bits before their products,
// as FlashAttention does. A host simulation of the kernels' loops and rounding points against
// an f64 reference (scripts/flash_emu) gave 0.4u-1.1u on these shapes (softmax inputs up to
// |q.k|/sqrt(hs) ~ 6); 4u leaves room for the GPU's summation order. The probabilities path
// (16-bit scores and probabilities stored in [B,H,T,T]) gets 8u.
//
// Grouped-query rows (Hkv < H key/value heads; Hkv = 1: multi-query) check the GQA layout
// qkv [B,T,(H + 2 Hkv) hs] on both paths, a key/value head's gradient summing its query heads'.
// Packed rows (doc_pos: documents of 1 to 70 tokens, some across the 64-row tiles) check the
// block-diagonal mask of variable-length attention on both paths and in the gradient check.
#include <cmath>

#include <fmt/format.h>

#include "harness.h"

namespace dtrain::parity {
namespace {

// The column of value j of query head h's q (part 0), k (1) or v (2) in a qkv row of H query and
// Hkv key/value heads.
int64_t qkv_col(int64_t H, int64_t Hkv, int64_t hs, int part, int64_t h, int64_t j) {
  return part == 0 ? h * hs + j : H * hs + (part - 1) * Hkv * hs + h / (H / Hkv) * hs + j;
}

// Packed documents' positions [B,T]: lengths cycling through a list (a different start per row),
// the last one cut by the row's end.
IntVec doc_positions(int64_t B, int64_t T) {
  static const int64_t lens[] = {5, 1, 13, 64, 7, 70, 2, 30};
  IntVec p;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0, d = b, i = 0; t < T; ++t, ++i) {
      if (i == lens[d % 8]) i = 0, ++d;
      p.push_back(int32_t(i));
    }
  return p;
}

// out [B,T,C] and the probabilities [B,H,T,T] (zero above the diagonal and, with document
// positions, left of each token's document) in double
void attention_ref(const HostVec& qkv, int64_t B, int64_t T, int64_t H, int64_t hs, Vals& out, Vals& probs, Vals& lse,
                   int64_t Hkv, const IntVec& docpos = {}) {
  const int64_t C = H * hs, W = (H + 2 * Hkv) * hs;
  out.assign(size_t(B * T * C), 0.0), probs.assign(size_t(B * H * T * T), 0.0), lse.assign(size_t(B * H * T), 0.0);
  auto at = [&](int64_t b, int64_t t, int part, int64_t h, int64_t j) {
    return double(qkv[size_t((b * T + t) * W + qkv_col(H, Hkv, hs, part, h, j))]);
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t lo = docpos.empty() ? 0 : t - docpos[size_t(b * T + t)];
        std::vector<double> s(size_t(t + 1));
        double mx = -1e300, se = 0;
        for (int64_t u = lo; u <= t; ++u) {
          double d = 0;
          for (int64_t j = 0; j < hs; ++j) d += at(b, t, 0, h, j) * at(b, u, 1, h, j);
          s[size_t(u)] = d / std::sqrt(double(hs)), mx = std::max(mx, s[size_t(u)]);
        }
        for (int64_t u = lo; u <= t; ++u) se += std::exp(s[size_t(u)] - mx);
        lse[size_t((b * H + h) * T + t)] = mx + std::log(se);
        for (int64_t u = lo; u <= t; ++u) {
          const double p = std::exp(s[size_t(u)] - mx) / se;
          probs[size_t(((b * H + h) * T + t) * T + u)] = p;
          for (int64_t j = 0; j < hs; ++j) out[size_t((b * T + t) * C + h * hs + j)] += p * at(b, u, 2, h, j);
        }
      }
}

Vals part(const Vals& x, int64_t qw, int64_t kvw, int p) {  // q, k or v of rows [q (qw) | k (kvw) | v (kvw)]
  Vals out;
  const size_t W = size_t(qw + 2 * kvw), lo = p == 0 ? 0 : size_t(qw + (p - 1) * kvw), n = size_t(p == 0 ? qw : kvw);
  for (size_t r = 0; r < x.size() / W; ++r) out.insert(out.end(), x.begin() + long(r * W + lo), x.begin() + long(r * W + lo + n));
  return out;
}

bool flash_head(int64_t hs) { return hs == 16 || hs == 32 || hs == 64 || hs == 128; }

Row attention_row(int64_t B, int64_t T, int64_t H, int64_t hs, std::vector<DType> dtypes, bool grad, int64_t Hkv = 0,
                  bool packed = false) {
  if (Hkv == 0) Hkv = H;
  const int64_t C = H * hs, W = (H + 2 * Hkv) * hs;
  const bool f32 = dtypes == std::vector<DType>{DType::F32};
  Row r;
  r.family = "attention";
  r.name = fmt::format("attention fwd / bwd B={} T={} H={}{} hs={}{}{}{}", B, T, H, Hkv == H ? "" : fmt::format(" Hkv={}", Hkv), hs,
                       f32 ? "" : flash_head(hs) ? " (flash)" : " (probabilities)", packed ? " packed documents" : "",
                       grad ? " (gradient check)" : "");
  r.ops = {Op::AttentionFwd, Op::AttentionBwd};
  r.dtypes = dtypes;
  r.dev_rerun = true;
  r.cpu = T < 1024;
  const double k = flash_head(hs) ? 4 : 8;
  const Opts o = f32 ? dev(Metric::L2, 1e-5, 1e-5, 1e-5) : dev(Metric::L2, 1e-5, k * std::ldexp(1.0, -8), k * std::ldexp(1.0, -11));
  r.run = [=](Io& io) {
    Tensor qkv = io.in("qkv", {B, T, W}, kAct, -1.5f, 1.5f), dout = io.in("dout", {B, T, C});
    const Tensor dp = packed ? io.ids("doc_pos", {B, T}, doc_positions(B, T)) : Tensor();
    const AttentionSaved sv = io.be.attention_saved(B, H, T, hs, io.storage(kAct));
    const bool probs = sv.shape.ndim() == 4;
    Opts so = o;
    so.cross = f32;  // 16-bit: backend-specific (the CPU's probabilities, flash's log-sum-exp)
    Tensor saved = io.out(probs ? "probs" : "lse", sv.shape, sv.dtype == io.storage(kAct) ? kAct : fixed(sv.dtype), so);
    Tensor out = io.out("out", {B, T, C}, kAct, o);
    io.be.attention_fwd(qkv, out, saved, int(H), int(Hkv), dp);
    Opts dq = o;
    dq.cross = f32;  // 16-bit: compared as the slices dq, dk, dv
    io.be.attention_bwd(dout, qkv, out, saved, io.out("dqkv", {B, T, W}, kAct, dq), int(H), int(Hkv), dp);
    if (!f32)
      for (int p = 0; p < 3; ++p) {
        Opts po = o;
        if (T == 1 && p < 2) {
          // T = 1: dq = dk = 0 exactly (dS = P (dP - D) with P = 1 and D = dP); the kernels
          // get D from the rounded output, so only rounding noise remains
          po = may_be_zero(dev(Metric::Abs, 1e-3, 1e-3, 1e-3, ref(Metric::Abs, 1e-3)));
        }
        io.derive(p == 0 ? "dq" : p == 1 ? "dk" : "dv", po,
                  [C, kvw = Hkv * hs, p](const Outs& os) { return part(os.at("dqkv").v, C, kvw, p); });
      }
  };
  r.ref = [=](const Io& io, Want& w) {
    Vals out, probs, lse;
    attention_ref(io.h("qkv"), B, T, H, hs, out, probs, lse, Hkv, packed ? io.hi("doc_pos") : IntVec{});
    w.put("out", out), w.put("probs", probs);
  };
  r.check = [=](const Io& io, const Outs& os, Report& rep) {
    rep.compared++;
    const AttentionSaved sv = io.be.attention_saved(B, H, T, hs, io.storage(kAct));
    const bool flash = !io.on_cpu() && io.storage(kAct) != DType::F32 && flash_head(hs);
    const bool ok = flash ? sv.dtype == DType::F32 && sv.shape == Shape{B, H, T}
                          : sv.dtype == io.storage(kAct) && sv.shape == Shape{B, H, T, T};
    if (!ok) rep.fail(fmt::format("{} {}: attention_saved gives {} {}", io.be.name(), dtype_name(io.dt), dtype_name(sv.dtype), sv.shape.str()));
    if (!os.count("lse")) return;
    Vals out, probs, lse;  // the saved log-sum-exp itself
    attention_ref(io.h("qkv"), B, T, H, hs, out, probs, lse, Hkv, packed ? io.hi("doc_pos") : IntVec{});
    double worst = 0;
    for (size_t i = 0; i < lse.size(); ++i) worst = std::max(worst, std::fabs(os.at("lse").v[i] - lse[i]));
    if (!(worst <= 1e-3)) rep.fail(fmt::format("{} {}: log-sum-exp off by {}", io.be.name(), dtype_name(io.dt), worst));
  };
  if (grad) r.grad = Grad{"out", "dout", {{"qkv", "dqkv"}}};
  return r;
}

std::vector<Row> make() {
  std::vector<Row> t;
  t.push_back(attention_row(2, 7, 3, 4, {DType::F32}, true));  // GPT ops: C = 12, H = 3
  // hs = 24 is not a flash head size: the probabilities path, for comparison
  struct Case {
    int64_t B, T, H, hs;
  };
  for (const Case& c : {Case{1, 1, 2, 64}, {2, 17, 3, 64}, {1, 64, 2, 64}, {2, 100, 2, 64}, {1, 257, 2, 64}, {2, 1024, 2, 64},
                        {2, 130, 4, 32}, {1, 77, 2, 128}, {2, 33, 2, 16}, {3, 65, 1, 16}, {2, 50, 2, 24}})
    t.push_back(attention_row(c.B, c.T, c.H, c.hs, {DType::BF16, DType::F16}, false));
  // grouped-query and multi-query: the gradient check in f32 (a key/value head read by 2 and 3
  // query heads), the flash and the probabilities paths in 16 bits, partial tiles
  t.push_back(attention_row(2, 7, 4, 4, {DType::F32}, true, 2));
  t.push_back(attention_row(1, 6, 3, 4, {DType::F32}, true, 1));
  struct GqaCase {
    int64_t B, T, H, Hkv, hs;
  };
  for (const GqaCase& c : {GqaCase{2, 17, 4, 2, 64}, {1, 130, 8, 2, 32}, {2, 65, 3, 1, 16}, {1, 100, 4, 1, 128},
                           {2, 50, 4, 2, 24}, {1, 33, 6, 3, 24}})
    t.push_back(attention_row(c.B, c.T, c.H, c.hs, {DType::BF16, DType::F16}, false, c.Hkv));
  t.push_back(attention_row(2, 40, 4, 24, {DType::F32}, false, 2));  // f32 across backends: cuBLASLt path
  // packed documents: the gradient check in f32, the flash and probabilities paths in 16 bits
  t.push_back(attention_row(2, 20, 4, 4, {DType::F32}, true, 2, true));
  for (const GqaCase& c : {GqaCase{2, 200, 4, 2, 64}, {1, 130, 2, 2, 32}, {2, 257, 4, 1, 128}, {2, 90, 4, 2, 24}})
    t.push_back(attention_row(c.B, c.T, c.H, c.hs, {DType::BF16, DType::F16}, false, c.Hkv, true));
  t.push_back(attention_row(2, 90, 4, 24, {DType::F32}, false, 2, true));
  return t;
}

[[maybe_unused]] const int registered = add_rows(make());

}  // namespace
}  // namespace dtrain::parity

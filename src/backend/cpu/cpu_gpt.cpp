// CpuBackend GPT ops: layer norm, GELU (tanh), token+position embedding, causal
// self-attention (probabilities materialised [B,H,T,T]) and masked softmax cross-entropy.
// The plain reference for the CUDA kernels in backend/cuda/gpt_ops.cu. Row statistics are
// computed in double; every reduction has a fixed order (deterministic for any thread
// count): parameter-gradient sums over rows use the fixed chunk partition (cpu::chunk_rows)
// combined serially, the embedding scatter runs serially per vocabulary row.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/chunked.h"
#include "core/error.h"

namespace dtrain {

namespace {
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)

// tanh(u) without a libm call, so GCC vectorises the GELU loops (tanhf and its expm1f were a
// quarter of a small GPT's CPU step). With a = 2|u|: tanh|u| = -m / (2 + m) for m = expm1(-a)
// (small |u| stay accurate: 1 - exp would cancel), and 1 - 2e / (1 + e) for e = exp(-a) once
// tanh > 1/2; the sign put back. a = n ln2 + s, |s| <= ln2/2 (Cody-Waite, two-part ln2),
// expm1(-s) by its degree-7 Taylor polynomial (truncation < 1e-8 there), expm1(-a) =
// 2^-n expm1(-s) + (2^-n - 1) with 2^-n built in the exponent bits. a is clamped at 20:
// |u| >= 10 gives tanh = 1 in f32. Within 2.5 ulp of tanh over every f32 (std::tanh: 0.5), the
// same bits on every machine; GELU's error bound is tested in tests/backend/test_ops_cpu.cpp.
inline float tanh_fast(float u) {
  const float a = std::min(2.f * std::fabs(u), 20.f);
  const float nf = std::floor(a * 1.44269504f + 0.5f);              // round(a / ln2): 0..29
  const float r = (nf * 0.693145752f - a) + nf * 1.42860677e-6f;    // -s
  float q = 1.f / 5040.f;
  q = q * r + 1.f / 720.f;
  q = q * r + 1.f / 120.f;
  q = q * r + 1.f / 24.f;
  q = q * r + 1.f / 6.f;
  q = q * r + 0.5f;
  q = q * r + 1.f;
  q = q * r;                                                         // expm1(r)
  const float scale = std::bit_cast<float>((127 - static_cast<int32_t>(nf)) << 23);  // 2^-n
  const float m = q * scale + (scale - 1.f);  // expm1(-a)
  const float e = q * scale + scale;           // exp(-a)
  // a < ln 3 (tanh < 1/2): -m / (2 + m); above: 1 - 2e / (1 + e), exact subtraction (Sterbenz)
  const float t = a < 1.0986123f ? -m / (2.f + m) : 1.f - 2.f * e / (1.f + e);
  return std::copysign(t, u);
}

void need_f32(const char* op, const Tensor& t, const char* what, int64_t n) {
  if (!t.defined() || t.dtype != DType::F32 || t.numel() != n)
    fault("cpu backend: {}: {} must be f32 [{}], got {}", op, what, n, t.str());
}
void need_numel(const char* op, const Tensor& t, const char* what, int64_t n) {
  if (!t.defined() || t.numel() != n)
    fault("cpu backend: {}: {} must have {} elements, got {}", op, what, n, t.str());
}

// Attention's dimensions: H query heads and Hkv key/value heads (0: H) of hs values; a qkv row
// is [q (H heads) | k (Hkv) | v (Hkv)], W = (H + 2 Hkv) hs wide, keys at column koff, values at
// voff; query head h reads key/value head h / g. C = H hs is the output's width.
struct Attn {
  int64_t B, T, C, H, hs, Hkv, W, koff, voff, g;
};
Attn attn_shape(const char* op, const Tensor& qkv, int n_head, int n_kv_head) {
  const int64_t H = n_head, Hkv = n_kv_head == 0 ? n_head : n_kv_head;
  const int64_t W = qkv.ndim() >= 1 ? qkv.dim(-1) : 0;
  if (H < 1 || Hkv < 1 || H % Hkv != 0 || W % (H + 2 * Hkv) != 0 || W == 0)
    fault("cpu backend: {}: qkv {} must end in (n_head + 2 n_kv_head) * head_size columns with n_kv_head "
          "dividing n_head (n_head {}, n_kv_head {})", op, qkv.str(), n_head, n_kv_head);
  const int64_t hs = W / (H + 2 * Hkv);
  return {0, 0, H * hs, H, hs, Hkv, W, H * hs, (H + Hkv) * hs, H / Hkv};
}
Attn attn_dims(const char* op, const Tensor& qkv, const Tensor& out, const Tensor& probs,
               int n_head, int n_kv_head) {
  if (qkv.ndim() != 3) fault("cpu backend: {}: qkv {} must be [B,T,(H + 2 Hkv) hs]", op, qkv.str());
  Attn a = attn_shape(op, qkv, n_head, n_kv_head);
  a.B = qkv.dim(0), a.T = qkv.dim(1);
  need_numel(op, out, "out/dout", a.B * a.T * a.C);
  need_numel(op, probs, "probs", a.B * a.H * a.T * a.T);
  return a;
}
// The first key query t of row b sees: t - doc_pos[b,t] (its document's first token) with
// document positions (Backend::attention_fwd), else 0; a fault for a position outside [0, t].
std::vector<int64_t> attn_first_keys(const char* op, const Attn& a, const Tensor& doc_pos) {
  std::vector<int64_t> first(size_t(a.B * a.T), 0);
  if (!doc_pos.defined()) return first;
  if (doc_pos.dtype != DType::I32 || doc_pos.numel() != a.B * a.T)
    fault("cpu backend: {}: doc_pos {} must be i32 [{},{}]", op, doc_pos.str(), a.B, a.T);
  const int32_t* dp = doc_pos.i32();
  for (int64_t i = 0; i < a.B * a.T; ++i) {
    const int64_t t = i % a.T;
    if (dp[i] < 0 || dp[i] > t)
      fault("cpu backend: {}: document position {} of token {} in row {} is outside [0, {}]", op, dp[i], t,
            i / a.T, t);
    first[size_t(i)] = t - dp[i];
  }
  return first;
}

// p[s] = softmax_s(q . key(s) * scale) over s = first..last (key(s): key s's hs values), zeros
// before first; the dot products, max and sum in index order (the sum in double).
template <class Key>
void softmax_scores(const float* q, int64_t hs, int64_t first, int64_t last, float scale, float* p,
                    const Key& key) {
  float mx = -INFINITY;
  for (int64_t s = 0; s < first; ++s) p[s] = 0.f;
  for (int64_t s = first; s <= last; ++s) {
    const float* k = key(s);
    float d = 0;
    for (int64_t j = 0; j < hs; ++j) d += q[j] * k[j];
    p[s] = d * scale;
    mx = std::max(mx, p[s]);
  }
  double se = 0;
  for (int64_t s = first; s <= last; ++s) {
    p[s] = std::exp(p[s] - mx);
    se += p[s];
  }
  const float inv = float(1.0 / se);
  for (int64_t s = first; s <= last; ++s) p[s] *= inv;
}
}  // namespace

// ---------------------------------------------------------------- layer norm
void CpuBackend::layernorm_fwd(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                               Tensor& y, Tensor& mean, Tensor& rstd, float eps) {
  const char* op = "layernorm_fwd";
  require_all(Op::LayerNormFwd, x, gamma, beta, y);
  if (x.ndim() < 1) fault("cpu backend: {}: bad input {}", op, x.str());
  const int64_t C = x.dim(-1), M = C ? x.numel() / C : 0;
  need_numel(op, gamma, "gamma", C);
  need_numel(op, beta, "beta", C);
  need_numel(op, y, "y", x.numel());
  need_f32(op, mean, "mean", M);
  need_f32(op, rstd, "rstd", M);
  const float* px = in_f32(x, 0);
  const float* pg = in_f32(gamma, 1);
  const float* pb = in_f32(beta, 2);
  float* py = out_f32(y, 3, false);
  float* pm = mean.f32();
  float* pr = rstd.f32();
#pragma omp parallel for schedule(static) if (M * C > 16384)
  for (int64_t i = 0; i < M; ++i) {
    const float* r = px + i * C;
    double s = 0;
    for (int64_t j = 0; j < C; ++j) s += r[j];
    const double mu = s / double(C);
    double v = 0;
    for (int64_t j = 0; j < C; ++j) v += (r[j] - mu) * (r[j] - mu);
    const double rs = 1.0 / std::sqrt(v / double(C) + double(eps));
    const float m = float(mu), q = float(rs);
    float* o = py + i * C;
    for (int64_t j = 0; j < C; ++j) o[j] = (r[j] - m) * q * pg[j] + pb[j];
    pm[i] = m;
    pr[i] = q;
  }
  store_f32(py, y);
}

void CpuBackend::layernorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                               const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dgamma,
                               Tensor& dbeta, bool accumulate, bool accumulate_dx) {
  const char* op = "layernorm_bwd";
  require_all(Op::LayerNormBwd, dy, x, gamma, dx, dgamma, dbeta);
  if (x.ndim() < 1) fault("cpu backend: {}: bad input {}", op, x.str());
  const int64_t C = x.dim(-1), M = C ? x.numel() / C : 0;
  need_numel(op, dy, "dy", x.numel());
  need_numel(op, gamma, "gamma", C);
  need_f32(op, mean, "mean", M);
  need_f32(op, rstd, "rstd", M);
  if (dx.defined()) need_numel(op, dx, "dx", x.numel());
  if (dgamma.defined()) need_numel(op, dgamma, "dgamma", C);
  if (dbeta.defined()) need_numel(op, dbeta, "dbeta", C);
  const float* pdy = in_f32(dy, 0);
  const float* px = in_f32(x, 1);
  const float* pg = in_f32(gamma, 2);
  // accumulate_dx: the gradient goes to f32 scratch first, then is rounded and added
  float* pdx = !dx.defined()   ? nullptr
               : accumulate_dx ? scratch(3, x.numel())
                               : out_f32(dx, 3, false);
  const float* pm = mean.f32();
  const float* pr = rstd.f32();
  if (pdx) {
#pragma omp parallel for schedule(static) if (M * C > 16384)
    for (int64_t i = 0; i < M; ++i) {
      const float* g = pdy + i * C;
      const float* r = px + i * C;
      const float m = pm[i], q = pr[i];
      double s1 = 0, s2 = 0;  // mean(dy*gamma), mean(dy*gamma*xhat)
      for (int64_t j = 0; j < C; ++j) {
        const double dn = double(g[j]) * pg[j];
        s1 += dn;
        s2 += dn * ((r[j] - m) * q);
      }
      const float a = float(s1 / double(C)), b = float(s2 / double(C));
      float* o = pdx + i * C;
      for (int64_t j = 0; j < C; ++j) {
        const float xh = (r[j] - m) * q;
        o[j] = q * (g[j] * pg[j] - a - xh * b);
      }
    }
    if (!accumulate_dx) store_f32(pdx, dx);
  }
  if (dgamma.defined() || dbeta.defined()) {
    // column sums of dy*xhat and dy over the fixed chunk partition
    double* part = scratch64(0, 2 * cpu::sum_rows_partials(M, C));
    const int64_t nchunks = cpu::chunk_partials(M, C, 2 * C, part, [&](int64_t i, double* ag) {
      double* ab = ag + C;
      const float* g = pdy + i * C;
      const float* r = px + i * C;
      const float m = pm[i], q = pr[i];
      for (int64_t j = 0; j < C; ++j) {
        ag[j] += double(g[j]) * ((r[j] - m) * q);
        ab[j] += g[j];
      }
    });
    float* dg = out_f32(dgamma, 4, accumulate);
    float* db = out_f32(dbeta, 5, accumulate);
    for (int64_t j = 0; j < C; ++j) {
      double sg = 0, sb = 0;
      for (int64_t c = 0; c < nchunks; ++c) {
        sg += part[c * 2 * C + j];
        sb += part[c * 2 * C + C + j];
      }
      if (dg) dg[j] = float((accumulate ? dg[j] : 0.0) + sg);
      if (db) db[j] = float((accumulate ? db[j] : 0.0) + sb);
    }
    store_f32(dg, dgamma);
    store_f32(db, dbeta);
  }
  // last: the add reuses the scratch slots that hold the widened dy and x
  if (pdx && accumulate_dx) add_rounded(pdx, dx, 6);
}

// ---------------------------------------------------------------- GELU (tanh)
void CpuBackend::gelu_fwd(const Tensor& x, Tensor& y) {
  require_all(Op::GeluFwd, x, y);
  need_numel("gelu_fwd", y, "y", x.numel());
  const float* px = in_f32(x, 0);
  float* py = out_f32(y, 1, false);
  const int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float v = px[i];
    py[i] = 0.5f * v * (1.f + tanh_fast(kGeluC * (v + 0.044715f * v * v * v)));
  }
  store_f32(py, y);
}

void CpuBackend::gelu_bwd(const Tensor& x, const Tensor& dy, Tensor& dx) {
  require_all(Op::GeluBwd, x, dy, dx);
  need_numel("gelu_bwd", dy, "dy", x.numel());
  need_numel("gelu_bwd", dx, "dx", x.numel());
  const float* px = in_f32(x, 0);
  const float* pdy = in_f32(dy, 1);
  float* pdx = out_f32(dx, 2, false);
  const int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float v = px[i];
    const float u = kGeluC * (v + 0.044715f * v * v * v);
    const float t = tanh_fast(u);
    const float du = kGeluC * (1.f + 3.f * 0.044715f * v * v);
    const float g = 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du;
    pdx[i] = pdy[i] * g;
  }
  store_f32(pdx, dx);
}

// ---------------------------------------------------------------- embedding
void CpuBackend::embedding_fwd(const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                               Tensor& y) {
  const char* op = "embedding_fwd";
  require_all(Op::EmbeddingFwd, wte, wpe, y);
  if (ids.dtype != DType::I32 || ids.ndim() != 2)
    fault("cpu backend: {}: ids {} must be i32 [B,T]", op, ids.str());
  if (wte.ndim() != 2 || (wpe.defined() && (wpe.ndim() != 2 || wte.dim(1) != wpe.dim(1))))
    fault("cpu backend: {}: wte {} / wpe {} must be [V,C] / [Tmax,C]", op, wte.str(), wpe.str());
  const int64_t B = ids.dim(0), T = ids.dim(1), V = wte.dim(0), C = wte.dim(1);
  if (wpe.defined() && T > wpe.dim(0))
    user_error("embedding: sequence length {} exceeds block_size {}", T, wpe.dim(0));
  need_numel(op, y, "y", B * T * C);
  const int32_t* pid = ids.i32();
  for (int64_t i = 0; i < B * T; ++i)
    if (pid[i] < 0 || pid[i] >= V)
      user_error("embedding: token id {} at position {} is outside the vocabulary [0, {})",
                 pid[i], i, V);
  const float* pte = in_f32(wte, 0);
  const float* ppe = wpe.defined() ? in_f32(wpe, 1) : nullptr;
  float* py = out_f32(y, 2, false);
#pragma omp parallel for schedule(static) if (B * T * C > 65536)
  for (int64_t i = 0; i < B * T; ++i) {
    const float* a = pte + int64_t(pid[i]) * C;
    float* o = py + i * C;
    if (!ppe) {  // no position embedding (the Llama family's rotary positions live in attention)
      for (int64_t j = 0; j < C; ++j) o[j] = a[j];
      continue;
    }
    const float* b = ppe + (i % T) * C;
    for (int64_t j = 0; j < C; ++j) o[j] = a[j] + b[j];
  }
  store_f32(py, y);
}

void CpuBackend::embedding_bwd(const Tensor& dy, const Tensor& ids, Tensor& dwte, Tensor& dwpe,
                               bool accumulate) {
  const char* op = "embedding_bwd";
  require_all(Op::EmbeddingBwd, dy, dwte, dwpe);
  if (ids.dtype != DType::I32 || ids.ndim() != 2)
    fault("cpu backend: {}: ids {} must be i32 [B,T]", op, ids.str());
  const int64_t B = ids.dim(0), T = ids.dim(1);
  if (dy.ndim() < 1) fault("cpu backend: {}: bad dy {}", op, dy.str());
  const int64_t C = dy.dim(-1);
  need_numel(op, dy, "dy", B * T * C);
  if (dwte.defined() && (dwte.ndim() != 2 || dwte.dim(1) != C))
    fault("cpu backend: {}: dwte {} must be [V,{}]", op, dwte.str(), C);
  if (dwpe.defined() && (dwpe.ndim() != 2 || dwpe.dim(1) != C || dwpe.dim(0) < T))
    fault("cpu backend: {}: dwpe {} must be [>={},{}]", op, dwpe.str(), T, C);
  const int32_t* pid = ids.i32();
  const float* pdy = in_f32(dy, 0);
  if (dwte.defined()) {
    const int64_t V = dwte.dim(0);
    float* dte = out_f32(dwte, 1, accumulate);
    if (!accumulate)
      for (int64_t i = 0; i < V * C; ++i) dte[i] = 0.f;
    // Positions grouped by token (counting sort, stable): each row sums in position order.
    std::vector<int64_t> start(size_t(V) + 1, 0), pos(size_t(B * T));
    for (int64_t i = 0; i < B * T; ++i) {
      if (pid[i] < 0 || pid[i] >= V)
        user_error("embedding: token id {} at position {} is outside the vocabulary [0, {})",
                   pid[i], i, V);
      start[size_t(pid[i]) + 1]++;
    }
    for (int64_t v = 0; v < V; ++v) start[size_t(v + 1)] += start[size_t(v)];
    std::vector<int64_t> fillp(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < B * T; ++i) pos[size_t(fillp[size_t(pid[i])]++)] = i;
#pragma omp parallel for schedule(dynamic, 16) if (B * T * C > 65536)
    for (int64_t v = 0; v < V; ++v) {
      const int64_t b = start[size_t(v)], e = start[size_t(v + 1)];
      if (b == e) continue;
      float* o = dte + v * C;
      for (int64_t k = b; k < e; ++k) {
        const float* g = pdy + pos[size_t(k)] * C;
        for (int64_t j = 0; j < C; ++j) o[j] += g[j];
      }
    }
    store_f32(dte, dwte);
  }
  if (dwpe.defined()) {
    float* dpe = out_f32(dwpe, 2, accumulate);
    const int64_t Tm = dwpe.dim(0);
    if (!accumulate)
      for (int64_t i = 0; i < Tm * C; ++i) dpe[i] = 0.f;
#pragma omp parallel for schedule(static) if (B * T * C > 65536)
    for (int64_t t = 0; t < T; ++t) {
      float* o = dpe + t * C;
      for (int64_t b = 0; b < B; ++b) {
        const float* g = pdy + (b * T + t) * C;
        for (int64_t j = 0; j < C; ++j) o[j] += g[j];
      }
    }
    store_f32(dpe, dwpe);
  }
}

// ---------------------------------------------------------------- causal attention
// The CPU saves the probabilities [B,H,T,T] (in qkv's dtype) for the backward.
AttentionSaved CpuBackend::attention_saved(int64_t B, int64_t H, int64_t T, int64_t,
                                           DType qkv_dtype) const {
  return {qkv_dtype, Shape{B, H, T, T}};
}

void CpuBackend::attention_fwd(const Tensor& qkv, Tensor& out, Tensor& probs, int n_head, int n_kv_head,
                               const Tensor& doc_pos) {
  require_all(Op::AttentionFwd, qkv, out, probs);
  const Attn a = attn_dims("attention_fwd", qkv, out, probs, n_head, n_kv_head);
  const std::vector<int64_t> first = attn_first_keys("attention_fwd", a, doc_pos);
  const int64_t B = a.B, T = a.T, C = a.C, H = a.H, hs = a.hs, W = a.W;
  const float* pq = in_f32(qkv, 0);
  float* po = out_f32(out, 1, false);
  float* pp = out_f32(probs, 2, false);
  const float scale = 1.f / std::sqrt(float(hs));
#pragma omp parallel for collapse(2) schedule(static) if (B * H * T * T * hs > 65536)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kv = h / a.g;  // the key/value head this query head reads
      for (int64_t t = 0; t < T; ++t) {
        const float* q = pq + (b * T + t) * W + h * hs;
        float* p = pp + ((b * H + h) * T + t) * T;
        const int64_t s0 = first[size_t(b * T + t)];
        softmax_scores(q, hs, s0, t, scale, p,
                       [&](int64_t s) { return pq + (b * T + s) * W + a.koff + kv * hs; });
        for (int64_t s = t + 1; s < T; ++s) p[s] = 0.f;
        float* o = po + (b * T + t) * C + h * hs;
        for (int64_t j = 0; j < hs; ++j) o[j] = 0.f;
        for (int64_t s = s0; s <= t; ++s) {
          const float* v = pq + (b * T + s) * W + a.voff + kv * hs;
          for (int64_t j = 0; j < hs; ++j) o[j] += p[s] * v[j];
        }
      }
    }
  store_f32(po, out);
  store_f32(pp, probs);
}

void CpuBackend::attention_decode(const Tensor& qkv, Tensor& kcache, Tensor& vcache, int64_t pos,
                                  Tensor& out, int n_head, int n_kv_head) {
  require_all(Op::AttentionDecode, qkv, kcache, vcache, out);
  const char* op = "attention_decode";
  DTRAIN_CHECK(qkv.ndim() >= 2, "{}: qkv {} must be [B,(H + 2 Hkv) hs]", op, qkv.str());
  const Attn a = attn_shape(op, qkv, n_head, n_kv_head);
  const int64_t W = a.W, C = a.C, B = qkv.numel() / W, H = a.H, Hkv = a.Hkv, hs = a.hs;
  DTRAIN_CHECK(kcache.ndim() == 4 && kcache.dim(0) == B && kcache.dim(1) == Hkv &&
                   kcache.dim(3) == hs && kcache.shape == vcache.shape &&
                   kcache.dtype == qkv.dtype && vcache.dtype == qkv.dtype,
               "{}: caches {} / {} do not match qkv {} with n_head {} n_kv_head {}", op, kcache.str(),
               vcache.str(), qkv.str(), n_head, n_kv_head);
  const int64_t Tmax = kcache.dim(2);
  DTRAIN_CHECK(pos >= 0 && pos < Tmax, "{}: position {} outside the cache [0, {})", op, pos, Tmax);
  need_numel(op, out, "out", B * C);
  const float* pq = in_f32(qkv, 0);
  float* pk = out_f32(kcache, 1, true);
  float* pv = out_f32(vcache, 2, true);
  float* po = out_f32(out, 3, false);
  float* sc = scratch(4, B * H * (pos + 1));
  const float scale = 1.f / std::sqrt(float(hs));
  for (int64_t b = 0; b < B; ++b)  // the new position's keys and values into the caches
    for (int64_t kv = 0; kv < Hkv; ++kv) {
      const float* row = pq + b * W;
      std::copy(row + a.koff + kv * hs, row + a.koff + (kv + 1) * hs, pk + ((b * Hkv + kv) * Tmax + pos) * hs);
      std::copy(row + a.voff + kv * hs, row + a.voff + (kv + 1) * hs, pv + ((b * Hkv + kv) * Tmax + pos) * hs);
    }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const float* q = pq + b * W + h * hs;
      const float* K = pk + (b * Hkv + h / a.g) * Tmax * hs;
      const float* V = pv + (b * Hkv + h / a.g) * Tmax * hs;
      float* p = sc + (b * H + h) * (pos + 1);
      softmax_scores(q, hs, 0, pos, scale, p, [&](int64_t s) { return K + s * hs; });
      float* o = po + b * C + h * hs;
      for (int64_t j = 0; j < hs; ++j) o[j] = 0.f;
      for (int64_t s = 0; s <= pos; ++s)
        for (int64_t j = 0; j < hs; ++j) o[j] += p[s] * V[s * hs + j];
    }
  store_f32(pk, kcache);
  store_f32(pv, vcache);
  store_f32(po, out);
}

// `out` (the forward's output) is not needed: the saved probabilities give everything. A
// key/value head's gradient sums over its query heads h = kv*g .. kv*g + g - 1 in that order
// (the threads split the (sample, key/value head) pairs).
void CpuBackend::attention_bwd(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                               const Tensor& probs, Tensor& dqkv, int n_head, int n_kv_head,
                               const Tensor& doc_pos) {
  require_all(Op::AttentionBwd, dout, qkv, probs, dqkv);
  const Attn a = attn_dims("attention_bwd", qkv, dout, probs, n_head, n_kv_head);
  const std::vector<int64_t> first = attn_first_keys("attention_bwd", a, doc_pos);
  if (out.defined()) need_numel("attention_bwd", out, "out", a.B * a.T * a.C);
  need_numel("attention_bwd", dqkv, "dqkv", qkv.numel());
  const int64_t B = a.B, T = a.T, C = a.C, H = a.H, hs = a.hs, W = a.W, Hkv = a.Hkv;
  const float* pq = in_f32(qkv, 0);
  const float* pdo = in_f32(dout, 1);
  const float* pp = in_f32(probs, 2);
  float* pd = out_f32(dqkv, 3, false);
  float* dsbuf = scratch(4, B * H * T);  // one row of dS per (b,h)
  const float scale = 1.f / std::sqrt(float(hs));
  for (int64_t i = 0; i < B * T * W; ++i) pd[i] = 0.f;
#pragma omp parallel for collapse(2) schedule(static) if (B * H * T * T * hs > 65536)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < Hkv; ++kv)
      for (int64_t h = kv * a.g; h < (kv + 1) * a.g; ++h) {
        float* ds = dsbuf + (b * H + h) * T;
        for (int64_t t = 0; t < T; ++t) {
          const float* p = pp + ((b * H + h) * T + t) * T;
          const float* g = pdo + (b * T + t) * C + h * hs;
          // dP[s] = dout_t . v_s ; dv_s += p[s] * dout_t
          double dot = 0;
          const int64_t s0 = first[size_t(b * T + t)];
          for (int64_t s = s0; s <= t; ++s) {
            const float* v = pq + (b * T + s) * W + a.voff + kv * hs;
            float* dv = pd + (b * T + s) * W + a.voff + kv * hs;
            float d = 0;
            for (int64_t j = 0; j < hs; ++j) {
              d += g[j] * v[j];
              dv[j] += p[s] * g[j];
            }
            ds[s] = d;
            dot += double(p[s]) * d;
          }
          // dS = P * (dP - sum(P*dP)) * scale; dq_t += dS k_s; dk_s += dS q_t
          const float* q = pq + (b * T + t) * W + h * hs;
          float* dq = pd + (b * T + t) * W + h * hs;
          for (int64_t s = s0; s <= t; ++s) {
            const float w = p[s] * (ds[s] - float(dot)) * scale;
            const float* k = pq + (b * T + s) * W + a.koff + kv * hs;
            float* dk = pd + (b * T + s) * W + a.koff + kv * hs;
            for (int64_t j = 0; j < hs; ++j) {
              dq[j] += w * k[j];
              dk[j] += w * q[j];
            }
          }
        }
      }
  store_f32(pd, dqkv);
}

// ---------------------------------------------------------------- masked cross-entropy
void CpuBackend::softmax_xent_masked(const Tensor& logits, const Tensor& labels,
                                     int64_t valid_classes, float grad_scale, Tensor& losses,
                                     Tensor& dlogits) {
  const char* op = "softmax_xent_masked";
  require_all(Op::SoftmaxXentMasked, logits, dlogits);
  if (logits.ndim() != 2) fault("cpu backend: {}: logits {} must be [N,C]", op, logits.str());
  const int64_t N = logits.dim(0), Cp = logits.dim(1), V = valid_classes;
  if (V < 1 || V > Cp)
    fault("cpu backend: {}: valid_classes {} outside [1, {}]", op, V, Cp);
  if (labels.dtype != DType::I32 || labels.numel() != N)
    fault("cpu backend: {}: labels {} must be i32 [{}]", op, labels.str(), N);
  if (losses.defined()) need_f32(op, losses, "losses", N);
  if (dlogits.defined()) need_numel(op, dlogits, "dlogits", logits.numel());
  const int32_t* lab = labels.i32();
  for (int64_t i = 0; i < N; ++i)
    if ((lab[i] < 0 || lab[i] >= V) && lab[i] != kIgnoreTarget)
      user_error("cross-entropy: target token {} at position {} is outside [0, {})", lab[i], i,
                 V);
  const float* z = in_f32(logits, 0);
  float* dz = out_f32(dlogits, 1, false);
  float* loss = losses.defined() ? losses.f32() : nullptr;
#pragma omp parallel for schedule(static) if (N * V > 16384)
  for (int64_t i = 0; i < N; ++i) {
    const float* zi = z + i * Cp;
    float m = zi[0];
    for (int64_t c = 1; c < V; ++c) m = std::max(m, zi[c]);
    double se = 0;
    for (int64_t c = 0; c < V; ++c) se += std::exp(zi[c] - m);
    const int64_t y = lab[i];
    if (y == kIgnoreTarget) {  // not a target: no loss, no gradient
      if (loss) loss[i] = 0.f;
      if (dz) std::fill(dz + i * Cp, dz + (i + 1) * Cp, 0.f);
      continue;
    }
    if (loss) loss[i] = float(double(m) + std::log(se) - zi[y]);
    if (dz) {
      float* di = dz + i * Cp;
      const float inv = float(1.0 / se);
      for (int64_t c = 0; c < V; ++c)
        di[c] = grad_scale * (std::exp(zi[c] - m) * inv - (c == y ? 1.f : 0.f));
      for (int64_t c = V; c < Cp; ++c) di[c] = 0.f;
    }
  }
  store_f32(dz, dlogits);
}

}  // namespace dtrain

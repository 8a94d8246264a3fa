// CpuBackend's mixture-of-experts ops (nn/moe.h): the router's softmax, top-k and dispatch plan,
// its backward, and the gathers and weighted sums around the experts. The plain reference for
// backend/cuda/moe_ops.cu. Every sum runs in a fixed order (per row, or serially over rows for the
// column sums), so results do not depend on the thread count.
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace dtrain {

namespace {
void need(const char* op, const Tensor& t, const char* what, DType dt, int64_t n) {
  if (!t.defined() || t.dtype != dt || t.numel() != n)
    fault("cpu backend: {}: {} must be {} [{}], got {}", op, what, dtype_name(dt), n, t.str());
}
void need_numel(const char* op, const Tensor& t, const char* what, int64_t n) {
  if (!t.defined() || t.numel() != n) fault("cpu backend: {}: {} must have {} elements, got {}", op, what, n, t.str());
}
// N and E of a router's logits [N,E]
std::pair<int64_t, int64_t> rows_cols(const char* op, const Tensor& t) {
  if (!t.defined() || t.ndim() != 2 || t.dim(1) < 1) fault("cpu backend: {}: expected [N,E], got {}", op, t.str());
  return {t.dim(0), t.dim(1)};
}
}  // namespace

void CpuBackend::moe_route_fwd(const Tensor& logits, int top_k, bool norm_topk, int64_t capacity, Tensor& probs,
                               Tensor& lse, Tensor& sel, Tensor& weights, Tensor& counts, Tensor& order, Tensor& pos,
                               Tensor& stats) {
  const char* op = "moe_route_fwd";
  require(Op::MoeRouteFwd, logits);
  const auto [N, E] = rows_cols(op, logits);
  const int64_t k = top_k;
  if (k < 1 || k > E) fault("cpu backend: {}: top_k {} for {} experts", op, k, E);
  need(op, probs, "probs", DType::F32, N * E);
  need(op, lse, "lse", DType::F32, N);
  need(op, sel, "sel", DType::I32, N * k);
  need(op, weights, "weights", DType::F32, N * k);
  need(op, counts, "counts", DType::I32, E);
  need(op, order, "order", DType::I32, N * k);
  need(op, pos, "pos", DType::I32, N * k);
  need(op, stats, "stats", DType::F32, E + 1);
  const float* pl = in_f32(logits, 0);
  float* pp = probs.f32();
  float* plse = lse.f32();
  int32_t* ps = static_cast<int32_t*>(sel.data);
  float* pw = weights.f32();
#pragma omp parallel for schedule(static) if (N * E > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const float* z = pl + n * E;
    float* p = pp + n * E;
    float mx = z[0];
    for (int64_t e = 1; e < E; ++e) mx = std::fmax(mx, z[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(z[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    plse[n] = mx + std::log(sum);
    // top-k by selection: the largest remaining probability, the lower expert on ties
    int32_t* s = ps + n * k;
    float* w = pw + n * k;
    float wsum = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken = taken || s[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      s[j] = int32_t(best);
      w[j] = p[best];
      wsum += w[j];
    }
    if (norm_topk)
      for (int64_t j = 0; j < k; ++j) w[j] /= wsum;
  }
  // the dispatch plan: slots grouped by expert, in slot order within a group
  int32_t* pc = static_cast<int32_t*>(counts.data);
  int32_t* po = static_cast<int32_t*>(order.data);
  int32_t* pq = static_cast<int32_t*>(pos.data);
  std::vector<int64_t> next(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; ++e) pc[e] = 0;
  for (int64_t s = 0; s < N * k; ++s) ++pc[ps[s]];
  for (int64_t e = 1; e < E; ++e) next[size_t(e)] = next[size_t(e - 1)] + pc[e - 1];
  std::vector<int64_t> start = next;
  for (int64_t s = 0; s < N * k; ++s) {
    const int64_t e = ps[s], at = next[size_t(e)]++;
    po[at] = int32_t(s);
    const bool kept = capacity <= 0 || at - start[size_t(e)] < capacity;
    pq[s] = kept ? int32_t(at) : int32_t(-(at + 1));
  }
  float* st = stats.f32();
  for (int64_t e = 0; e < E; ++e) {
    double c = 0;
    for (int64_t n = 0; n < N; ++n) c += double(pp[n * E + e]);
    st[e] = float(c);
  }
  double zz = 0;
  for (int64_t n = 0; n < N; ++n) zz += double(plse[n]) * double(plse[n]);
  st[E] = float(zz);
}

void CpuBackend::moe_route_bwd(const Tensor& probs, const Tensor& lse, const Tensor& sel, const Tensor& weights,
                               const Tensor& dweights, const Tensor& paux, float zscale, bool norm_topk,
                               Tensor& dlogits) {
  const char* op = "moe_route_bwd";
  require(Op::MoeRouteBwd, dlogits);
  const auto [N, E] = rows_cols(op, probs);
  if (!sel.defined() || sel.ndim() != 2 || sel.dim(0) != N) fault("cpu backend: {}: sel {}", op, sel.str());
  const int64_t k = sel.dim(1);
  need(op, probs, "probs", DType::F32, N * E);
  need(op, lse, "lse", DType::F32, N);
  need(op, sel, "sel", DType::I32, N * k);
  need(op, weights, "weights", DType::F32, N * k);
  need(op, dweights, "dweights", DType::F32, N * k);
  if (paux.defined()) need(op, paux, "paux", DType::F32, E);
  need_numel(op, dlogits, "dlogits", N * E);
  const float* pp = probs.f32();
  const float* plse = lse.f32();
  const int32_t* ps = static_cast<const int32_t*>(sel.data);
  const float* pw = weights.f32();
  const float* pdw = dweights.f32();
  const float* pa = paux.defined() ? paux.f32() : nullptr;
  float* pd = out_f32(dlogits, 0, false);
#pragma omp parallel for schedule(static) if (N * E > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const float* p = pp + n * E;
    const int32_t* s = ps + n * k;
    const float* w = pw + n * k;
    const float* dw = pdw + n * k;
    float* d = pd + n * E;  // dp first, then the softmax's backward in place
    for (int64_t e = 0; e < E; ++e) d[e] = pa ? pa[e] : 0.f;
    if (norm_topk) {  // w_j = p_j / S: dp_j = (dw_j - sum_i dw_i w_i) / S
      float S = 0.f, dot = 0.f;
      for (int64_t j = 0; j < k; ++j) S += p[s[j]];
      for (int64_t j = 0; j < k; ++j) dot += dw[j] * w[j];
      for (int64_t j = 0; j < k; ++j) d[s[j]] += (dw[j] - dot) / S;
    } else {
      for (int64_t j = 0; j < k; ++j) d[s[j]] += dw[j];
    }
    const float zl = zscale * 2.f * plse[n];
    float dot = 0.f;
    for (int64_t e = 0; e < E; ++e) dot += p[e] * d[e];
    for (int64_t e = 0; e < E; ++e) d[e] = p[e] * (d[e] - dot) + zl * p[e];
  }
  store_f32(pd, dlogits);
}

void CpuBackend::moe_gather(const Tensor& x, const Tensor& order, int top_k, Tensor& y) {
  const char* op = "moe_gather";
  require_all(Op::MoeGather, x, y);
  if (!x.defined() || x.ndim() != 2) fault("cpu backend: {}: x must be [N,C], got {}", op, x.str());
  const int64_t N = x.dim(0), C = x.dim(1), M = order.numel();
  need(op, order, "order", DType::I32, M);
  need_numel(op, y, "y", M * C);
  if (y.dtype != x.dtype) fault("cpu backend: {}: y {} and x {} differ in dtype", op, y.str(), x.str());
  const int32_t* po = static_cast<const int32_t*>(order.data);
  const size_t es = dtype_size(x.dtype);
  const char* px = static_cast<const char*>(x.data);
  char* py = static_cast<char*>(y.data);
  for (int64_t i = 0; i < M; ++i)
    if (po[i] < 0 || po[i] / top_k >= N) fault("cpu backend: {}: slot {} outside {} tokens of {} slots", op, po[i], N, top_k);
#pragma omp parallel for schedule(static) if (M * C > 65536)
  for (int64_t i = 0; i < M; ++i) {
    const int64_t n = po[i] / top_k;
    std::memcpy(py + size_t(i * C) * es, px + size_t(n * C) * es, size_t(C) * es);
  }
}

void CpuBackend::moe_combine(const Tensor& ye, const Tensor& pos, const Tensor& weights, int top_k, Tensor& y,
                             bool accumulate) {
  const char* op = "moe_combine";
  require_all(Op::MoeCombine, ye, y);
  if (!y.defined() || y.ndim() != 2 || !ye.defined() || ye.ndim() != 2 || ye.dim(1) != y.dim(1))
    fault("cpu backend: {}: ye {} and y {} must be [M,C] and [N,C]", op, ye.str(), y.str());
  const int64_t N = y.dim(0), C = y.dim(1), M = ye.dim(0), k = top_k;
  need(op, pos, "pos", DType::I32, N * k);
  if (weights.defined()) need(op, weights, "weights", DType::F32, N * k);
  const float* pe = in_f32(ye, 0);
  const int32_t* pq = static_cast<const int32_t*>(pos.data);
  const float* pw = weights.defined() ? weights.f32() : nullptr;
  for (int64_t s = 0; s < N * k; ++s)
    if (pq[s] >= M) fault("cpu backend: {}: position {} outside {} rows", op, pq[s], M);
  float* out = scratch(5, N * C);
#pragma omp parallel for schedule(static) if (N * C > 65536)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * C;
    for (int64_t c = 0; c < C; ++c) o[c] = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = pq[n * k + j];
      if (p < 0) continue;  // dropped
      const float w = pw ? pw[n * k + j] : 1.f;
      const float* r = pe + p * C;
      for (int64_t c = 0; c < C; ++c) o[c] += w * r[c];
    }
  }
  if (accumulate) {
    add_rounded(out, y, 6);
  } else {
    float* py = out_f32(y, 1, false);
    std::memcpy(py, out, size_t(N * C) * sizeof(float));
    store_f32(py, y);
  }
}

void CpuBackend::moe_combine_bwd(const Tensor& dy, const Tensor& ye, const Tensor& pos, const Tensor& weights,
                                 int top_k, Tensor& dye, Tensor& dweights) {
  const char* op = "moe_combine_bwd";
  require_all(Op::MoeCombineBwd, dy, ye, dye);
  if (!dy.defined() || dy.ndim() != 2 || !ye.defined() || ye.ndim() != 2 || ye.dim(1) != dy.dim(1))
    fault("cpu backend: {}: ye {} and dy {} must be [M,C] and [N,C]", op, ye.str(), dy.str());
  const int64_t N = dy.dim(0), C = dy.dim(1), M = ye.dim(0), k = top_k;
  if (M != N * k) fault("cpu backend: {}: ye {} must have {} rows (every slot)", op, ye.str(), N * k);
  need(op, pos, "pos", DType::I32, N * k);
  need(op, weights, "weights", DType::F32, N * k);
  need(op, dweights, "dweights", DType::F32, N * k);
  need_numel(op, dye, "dye", M * C);
  const float* pdy = in_f32(dy, 0);
  const float* pe = in_f32(ye, 1);
  float* pd = out_f32(dye, 2, false);
  const int32_t* pq = static_cast<const int32_t*>(pos.data);
  const float* pw = weights.f32();
  float* pdw = dweights.f32();
#pragma omp parallel for schedule(static) if (N * C > 65536)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = pdy + n * C;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = pq[n * k + j];
      float* d = pd + (p >= 0 ? p : -p - 1) * C;
      if (p < 0) {  // dropped: no gradient
        for (int64_t c = 0; c < C; ++c) d[c] = 0.f;
        pdw[n * k + j] = 0.f;
        continue;
      }
      const float w = pw[n * k + j];
      const float* r = pe + p * C;
      float dot = 0.f;
      for (int64_t c = 0; c < C; ++c) {
        d[c] = w * g[c];
        dot += g[c] * r[c];
      }
      pdw[n * k + j] = dot;
    }
  }
  store_f32(pd, dye);
}

}  // namespace dtrain

// CpuBackend U-Net ops: bilinear x2 upsampling (align_corners=False) forward and gather
// backward, channel concat/split (NHWC strided copies), and the softmax soft-Dice loss.
// Every reduction uses a fixed partition combined serially, so results do not depend on
// the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/unet_geom.h"
#include "core/error.h"

namespace dtrain {

namespace {
void expect_nhwc(const char* op, const Tensor& t, const char* name) {
  if (t.ndim() != 4) fault("cpu backend: {}: {} {} is not a 4-D NHWC tensor", op, name, t.shape.str());
}
struct Up2x {
  int64_t N, H, W, C, OH, OW;  // small [N,H,W,C], big [N,OH,OW,C] = [N,2H,2W,C]
};
// The dims of `small` and `big` after checking the dtypes, ranks and that big is
// [N,2H,2W,C] for small [N,H,W,C]: the forward's x and y, or the backward's dx and dy.
Up2x up2x_dims(const CpuBackend& be, bool bwd, const Tensor& small, const Tensor& big) {
  const char* op = bwd ? "upsample_bilinear2x_bwd" : "upsample_bilinear2x_fwd";
  const char *sname = bwd ? "dx" : "x", *bname = bwd ? "dy" : "y";
  be.require_all(bwd ? Op::UpsampleBilinear2xBwd : Op::UpsampleBilinear2xFwd, small, big);
  expect_nhwc(op, small, sname);
  expect_nhwc(op, big, bname);
  const Up2x d{small.dim(0), small.dim(1),     small.dim(2),
               small.dim(3), 2 * small.dim(1), 2 * small.dim(2)};
  if (big.dim(0) != d.N || big.dim(1) != 2 * d.H || big.dim(2) != 2 * d.W || big.dim(3) != d.C)
    fault("cpu backend: {}: {} {} must be [N,2H,2W,C] for {} {}", op, bname, big.shape.str(), sname,
          small.shape.str());
  return d;
}
// f(n, r) for every n < N, r < rows, in parallel over the collapsed (n, r) grid.
template <class F>
void parallel_rows(int64_t N, int64_t rows, const F& f) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t r = 0; r < rows; ++r) f(n, r);
}
}  // namespace

void CpuBackend::upsample_bilinear2x_fwd(const Tensor& x, Tensor& y) {
  const Up2x u = up2x_dims(*this, /*bwd=*/false, x, y);
  const int64_t H = u.H, W = u.W, C = u.C, OH = u.OH, OW = u.OW;
  const float* px = in_f32(x, 0);
  float* py = out_f32(y, 1, false);
  parallel_rows(u.N, OH, [&](int64_t n, int64_t oh) {
    const unet::Taps th = unet::up2x_taps(int(oh), int(H));
    const float* r0 = px + (n * H + th.i0) * W * C;
    const float* r1 = px + (n * H + th.i1) * W * C;
    for (int64_t ow = 0; ow < OW; ++ow) {
      const unet::Taps tw = unet::up2x_taps(int(ow), int(W));
      float* out = py + ((n * OH + oh) * OW + ow) * C;
      const float* a = r0 + tw.i0 * C;
      const float* b = r0 + tw.i1 * C;
      const float* c = r1 + tw.i0 * C;
      const float* d = r1 + tw.i1 * C;
      for (int64_t k = 0; k < C; ++k)
        out[k] = th.w0 * (tw.w0 * a[k] + tw.w1 * b[k]) + th.w1 * (tw.w0 * c[k] + tw.w1 * d[k]);
    }
  });
  store_f32(py, y);
}

void CpuBackend::upsample_bilinear2x_bwd(const Tensor& dy, Tensor& dx) {
  const Up2x u = up2x_dims(*this, /*bwd=*/true, dx, dy);
  const int64_t H = u.H, W = u.W, C = u.C, OH = u.OH, OW = u.OW;
  const float* pdy = in_f32(dy, 0);
  float* pdx = out_f32(dx, 1, false);
  parallel_rows(u.N, H, [&](int64_t n, int64_t h) {
    for (int64_t w = 0; w < W; ++w) {
      float* out = pdx + ((n * H + h) * W + w) * C;
      for (int64_t k = 0; k < C; ++k) out[k] = 0.f;
      for (int oh = unet::up2x_first(int(h)); oh <= unet::up2x_last(int(h), int(H)); ++oh) {
        const float wh = unet::up2x_weight(oh, int(h), int(H));
        if (wh == 0.f) continue;
        for (int ow = unet::up2x_first(int(w)); ow <= unet::up2x_last(int(w), int(W)); ++ow) {
          const float ww = unet::up2x_weight(ow, int(w), int(W));
          if (ww == 0.f) continue;
          const float s = wh * ww;
          const float* g = pdy + ((n * OH + oh) * OW + ow) * C;
          for (int64_t k = 0; k < C; ++k) out[k] += s * g[k];
        }
      }
    }
  });
  store_f32(pdx, dx);
}

void CpuBackend::concat_channels(const Tensor& a, const Tensor& b, Tensor& y) {
  const char* op = "concat_channels";
  require_all(Op::ConcatChannels, a, b, y);
  if (a.ndim() < 1 || a.ndim() != b.ndim() || a.ndim() != y.ndim() || a.dtype != y.dtype ||
      b.dtype != y.dtype)
    fault("cpu backend: {}: a {} b {} y {} must have equal rank and dtype", op, a.str(), b.str(),
          y.str());
  const int r = a.ndim() - 1;
  const int64_t Ca = a.dim(r), Cb = b.dim(r), C = y.dim(r);
  const int64_t rows = Ca ? a.numel() / Ca : 0;
  if (C != Ca + Cb || (Cb && b.numel() / Cb != rows) || (C && y.numel() / C != rows))
    fault("cpu backend: {}: a {} b {} y {}: expected y = [..., Ca+Cb] with equal leading dims", op,
          a.shape.str(), b.shape.str(), y.shape.str());
  const size_t es = dtype_size(y.dtype);
  const auto* pa = static_cast<const char*>(a.data);
  const auto* pb = static_cast<const char*>(b.data);
  auto* py = static_cast<char*>(y.data);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(py + size_t(i * C) * es, pa + size_t(i * Ca) * es, size_t(Ca) * es);
    std::memcpy(py + size_t(i * C + Ca) * es, pb + size_t(i * Cb) * es, size_t(Cb) * es);
  }
}

void CpuBackend::split_channels(const Tensor& dy, Tensor& da, Tensor& db) {
  const char* op = "split_channels";
  require_all(Op::SplitChannels, dy, da, db);
  const int r = dy.ndim() - 1;
  if (r < 0 || (!da.defined() && !db.defined()))
    fault("cpu backend: {}: dy {} with no output", op, dy.str());
  const int64_t C = dy.dim(r);
  const int64_t Ca = da.defined() ? da.dim(r) : C - db.dim(r);
  const int64_t Cb = C - Ca;
  const int64_t rows = C ? dy.numel() / C : 0;
  if (Ca < 0 || Cb < 0 || (da.defined() && (da.dtype != dy.dtype || da.numel() != rows * Ca)) ||
      (db.defined() && (db.dtype != dy.dtype || db.dim(r) != Cb || db.numel() != rows * Cb)))
    fault("cpu backend: {}: dy {} da {} db {}: expected dy = [..., Ca+Cb]", op, dy.str(), da.str(),
          db.str());
  const size_t es = dtype_size(dy.dtype);
  const auto* pd = static_cast<const char*>(dy.data);
  auto* pa = static_cast<char*>(da.data);
  auto* pb = static_cast<char*>(db.data);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    if (pa) std::memcpy(pa + size_t(i * Ca) * es, pd + size_t(i * C) * es, size_t(Ca) * es);
    if (pb) std::memcpy(pb + size_t(i * Cb) * es, pd + size_t(i * C + Ca) * es, size_t(Cb) * es);
  }
}

void CpuBackend::softmax_dice(const Tensor& logits, const Tensor& labels, float smooth,
                              float grad_scale, Tensor& loss, Tensor& dlogits) {
  const char* op = "softmax_dice";
  if (loss.defined() && (loss.dtype != DType::F32 || loss.numel() != 1))
    fault("cpu backend: {}: loss {} must be f32 [1]", op, loss.str());
  require_all(Op::SoftmaxDice, logits, dlogits);
  if (logits.ndim() < 2) fault("cpu backend: {}: logits {} must be [..., K]", op, logits.str());
  const int64_t K = logits.dim(logits.ndim() - 1);
  const int64_t P = K ? logits.numel() / K : 0;
  if (K < 1 || labels.dtype != DType::I32 || labels.numel() != P)
    fault("cpu backend: {}: labels {} must be i32 with one label per pixel of logits {}", op,
          labels.str(), logits.str());
  if (dlogits.defined() && (dlogits.dtype != logits.dtype || dlogits.numel() != logits.numel()))
    fault("cpu backend: {}: dlogits {} vs logits {}", op, dlogits.str(), logits.str());
  const float* x = in_f32(logits, 0);
  const int32_t* y = labels.ptr<int32_t>();
  for (int64_t i = 0; i < P; ++i)
    if (y[i] < 0 || y[i] >= K)
      fault("cpu backend: {}: label {} at pixel {} is outside [0, {})", op, y[i], i, K);

  // Per fixed chunk of pixels: sums of p_k, p_k*t_k, t_k (double), combined in chunk order.
  const int64_t chunk = 4096;
  const int64_t nchunks = (P + chunk - 1) / chunk;
  std::vector<double> part(size_t(nchunks * 3 * K), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    double* s = part.data() + c * 3 * K;
    std::vector<float> p(static_cast<size_t>(K));
    for (int64_t i = c * chunk; i < std::min(P, (c + 1) * chunk); ++i) {
      unet::softmax_row(x + i * K, int(K), p.data());
      for (int64_t k = 0; k < K; ++k) s[k] += p[size_t(k)];
      s[K + y[i]] += p[size_t(y[i])];
      s[2 * K + y[i]] += 1.0;
    }
  }
  std::vector<double> tot(size_t(3 * K), 0.0);
  for (int64_t c = 0; c < nchunks; ++c)
    for (int64_t j = 0; j < 3 * K; ++j) tot[size_t(j)] += part[size_t(c * 3 * K + j)];
  // dL/dp[i,k] = -(1/K) (A_k t_ik - B_k), A_k = 2/(S_k+s), B_k = (2 I_k + s)/(S_k+s)^2
  std::vector<float> A(static_cast<size_t>(K)), B(static_cast<size_t>(K));
  double dice_sum = 0;
  for (int64_t k = 0; k < K; ++k) {
    const double I = tot[size_t(K + k)], S = tot[size_t(k)] + tot[size_t(2 * K + k)] + smooth;
    dice_sum += (2 * I + smooth) / S;
    A[size_t(k)] = float(2.0 / S);
    B[size_t(k)] = float((2 * I + smooth) / (S * S));
  }
  if (loss.defined()) *loss.f32() = float(1.0 - dice_sum / double(K));
  if (!dlogits.defined()) return;
  float* d = out_f32(dlogits, 1, false);
  const float gk = grad_scale / float(K);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    std::vector<float> p(static_cast<size_t>(K));
    for (int64_t i = c * chunk; i < std::min(P, (c + 1) * chunk); ++i) {
      unet::softmax_row(x + i * K, int(K), p.data());
      // g_k = -gk (A_k t_k - B_k); dlogit_j = p_j (g_j - sum_k p_k g_k)
      float dot = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const float g = -gk * ((k == y[i] ? A[size_t(k)] : 0.f) - B[size_t(k)]);
        dot += p[size_t(k)] * g;
      }
      for (int64_t k = 0; k < K; ++k) {
        const float g = -gk * ((k == y[i] ? A[size_t(k)] : 0.f) - B[size_t(k)]);
        d[i * K + k] = p[size_t(k)] * (g - dot);
      }
    }
  }
  store_f32(d, dlogits);
}

}  // namespace dtrain

#pragma once
// Naive reference implementations of the backend ops, straight from the definitions, in
// double, on host vectors. The parity table (tests/backend/parity/) checks the CPU backend against
// them: the specification. Layouts as in backend.h: NHWC images, OHWI conv weights.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "backend/backend.h"

namespace dtrain::ref {

using Vec = std::vector<float>;

// ---- gemm: c = alpha*op(a)@op(b) + beta*c; op(a) [M,K], op(b) [K,N]
inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const Vec& a,
                 const Vec& b, double beta, Vec& c) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += double(ta ? a[k * M + i] : a[i * K + k]) * double(tb ? b[j * K + k] : b[k * N + j]);
      c[i * N + j] = float(alpha * s + (beta == 0 ? 0.0 : beta * c[i * N + j]));
    }
}

// ---- convolution
struct Conv {
  int64_t N, H, W, C, O, KH, KW;
  Conv2dParams p;
  int64_t OH() const { return (H + 2 * p.pad_h - p.dil_h * (KH - 1) - 1) / p.stride_h + 1; }
  int64_t OW() const { return (W + 2 * p.pad_w - p.dil_w * (KW - 1) - 1) / p.stride_w + 1; }
  int64_t xsize() const { return N * H * W * C; }
  int64_t wsize() const { return O * KH * KW * C; }
  int64_t ysize() const { return N * OH() * OW() * O; }
  // calls f(x index, w index, y index) for every multiply-add of the convolution
  template <typename F>
  void each(F f) const {
    const int64_t oh_n = OH(), ow_n = OW();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t oh = 0; oh < oh_n; ++oh)
        for (int64_t ow = 0; ow < ow_n; ++ow)
          for (int64_t o = 0; o < O; ++o)
            for (int64_t kh = 0; kh < KH; ++kh)
              for (int64_t kw = 0; kw < KW; ++kw) {
                const int64_t ih = oh * p.stride_h - p.pad_h + kh * p.dil_h;
                const int64_t iw = ow * p.stride_w - p.pad_w + kw * p.dil_w;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                for (int64_t c = 0; c < C; ++c)
                  f(((n * H + ih) * W + iw) * C + c, ((o * KH + kh) * KW + kw) * C + c,
                    ((n * oh_n + oh) * ow_n + ow) * O + o);
              }
  }
};

inline Vec conv2d_fwd(const Conv& g, const Vec& x, const Vec& w, const Vec* bias) {
  std::vector<double> y(size_t(g.ysize()), 0.0);
  g.each([&](int64_t xi, int64_t wi, int64_t yi) { y[yi] += double(x[xi]) * w[wi]; });
  Vec out(y.size());
  for (size_t i = 0; i < y.size(); ++i)
    out[i] = float(y[i] + (bias ? double((*bias)[i % size_t(g.O)]) : 0.0));
  return out;
}
inline Vec conv2d_bwd_data(const Conv& g, const Vec& dy, const Vec& w) {
  std::vector<double> dx(size_t(g.xsize()), 0.0);
  g.each([&](int64_t xi, int64_t wi, int64_t yi) { dx[xi] += double(dy[yi]) * w[wi]; });
  return Vec(dx.begin(), dx.end());
}
inline Vec conv2d_bwd_filter(const Conv& g, const Vec& x, const Vec& dy) {
  std::vector<double> dw(size_t(g.wsize()), 0.0);
  g.each([&](int64_t xi, int64_t wi, int64_t yi) { dw[wi] += double(dy[yi]) * x[xi]; });
  return Vec(dw.begin(), dw.end());
}
// sum over rows of x [M,N]
inline Vec sum_rows(const Vec& x, int64_t N) {
  std::vector<double> s(size_t(N), 0.0);
  for (size_t i = 0; i < x.size(); ++i) s[i % size_t(N)] += x[i];
  return Vec(s.begin(), s.end());
}

// ---- batch norm over x [M,C]
struct BnStats {
  std::vector<double> mean, var;  // biased variance
};
inline BnStats bn_stats(const Vec& x, int64_t C) {
  const int64_t M = int64_t(x.size()) / C;
  BnStats s{std::vector<double>(size_t(C), 0.0), std::vector<double>(size_t(C), 0.0)};
  for (int64_t i = 0; i < M * C; ++i) s.mean[size_t(i % C)] += x[size_t(i)];
  for (auto& m : s.mean) m /= double(M);
  for (int64_t i = 0; i < M * C; ++i) {
    const double t = x[size_t(i)] - s.mean[size_t(i % C)];
    s.var[size_t(i % C)] += t * t;
  }
  for (auto& v : s.var) v /= double(M);
  return s;
}
inline Vec bn_apply(const Vec& x, int64_t C, const std::vector<double>& mean,
                    const std::vector<double>& var, const Vec& gamma, const Vec& beta, double eps) {
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t c = i % size_t(C);
    y[i] = float((x[i] - mean[c]) / std::sqrt(var[c] + eps) * gamma[c] + beta[c]);
  }
  return y;
}
// returns dx; dgamma, dbeta out
inline Vec bn_bwd(const Vec& dy, const Vec& x, int64_t C, const Vec& gamma, double eps,
                  Vec& dgamma, Vec& dbeta) {
  const BnStats s = bn_stats(x, C);
  const int64_t M = int64_t(x.size()) / C;
  std::vector<double> sdy(size_t(C), 0.0), sdyx(size_t(C), 0.0);
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t c = i % size_t(C);
    const double xhat = (x[i] - s.mean[c]) / std::sqrt(s.var[c] + eps);
    sdy[c] += dy[i];
    sdyx[c] += dy[i] * xhat;
  }
  dgamma.assign(sdyx.begin(), sdyx.end());
  dbeta.assign(sdy.begin(), sdy.end());
  Vec dx(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t c = i % size_t(C);
    const double is = 1.0 / std::sqrt(s.var[c] + eps);
    const double xhat = (x[i] - s.mean[c]) * is;
    dx[i] = float(gamma[c] * is * (dy[i] - sdy[c] / double(M) - xhat * sdyx[c] / double(M)));
  }
  return dx;
}

// ---- pooling, x [N,H,W,C]
struct Pool {
  int64_t N, H, W, C;
  Pool2dParams p;
  int64_t OH() const { return (H + 2 * p.pad_h - p.kernel_h) / p.stride_h + 1; }
  int64_t OW() const { return (W + 2 * p.pad_w - p.kernel_w) / p.stride_w + 1; }
  int64_t xsize() const { return N * H * W * C; }
  int64_t ysize() const { return N * OH() * OW() * C; }
};
// max pool; argmax (x index of the first max in window scan order) returned in `arg`
inline Vec maxpool_fwd(const Pool& g, const Vec& x, std::vector<int64_t>* arg = nullptr) {
  Vec y(size_t(g.ysize()));
  if (arg) arg->assign(y.size(), -1);
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t oh = 0; oh < g.OH(); ++oh)
      for (int64_t ow = 0; ow < g.OW(); ++ow)
        for (int64_t c = 0; c < g.C; ++c) {
          double best = -std::numeric_limits<double>::infinity();
          int64_t bi = -1;
          for (int64_t kh = 0; kh < g.p.kernel_h; ++kh)
            for (int64_t kw = 0; kw < g.p.kernel_w; ++kw) {
              const int64_t ih = oh * g.p.stride_h - g.p.pad_h + kh;
              const int64_t iw = ow * g.p.stride_w - g.p.pad_w + kw;
              if (ih < 0 || ih >= g.H || iw < 0 || iw >= g.W) continue;
              const int64_t xi = ((n * g.H + ih) * g.W + iw) * g.C + c;
              if (bi < 0 || x[size_t(xi)] > best) best = x[size_t(xi)], bi = xi;
            }
          const size_t yi = size_t(((n * g.OH() + oh) * g.OW() + ow) * g.C + c);
          y[yi] = float(best);
          if (arg) (*arg)[yi] = bi;
        }
  return y;
}
inline Vec maxpool_bwd(const Pool& g, const Vec& x, const Vec& dy) {
  std::vector<int64_t> arg;
  maxpool_fwd(g, x, &arg);
  std::vector<double> dx(size_t(g.xsize()), 0.0);
  for (size_t i = 0; i < arg.size(); ++i) dx[size_t(arg[i])] += dy[i];
  return Vec(dx.begin(), dx.end());
}
// average pool, count_include_pad = true; calls f(x index, y index, 1/divisor)
template <typename F>
void avgpool_each(const Pool& g, F f) {
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t oh = 0; oh < g.OH(); ++oh)
      for (int64_t ow = 0; ow < g.OW(); ++ow) {
        const int64_t h0 = oh * g.p.stride_h - g.p.pad_h, w0 = ow * g.p.stride_w - g.p.pad_w;
        const int64_t h1 = std::min(h0 + g.p.kernel_h, g.H + g.p.pad_h);
        const int64_t w1 = std::min(w0 + g.p.kernel_w, g.W + g.p.pad_w);
        const double inv = 1.0 / double((h1 - h0) * (w1 - w0));
        for (int64_t ih = std::max<int64_t>(h0, 0); ih < std::min(h1, g.H); ++ih)
          for (int64_t iw = std::max<int64_t>(w0, 0); iw < std::min(w1, g.W); ++iw)
            for (int64_t c = 0; c < g.C; ++c)
              f(((n * g.H + ih) * g.W + iw) * g.C + c, ((n * g.OH() + oh) * g.OW() + ow) * g.C + c,
                inv);
      }
}
inline Vec avgpool_fwd(const Pool& g, const Vec& x) {
  std::vector<double> y(size_t(g.ysize()), 0.0);
  avgpool_each(g, [&](int64_t xi, int64_t yi, double inv) { y[size_t(yi)] += x[size_t(xi)] * inv; });
  return Vec(y.begin(), y.end());
}
inline Vec avgpool_bwd(const Pool& g, const Vec& dy) {
  std::vector<double> dx(size_t(g.xsize()), 0.0);
  avgpool_each(g, [&](int64_t xi, int64_t yi, double inv) { dx[size_t(xi)] += dy[size_t(yi)] * inv; });
  return Vec(dx.begin(), dx.end());
}

// ---- softmax cross-entropy with label smoothing (PyTorch's definition), logits [N,C]
inline double xent_row(const float* z, int64_t C, int label, double s, float* dz, double gs) {
  double m = z[0];
  for (int64_t c = 1; c < C; ++c) m = std::max(m, double(z[c]));
  double se = 0;
  for (int64_t c = 0; c < C; ++c) se += std::exp(z[c] - m);
  double loss = 0;
  for (int64_t c = 0; c < C; ++c) {
    const double t = (c == label ? 1.0 - s : 0.0) + s / double(C);
    const double logp = z[c] - m - std::log(se);
    loss -= t * logp;
    if (dz) dz[c] = float(gs * (std::exp(logp) - t));
  }
  return loss;
}

}  // namespace dtrain::ref

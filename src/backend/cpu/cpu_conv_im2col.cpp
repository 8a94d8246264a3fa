// im2col + sgemm convolution (the fallback and the plain path, DTRAIN_CPU_CONV=im2col).
// NHWC makes a patch row [KH,KW,C] a concatenation of contiguous C-vectors, and OHWI weights
// are [O, KH*KW*C] rows, so:
//   fwd:        y[P,O]      = col[P,K] @ w[O,K]^T          (P = images*OH*OW, K = KH*KW*C)
//   bwd data:   dcol[P,K]   = dy[P,O] @ w[O,K], then col2im (scatter-add per image)
//   bwd filter: dw[O,K]    += dy[P,O]^T @ col[P,K]
// Images are processed in chunks so that col stays under kColBudget floats; chunks are
// visited in order, so bwd filter accumulates deterministically.
#include <algorithm>
#include <cstring>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_conv.h"

namespace dtrain {

namespace {
constexpr int64_t kColBudget = int64_t(8) << 20;  // floats (32 MiB)

bool is_pointwise(const cpu::ConvDims& d) {
  return d.KH == 1 && d.KW == 1 && d.p.stride_h == 1 && d.p.stride_w == 1 && d.p.pad_h == 0 &&
         d.p.pad_w == 0;
}
int64_t images_per_chunk(const cpu::ConvDims& d) {
  const int64_t per = d.OH * d.OW * d.KH * d.KW * d.C;
  return std::clamp<int64_t>(kColBudget / std::max<int64_t>(per, 1), 1, d.N);
}

// col [nb*OH*OW, KH*KW*C] from x images [n0, n0+nb)
void im2col(const cpu::ConvDims& d, const float* x, int64_t n0, int64_t nb, float* col) {
  const int64_t K = d.KH * d.KW * d.C;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < nb; ++n)
    for (int64_t oh = 0; oh < d.OH; ++oh) {
      const float* xn = x + (n0 + n) * d.H * d.W * d.C;
      for (int64_t ow = 0; ow < d.OW; ++ow) {
        float* row = col + ((n * d.OH + oh) * d.OW + ow) * K;
        for (int64_t kh = 0; kh < d.KH; ++kh) {
          const int64_t ih = oh * d.p.stride_h - d.p.pad_h + kh * d.p.dil_h;
          for (int64_t kw = 0; kw < d.KW; ++kw) {
            const int64_t iw = ow * d.p.stride_w - d.p.pad_w + kw * d.p.dil_w;
            float* dst = row + (kh * d.KW + kw) * d.C;
            if (ih < 0 || ih >= d.H || iw < 0 || iw >= d.W)
              std::memset(dst, 0, size_t(d.C) * sizeof(float));
            else
              std::memcpy(dst, xn + (ih * d.W + iw) * d.C, size_t(d.C) * sizeof(float));
          }
        }
      }
    }
}

// dx images [n0, n0+nb) = col2im(dcol); each image is summed serially (fixed order).
void col2im(const cpu::ConvDims& d, const float* col, int64_t n0, int64_t nb, float* dx) {
  const int64_t K = d.KH * d.KW * d.C;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < nb; ++n) {
    float* dxn = dx + (n0 + n) * d.H * d.W * d.C;
    std::memset(dxn, 0, size_t(d.H * d.W * d.C) * sizeof(float));
    for (int64_t oh = 0; oh < d.OH; ++oh)
      for (int64_t ow = 0; ow < d.OW; ++ow) {
        const float* row = col + ((n * d.OH + oh) * d.OW + ow) * K;
        for (int64_t kh = 0; kh < d.KH; ++kh) {
          const int64_t ih = oh * d.p.stride_h - d.p.pad_h + kh * d.p.dil_h;
          if (ih < 0 || ih >= d.H) continue;
          for (int64_t kw = 0; kw < d.KW; ++kw) {
            const int64_t iw = ow * d.p.stride_w - d.p.pad_w + kw * d.p.dil_w;
            if (iw < 0 || iw >= d.W) continue;
            const float* src = row + (kh * d.KW + kw) * d.C;
            float* dst = dxn + (ih * d.W + iw) * d.C;
            for (int64_t c = 0; c < d.C; ++c) dst[c] += src[c];
          }
        }
      }
  }
}

// f(n0, cnt, a) for each chunk of images [n0, n0 + cnt), a the chunk's [cnt * P, K] input
// matrix: x itself for a pointwise conv, else its im2col (in scratch slot 8).
template <class F>
void for_each_chunk(CpuBackend& be, const cpu::ConvDims& d, const float* x, const F& f) {
  const int64_t K = d.KH * d.KW * d.C, P = d.OH * d.OW;
  const int64_t nb = images_per_chunk(d);
  float* col = is_pointwise(d) ? nullptr : be.scratch(8, nb * P * K);
  for (int64_t n0 = 0; n0 < d.N; n0 += nb) {
    const int64_t cnt = std::min(nb, d.N - n0);
    const float* a = x + n0 * d.H * d.W * d.C;
    if (col) {
      im2col(d, x, n0, cnt, col);
      a = col;
    }
    f(n0, cnt, a);
  }
}
}  // namespace

void CpuBackend::conv_im2col_fwd(const float* x, const float* w, const float* b, float* y,
                                 const Tensor& xt, const Tensor& wt, const Tensor& yt,
                                 const Conv2dParams& p) {
  const cpu::ConvDims d = cpu::conv_dims("conv2d_fwd", xt, wt, yt, p);
  const int64_t K = d.KH * d.KW * d.C, P = d.OH * d.OW;
  for_each_chunk(*this, d, x, [&](int64_t n0, int64_t cnt, const float* a) {
    cpu::sgemm(false, true, cnt * P, d.O, K, 1.f, a, K, w, K, 0.f, y + n0 * P * d.O, d.O);
  });
  if (b) {
    const int64_t M = d.N * P;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t o = 0; o < d.O; ++o) y[i * d.O + o] += b[o];
  }
}

void CpuBackend::conv_im2col_bwd_data(const float* dy, const float* w, float* dx,
                                      const Tensor& dyt, const Tensor& wt, const Tensor& dxt,
                                      const Conv2dParams& p) {
  const cpu::ConvDims d = cpu::conv_dims("conv2d_bwd_data", dxt, wt, dyt, p);
  const int64_t K = d.KH * d.KW * d.C, P = d.OH * d.OW;
  const int64_t nb = images_per_chunk(d);
  const bool pw = is_pointwise(d);
  float* col = pw ? nullptr : scratch(8, nb * P * K);
  for (int64_t n0 = 0; n0 < d.N; n0 += nb) {
    const int64_t cnt = std::min(nb, d.N - n0);
    float* out = pw ? dx + n0 * d.H * d.W * d.C : col;
    cpu::sgemm(false, false, cnt * P, K, d.O, 1.f, dy + n0 * P * d.O, d.O, w, K, 0.f, out, K);
    if (!pw) col2im(d, col, n0, cnt, dx);
  }
}

void CpuBackend::conv_im2col_bwd_filter(const float* x, const float* dy, float* dw,
                                        const Tensor& xt, const Tensor& dyt, const Tensor& dwt,
                                        const Conv2dParams& p, bool accumulate) {
  const cpu::ConvDims d = cpu::conv_dims("conv2d_bwd_filter", xt, dwt, dyt, p);
  const int64_t K = d.KH * d.KW * d.C, P = d.OH * d.OW;
  for_each_chunk(*this, d, x, [&](int64_t n0, int64_t cnt, const float* bmat) {
    const float beta = (n0 == 0 && !accumulate) ? 0.f : 1.f;
    cpu::sgemm(true, false, d.O, K, cnt * P, 1.f, dy + n0 * P * d.O, d.O, bmat, K, beta, dw, K);
  });
}

}  // namespace dtrain

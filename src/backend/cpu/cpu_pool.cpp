// CpuBackend pooling over NHWC: max pool (the forward records each window's winner in a u8
// argmax that the backward routes through; NaN propagates, as PyTorch), average pool
// (count_include_pad = true), global average pool. Parallel over images; each image's
// backward scatter is serial, so results are deterministic.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace dtrain {

namespace {
// x [N,H,W,C] -> y [N,OH,OW,C]
struct PoolDims {
  int64_t N, H, W, C, OH, OW;
  Pool2dParams p;
  // window rows [h0, h1) (clipped) and the unclipped count_include_pad divisor
  void window(int64_t oh, int64_t ow, int64_t& h0, int64_t& h1, int64_t& w0, int64_t& w1,
              int64_t* divisor = nullptr) const {
    h0 = oh * p.stride_h - p.pad_h;
    w0 = ow * p.stride_w - p.pad_w;
    h1 = std::min(h0 + p.kernel_h, H + p.pad_h);
    w1 = std::min(w0 + p.kernel_w, W + p.pad_w);
    if (divisor) *divisor = (h1 - h0) * (w1 - w0);
    h0 = std::max<int64_t>(h0, 0), w0 = std::max<int64_t>(w0, 0);
    h1 = std::min(h1, H), w1 = std::min(w1, W);
  }
};

PoolDims pool_dims(const char* op, const Tensor& x, const Tensor& y, const Pool2dParams& p) {
  auto bad = [&](const char* why) {
    fault("cpu backend: {}: {}: x {} y {} kernel {}x{} stride {}x{} pad {}x{}", op, why,
          x.shape.str(), y.shape.str(), p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h,
          p.pad_w);
  };
  if (x.ndim() != 4 || y.ndim() != 4) bad("expected 4-D NHWC tensors");
  if (p.kernel_h < 1 || p.kernel_w < 1 || p.stride_h < 1 || p.stride_w < 1 || p.pad_h < 0 ||
      p.pad_w < 0 || 2 * p.pad_h > p.kernel_h || 2 * p.pad_w > p.kernel_w)
    bad("invalid kernel/stride/pad (pad must be at most half the kernel)");
  PoolDims d{x.dim(0), x.dim(1), x.dim(2), x.dim(3), 0, 0, p};
  d.OH = (d.H + 2 * p.pad_h - p.kernel_h) / p.stride_h + 1;
  d.OW = (d.W + 2 * p.pad_w - p.kernel_w) / p.stride_w + 1;
  if (d.OH < 1 || d.OW < 1) bad("empty output");
  if (y.dim(0) != d.N || y.dim(1) != d.OH || y.dim(2) != d.OW || y.dim(3) != d.C)
    bad("output shape is not [N,OH,OW,C]");
  return d;
}
}  // namespace

// argmax: u8 with y's shape (undefined: not written), offsets within the window (backend.h).
static uint8_t* argmax_ptr(const char* op, const Tensor& argmax, const Tensor& y, const Pool2dParams& p,
                    bool required) {
  if (!argmax.defined()) {
    if (required) fault("cpu backend: {}: argmax is required", op);
    return nullptr;
  }
  if (argmax.dtype != DType::U8 || argmax.shape != y.shape)
    fault("cpu backend: {}: argmax {} must be u8 with shape {}", op, argmax.str(), y.shape.str());
  if (p.kernel_h * p.kernel_w > 256)
    fault("cpu backend: {}: a {}x{} window does not fit u8 argmax offsets", op, p.kernel_h,
          p.kernel_w);
  return static_cast<uint8_t*>(argmax.data);
}

void CpuBackend::maxpool2d_fwd(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p) {
  require(Op::MaxPoolFwd, x);
  require(Op::MaxPoolFwd, y);
  const PoolDims d = pool_dims("maxpool2d_fwd", x, y, p);
  uint8_t* pa = argmax_ptr("maxpool2d_fwd", argmax, y, p, false);
  const float* px = in_f32(x, 0);
  float* py = out_f32(y, 1, false);
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t oh = 0; oh < d.OH; ++oh)
      for (int64_t ow = 0; ow < d.OW; ++ow) {
        int64_t h0, h1, w0, w1;
        d.window(oh, ow, h0, h1, w0, w1);
        const int64_t o = (n * d.OH + oh) * d.OW + ow;
        float* out = py + o * d.C;
        for (int64_t c = 0; c < d.C; ++c) out[c] = ninf;
        if (!pa) {
          for (int64_t ih = h0; ih < h1; ++ih)
            for (int64_t iw = w0; iw < w1; ++iw) {
              const float* in = px + ((n * d.H + ih) * d.W + iw) * d.C;
              for (int64_t c = 0; c < d.C; ++c)
                if (in[c] > out[c] || std::isnan(in[c])) out[c] = in[c];
            }
          continue;
        }
        // offsets count from the unclipped window's corner; the first valid cell starts
        const int64_t wh = oh * p.stride_h - p.pad_h, ww = ow * p.stride_w - p.pad_w;
        uint8_t* am = pa + o * d.C;
        std::memset(am, int((h0 - wh) * p.kernel_w + (w0 - ww)), size_t(d.C));
        for (int64_t ih = h0; ih < h1; ++ih)
          for (int64_t iw = w0; iw < w1; ++iw) {
            const float* in = px + ((n * d.H + ih) * d.W + iw) * d.C;
            const uint8_t pos = uint8_t((ih - wh) * p.kernel_w + (iw - ww));
            for (int64_t c = 0; c < d.C; ++c)
              if (in[c] > out[c] || std::isnan(in[c])) out[c] = in[c], am[c] = pos;
          }
      }
  store_f32(py, y);
}

void CpuBackend::maxpool2d_bwd(const Tensor& argmax, const Tensor& dy, Tensor& dx,
                               const Pool2dParams& p, bool accumulate) {
  require_all(Op::MaxPoolBwd, dy, dx);
  const PoolDims d = pool_dims("maxpool2d_bwd", dx, dy, p);
  const uint8_t* pa = argmax_ptr("maxpool2d_bwd", argmax, dy, p, true);
  const float* pdy = in_f32(dy, 1);
  float* pdx = accumulate ? scratch(3, dx.numel()) : out_f32(dx, 2, false);
  // element offset of each window position from the window's corner cell
  std::vector<int64_t> off(size_t(p.kernel_h * p.kernel_w));
  for (int a = 0; a < p.kernel_h; ++a)
    for (int b = 0; b < p.kernel_w; ++b) off[size_t(a * p.kernel_w + b)] = (a * d.W + b) * d.C;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < d.N; ++n) {
    float* dxn = pdx + n * d.H * d.W * d.C;
    std::memset(dxn, 0, size_t(d.H * d.W * d.C) * sizeof(float));
    for (int64_t oh = 0; oh < d.OH; ++oh)
      for (int64_t ow = 0; ow < d.OW; ++ow) {
        const int64_t o = (n * d.OH + oh) * d.OW + ow;
        const int64_t corner = ((oh * p.stride_h - p.pad_h) * d.W + (ow * p.stride_w - p.pad_w)) * d.C;
        const uint8_t* am = pa + o * d.C;
        const float* g = pdy + o * d.C;
        for (int64_t c = 0; c < d.C; ++c) dxn[corner + off[am[c]] + c] += g[c];
      }
  }
  if (accumulate)
    add_rounded(pdx, dx, 4);
  else
    store_f32(pdx, dx);
}

void CpuBackend::avgpool2d_fwd(const Tensor& x, Tensor& y, const Pool2dParams& p) {
  require_all(Op::AvgPoolFwd, x, y);
  const PoolDims d = pool_dims("avgpool2d_fwd", x, y, p);
  const float* px = in_f32(x, 0);
  float* py = out_f32(y, 1, false);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t oh = 0; oh < d.OH; ++oh)
      for (int64_t ow = 0; ow < d.OW; ++ow) {
        int64_t h0, h1, w0, w1, div;
        d.window(oh, ow, h0, h1, w0, w1, &div);
        float* out = py + ((n * d.OH + oh) * d.OW + ow) * d.C;
        for (int64_t c = 0; c < d.C; ++c) out[c] = 0.f;
        for (int64_t ih = h0; ih < h1; ++ih)
          for (int64_t iw = w0; iw < w1; ++iw) {
            const float* in = px + ((n * d.H + ih) * d.W + iw) * d.C;
            for (int64_t c = 0; c < d.C; ++c) out[c] += in[c];
          }
        const float inv = 1.f / float(div);
        for (int64_t c = 0; c < d.C; ++c) out[c] *= inv;
      }
  store_f32(py, y);
}

void CpuBackend::avgpool2d_bwd(const Tensor& dy, Tensor& dx, const Pool2dParams& p) {
  require_all(Op::AvgPoolBwd, dy, dx);
  const PoolDims d = pool_dims("avgpool2d_bwd", dx, dy, p);
  const float* pdy = in_f32(dy, 0);
  float* pdx = out_f32(dx, 1, false);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < d.N; ++n) {
    float* dxn = pdx + n * d.H * d.W * d.C;
    std::memset(dxn, 0, size_t(d.H * d.W * d.C) * sizeof(float));
    for (int64_t oh = 0; oh < d.OH; ++oh)
      for (int64_t ow = 0; ow < d.OW; ++ow) {
        int64_t h0, h1, w0, w1, div;
        d.window(oh, ow, h0, h1, w0, w1, &div);
        const float inv = 1.f / float(div);
        const float* g = pdy + ((n * d.OH + oh) * d.OW + ow) * d.C;
        for (int64_t ih = h0; ih < h1; ++ih)
          for (int64_t iw = w0; iw < w1; ++iw) {
            float* out = dxn + (ih * d.W + iw) * d.C;
            for (int64_t c = 0; c < d.C; ++c) out[c] += g[c] * inv;
          }
      }
  }
  store_f32(pdx, dx);
}

void CpuBackend::global_avgpool_fwd(const Tensor& x, Tensor& y) {
  require(Op::GlobalAvgPoolFwd, x);
  require(Op::GlobalAvgPoolFwd, y);
  if (x.ndim() != 4 || y.numel() != x.dim(0) * x.dim(3) || y.dim(-1) != x.dim(3))
    fault("cpu backend: global_avgpool_fwd: x {} is not [N,H,W,C] for y {} [N,C]", x.str(), y.str());
  const int64_t N = x.dim(0), HW = x.dim(1) * x.dim(2), C = x.dim(3);
  const float* px = in_f32(x, 0);
  float* py = out_f32(y, 1, false);
  const float inv = 1.f / float(HW);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* out = py + n * C;
    for (int64_t c = 0; c < C; ++c) out[c] = 0.f;
    for (int64_t i = 0; i < HW; ++i) {
      const float* in = px + (n * HW + i) * C;
      for (int64_t c = 0; c < C; ++c) out[c] += in[c];
    }
    for (int64_t c = 0; c < C; ++c) out[c] *= inv;
  }
  store_f32(py, y);
}

void CpuBackend::global_avgpool_bwd(const Tensor& dy, Tensor& dx) {
  require(Op::GlobalAvgPoolBwd, dy);
  require(Op::GlobalAvgPoolBwd, dx);
  if (dx.ndim() != 4 || dy.numel() != dx.dim(0) * dx.dim(3) || dy.dim(-1) != dx.dim(3))
    fault("cpu backend: global_avgpool_bwd: dx {} is not [N,H,W,C] for dy {} [N,C]", dx.str(),
          dy.str());
  const int64_t N = dx.dim(0), HW = dx.dim(1) * dx.dim(2), C = dx.dim(3);
  const float* pdy = in_f32(dy, 0);
  float* pdx = out_f32(dx, 1, false);
  const float inv = 1.f / float(HW);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < HW; ++i) {
      float* out = pdx + (n * HW + i) * C;
      for (int64_t c = 0; c < C; ++c) out[c] = pdy[n * C + c] * inv;
    }
  store_f32(pdx, dx);
}

}  // namespace dtrain

// CpuBackend convolution entry points: shape checks, 16-bit emulation, and dispatch to
// oneDNN (default) or im2col + sgemm (DTRAIN_CPU_CONV=im2col, or geometries oneDNN cannot
// express).
#include "backend/cpu/cpu_conv.h"

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace dtrain {

namespace cpu {
ConvDims conv_dims(const char* op, const Tensor& x, const Tensor& w, const Tensor& y,
                   const Conv2dParams& p) {
  auto bad = [&](const char* why) {
    fault("cpu backend: {}: {}: x {} w {} y {} stride {}x{} pad {}x{} dil {}x{}", op, why,
          x.shape.str(), w.shape.str(), y.shape.str(), p.stride_h, p.stride_w, p.pad_h, p.pad_w,
          p.dil_h, p.dil_w);
  };
  if (x.ndim() != 4 || w.ndim() != 4 || y.ndim() != 4) bad("expected 4-D NHWC/OHWI tensors");
  if (p.stride_h < 1 || p.stride_w < 1 || p.dil_h < 1 || p.dil_w < 1 || p.pad_h < 0 ||
      p.pad_w < 0)
    bad("invalid stride/pad/dilation");
  ConvDims d;
  d.N = x.dim(0), d.H = x.dim(1), d.W = x.dim(2), d.C = x.dim(3);
  d.O = w.dim(0), d.KH = w.dim(1), d.KW = w.dim(2);
  d.p = p;
  if (w.dim(3) != d.C) bad("weight input channels differ from x channels");
  d.OH = ConvDims::out_size(d.H, d.KH, p.pad_h, p.stride_h, p.dil_h);
  d.OW = ConvDims::out_size(d.W, d.KW, p.pad_w, p.stride_w, p.dil_w);
  if (d.OH < 1 || d.OW < 1) bad("empty output");
  if (y.dim(0) != d.N || y.dim(1) != d.OH || y.dim(2) != d.OW || y.dim(3) != d.O)
    bad("output shape is not [N,OH,OW,O]");
  return d;
}
}  // namespace cpu

cpu::ConvCache& CpuBackend::dnnl_cache() {
  if (!conv_cache_) conv_cache_.reset(cpu::conv_cache_new());
  return *conv_cache_;
}

AllocCounts CpuBackend::alloc_counts() const {
  AllocCounts c = counts_;
  const int64_t plans = conv_cache_ ? cpu::conv_cache_plans(*conv_cache_) : 0;
  c.internal += plans;
  c.system_allocs += plans;
  return c;
}

std::string CpuBackend::dnnl_impl_info() {
  cpu::ConvCache& c = dnnl_cache();
  return fmt::format("fwd {}, bwd_data {}, bwd_filter {}", cpu::dnnl_impl_name(c, 0),
                     cpu::dnnl_impl_name(c, 1), cpu::dnnl_impl_name(c, 2));
}

// Scratch slots: 3..5 inputs, 6..7 outputs, 8..9 im2col buffers and partial sums.
void CpuBackend::conv2d_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                            const Conv2dParams& p) {
  require_all(Op::Conv2dFwd, x, w, bias, y);
  cpu::ConvDims d = cpu::conv_dims("conv2d_fwd", x, w, y, p);
  d.has_bias = bias.defined();
  if (d.has_bias && bias.numel() != d.O)
    fault("cpu backend: conv2d_fwd: bias {} does not match {} output channels", bias.str(), d.O);
  const float* px = in_f32(x, 3);
  const float* pw = in_f32(w, 4);
  const float* pb = in_f32(bias, 5);
  float* py = out_f32(y, 6, false);
  if (conv_impl_ != cpu::ConvImpl::Dnnl || !cpu::dnnl_conv_fwd(dnnl_cache(), d, px, pw, pb, py))
    conv_im2col_fwd(px, pw, pb, py, x, w, y, p);
  store_f32(py, y);
}

void CpuBackend::conv2d_bwd_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                                 const Conv2dParams& p, bool accumulate) {
  require_all(Op::Conv2dBwdData, dy, w, dx);
  cpu::ConvDims d = cpu::conv_dims("conv2d_bwd_data", dx, w, dy, p);
  const float* pdy = in_f32(dy, 3);
  const float* pw = in_f32(w, 4);
  float* pdx = accumulate ? scratch(7, dx.numel()) : out_f32(dx, 6, false);
  if (conv_impl_ != cpu::ConvImpl::Dnnl || !cpu::dnnl_conv_bwd_data(dnnl_cache(), d, pdy, pw, pdx))
    conv_im2col_bwd_data(pdy, pw, pdx, dy, w, dx, p);
  if (accumulate)
    add_rounded(pdx, dx, 9);
  else
    store_f32(pdx, dx);
}

void CpuBackend::conv2d_bwd_filter(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& dbias,
                                   const Conv2dParams& p, bool accumulate) {
  require_all(Op::Conv2dBwdFilter, x, dy, dw, dbias);
  cpu::ConvDims d = cpu::conv_dims("conv2d_bwd_filter", x, dw, dy, p);
  d.has_bias = dbias.defined();
  if (d.has_bias && dbias.numel() != d.O)
    fault("cpu backend: conv2d_bwd_filter: dbias {} does not match {} output channels",
          dbias.str(), d.O);
  const float* px = in_f32(x, 3);
  const float* pdy = in_f32(dy, 4);
  float* pdw = out_f32(dw, 6, accumulate);
  float* pdb = out_f32(dbias, 7, accumulate);
  bool done = conv_impl_ == cpu::ConvImpl::Dnnl &&
              cpu::dnnl_conv_bwd_filter(dnnl_cache(), d, px, pdy, pdw, pdb, accumulate);
  if (!done) {
    conv_im2col_bwd_filter(px, pdy, pdw, x, dy, dw, p, accumulate);
    if (d.has_bias) {
      const int64_t M = d.N * d.OH * d.OW;
      cpu::sum_rows_f32(pdy, M, d.O, pdb, accumulate, scratch64(3, cpu::sum_rows_partials(M, d.O)));
    }
  }
  store_f32(pdw, dw);
  store_f32(pdb, dbias);
}

}  // namespace dtrain

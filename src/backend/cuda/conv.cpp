// Convolution through cuDNN's legacy API in NHWC: data descriptors CUDNN_TENSOR_NHWC,
// filter CUDNN_TENSOR_NHWC = KRSC, which is dtrain's OHWI. One plan per (direction,
// shapes, params, dtype, TF32) holds the descriptors and the algorithm cuDNN's heuristics
// (Get*_v7) rank first among those that succeed within the workspace cap, or, with
// run.cudnn_benchmark, the fastest cudnnFind*AlgorithmEx timed on the call's own buffers
// (falling back to the heuristics, with a warning, if timing fails). Math: FMA for
// f32 (TF32 only when allowed), tensor ops for bf16/f16; accumulation in f32.
#include <fmt/format.h>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/plans.h"
#include "core/buffer.h"
#include "core/log.h"

namespace dtrain {
namespace {

enum Kind { kFwd = 0, kBwdData = 1, kBwdFilter = 2 };
constexpr size_t kMaxConvWorkspace = size_t(1) << 30;
constexpr size_t kFindWorkspace = size_t(512) << 20;  // run.cudnn_benchmark: algorithms timed within it
constexpr int kMaxAlgos = 16;

cudnnDataType_t cudnn_dtype(DType t) {
  switch (t) {
    case DType::BF16: return CUDNN_DATA_BFLOAT16;
    case DType::F16: return CUDNN_DATA_HALF;
    default: return CUDNN_DATA_FLOAT;
  }
}

std::string conv_what(const char* op, const Tensor& x, const Tensor& w, const Tensor& y,
                      const Conv2dParams& p) {
  return fmt::format("{} x={} w={} y={} stride={}x{} pad={}x{} dil={}x{}", op, x.str(), w.str(),
                     y.str(), p.stride_h, p.stride_w, p.pad_h, p.pad_w, p.dil_h, p.dil_w);
}

// Picks the first heuristic result that succeeded, fits the cap and uses allowed math.
template <typename Perf>
bool pick(const Perf* perf, int n, cudnnMathType_t want, int* algo, size_t* ws,
          cudnnMathType_t* math) {
  for (int i = 0; i < n; ++i) {
    if (perf[i].status != CUDNN_STATUS_SUCCESS || perf[i].memory > kMaxConvWorkspace) continue;
    if (want == CUDNN_FMA_MATH && perf[i].mathType != CUDNN_FMA_MATH) continue;
    *algo = int(perf[i].algo);
    *ws = perf[i].memory;
    *math = perf[i].mathType;
    return true;
  }
  return false;
}

void check_conv_shapes(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p,
                       const char* op) {
  DTRAIN_CHECK(x.ndim() == 4 && w.ndim() == 4 && y.ndim() == 4,
               "{}: expects 4-D NHWC tensors: x {} w {} y {}", op, x.str(), w.str(), y.str());
  DTRAIN_CHECK(x.dtype == w.dtype && x.dtype == y.dtype && is_float(x.dtype),
               "{}: dtypes must match: x {} w {} y {}", op, x.str(), w.str(), y.str());
  DTRAIN_CHECK(w.dim(3) == x.dim(3) && y.dim(3) == w.dim(0) && y.dim(0) == x.dim(0),
               "{}: channels: x {} w {} y {}", op, x.str(), w.str(), y.str());
  auto out = [](int64_t in, int k, int s, int pad, int d) {
    return (in + 2 * pad - d * (k - 1) - 1) / s + 1;
  };
  int64_t oh = out(x.dim(1), int(w.dim(1)), p.stride_h, p.pad_h, p.dil_h);
  int64_t ow = out(x.dim(2), int(w.dim(2)), p.stride_w, p.pad_w, p.dil_w);
  DTRAIN_CHECK(y.dim(1) == oh && y.dim(2) == ow, "{}: y {} but x {} w {} give [{},{}] spatial", op,
               y.str(), x.str(), w.str(), oh, ow);
}

// A 1x1 convolution with stride 1 and no padding is a GEMM over the N*H*W pixels of NHWC
// tensors. Those go to cuBLASLt (cached plans, low host cost per call; cuDNN's legacy API
// spent ~0.3 ms of host time per such call in ResNet-50's backward, starving the GPU), and
// the filter gradient accumulates straight into an f32 master gradient.
bool pointwise(const Tensor& w, const Conv2dParams& p) {
  return w.ndim() == 4 && w.dim(1) == 1 && w.dim(2) == 1 && p.stride_h == 1 && p.stride_w == 1 &&
         p.pad_h == 0 && p.pad_w == 0;
}
Tensor rows(const Tensor& t) { return t.view({t.numel() / t.dim(3), t.dim(3)}); }
// A pointwise convolution as one GEMM over the NHW rows: out (+)= in times the [O,C] weight
// (transposed when trans_w). False (nothing done) when the convolution is not pointwise.
bool pointwise_gemm(CudaBackend& be, const Tensor& w, const Conv2dParams& p, bool trans_w,
                    const Tensor& in, float beta, const Tensor& out) {
  if (!pointwise(w, p)) return false;
  Tensor out2 = rows(out);
  be.gemm(false, trans_w, 1.f, rows(in), w.view({w.dim(0), w.dim(3)}), beta, out2);
  return true;
}

}  // namespace

ConvPlan& CudaBackend::conv_plan(int kind, const Tensor& x, const Tensor& w, const Tensor& y,
                                 const Conv2dParams& p) {
  std::string key = fmt::format("{} {} {} {} {} {} {} {} {} {} {} {}", kind,
                                x.shape.str(), w.shape.str(), y.shape.str(), p.stride_h,
                                p.stride_w, p.pad_h, p.pad_w, p.dil_h, p.dil_w,
                                dtype_name(x.dtype), int(allow_tf32_) + 2 * int(cudnn_benchmark_ && !find_failed_));
  auto it = conv_plans_.find(key);
  if (it != conv_plans_.end()) return *it->second;

  static const char* names[] = {"conv2d_fwd", "conv2d_bwd_data", "conv2d_bwd_filter"};
  std::string what = conv_what(names[kind], x, w, y, p);
  auto plan = std::make_unique<ConvPlan>();
  cudnnDataType_t dt = cudnn_dtype(x.dtype);
  DTRAIN_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->x), what);
  DTRAIN_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->y), what);
  DTRAIN_CUDNN_CHECK(cudnnCreateFilterDescriptor(&plan->w), what);
  DTRAIN_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&plan->conv), what);
  DTRAIN_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->x, CUDNN_TENSOR_NHWC, dt, int(x.dim(0)),
                                                int(x.dim(3)), int(x.dim(1)), int(x.dim(2))), what);
  DTRAIN_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->y, CUDNN_TENSOR_NHWC, dt, int(y.dim(0)),
                                                int(y.dim(3)), int(y.dim(1)), int(y.dim(2))), what);
  DTRAIN_CUDNN_CHECK(cudnnSetFilter4dDescriptor(plan->w, dt, CUDNN_TENSOR_NHWC, int(w.dim(0)),
                                                int(w.dim(3)), int(w.dim(1)), int(w.dim(2))), what);
  DTRAIN_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(plan->conv, p.pad_h, p.pad_w, p.stride_h,
                                                     p.stride_w, p.dil_h, p.dil_w,
                                                     CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
                     what);
  cudnnMathType_t want = x.dtype != DType::F32 ? CUDNN_TENSOR_OP_MATH
                         : allow_tf32_         ? CUDNN_DEFAULT_MATH
                                               : CUDNN_FMA_MATH;
  DTRAIN_CUDNN_CHECK(cudnnSetConvolutionMathType(plan->conv, want), what);
  int n_out = 0, c_out = 0, h_out = 0, w_out = 0;
  DTRAIN_CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(plan->conv, plan->x, plan->w, &n_out,
                                                           &c_out, &h_out, &w_out), what);
  DTRAIN_CHECK(n_out == y.dim(0) && c_out == y.dim(3) && h_out == y.dim(1) && w_out == y.dim(2),
               "{}: cuDNN output dims [{},{},{},{}] differ", what, n_out, h_out, w_out, c_out);

  int returned = 0;
  bool ok = false;
  cudnnMathType_t math = want;
  if (cudnn_benchmark_ && !find_failed_) {
    // Time every algorithm on these buffers (the output goes to scratch: an accumulating
    // dx or dw must not be overwritten) and keep the fastest usable one, as PyTorch's
    // cudnn.benchmark does. Plans are made in the first steps, never inside a CUDA graph.
    const Tensor& out = kind == kFwd ? y : kind == kBwdData ? x : w;
    Buffer tmp(*this, out.nbytes());
    void* fws = conv_ws_.get(kFindWorkspace);
    cudnnStatus_t st;
    if (kind == kFwd) {
      cudnnConvolutionFwdAlgoPerf_t perf[kMaxAlgos];
      st = cudnnFindConvolutionForwardAlgorithmEx(cudnn_, plan->x, x.data, plan->w, w.data, plan->conv, plan->y,
                                                  tmp.data(), kMaxAlgos, &returned, perf, fws, kFindWorkspace);
      ok = st == CUDNN_STATUS_SUCCESS && pick(perf, returned, want, &plan->algo, &plan->workspace, &math);
    } else if (kind == kBwdData) {
      cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxAlgos];
      st = cudnnFindConvolutionBackwardDataAlgorithmEx(cudnn_, plan->w, w.data, plan->y, y.data, plan->conv,
                                                       plan->x, tmp.data(), kMaxAlgos, &returned, perf, fws,
                                                       kFindWorkspace);
      ok = st == CUDNN_STATUS_SUCCESS && pick(perf, returned, want, &plan->algo, &plan->workspace, &math);
    } else {
      cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxAlgos];
      st = cudnnFindConvolutionBackwardFilterAlgorithmEx(cudnn_, plan->x, x.data, plan->y, y.data, plan->conv,
                                                         plan->w, tmp.data(), kMaxAlgos, &returned, perf, fws,
                                                         kFindWorkspace);
      ok = st == CUDNN_STATUS_SUCCESS && pick(perf, returned, want, &plan->algo, &plan->workspace, &math);
    }
    if (!ok) {
      (void)cudaGetLastError();  // nothing of a failed timing may surface at the next check
      find_failed_ = true;
      log::warn("run.cudnn_benchmark: timing cuDNN's algorithms failed for {} ({}); using its heuristics from "
                "here on",
                what, cudnnGetErrorString(st));
      DTRAIN_CUDNN_CHECK(cudnnSetConvolutionMathType(plan->conv, want), what);
      math = want;
    }
  }
  if (ok) {
    // timed above
  } else if (kind == kFwd) {
    cudnnConvolutionFwdAlgoPerf_t perf[kMaxAlgos];
    DTRAIN_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(cudnn_, plan->x, plan->w, plan->conv,
                                                              plan->y, kMaxAlgos, &returned, perf),
                       what);
    ok = pick(perf, returned, want, &plan->algo, &plan->workspace, &math);
  } else if (kind == kBwdData) {
    cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxAlgos];
    DTRAIN_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(
                           cudnn_, plan->w, plan->y, plan->conv, plan->x, kMaxAlgos, &returned, perf),
                       what);
    ok = pick(perf, returned, want, &plan->algo, &plan->workspace, &math);
  } else {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxAlgos];
    DTRAIN_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                           cudnn_, plan->x, plan->y, plan->conv, plan->w, kMaxAlgos, &returned, perf),
                       what);
    ok = pick(perf, returned, want, &plan->algo, &plan->workspace, &math);
  }
  if (!ok)
    fault("cuDNN has no usable algorithm for {} ({} candidates; math {}, workspace cap {} MiB)",
          what, returned, int(want), kMaxConvWorkspace >> 20);
  DTRAIN_CUDNN_CHECK(cudnnSetConvolutionMathType(plan->conv, math), what);
  auto& slot = conv_plans_[key];
  slot = std::move(plan);
  return *slot;
}

void* CudaBackend::conv_workspace(size_t bytes) {
  return bytes ? conv_ws_.get(bytes) : nullptr;
}

void CudaBackend::conv2d_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                             const Conv2dParams& p) {
  check_conv_shapes(x, w, y, p, "conv2d_fwd");
  if (y.numel() == 0) return;
  if (pointwise(w, p) && bias.defined()) {  // y [NHW,O] = x [NHW,C] W^T ([O,C]) + bias
    Tensor y2 = rows(y);
    gemm_bias(false, true, rows(x), w.view({w.dim(0), w.dim(3)}), bias, y2);
    return;
  }
  conv_fwd_beta(x, w, y, p, 0.f);
  if (bias.defined()) {
    Tensor y2 = y.view({y.numel() / y.dim(3), y.dim(3)});
    add_bias(y2, bias);
  }
}

// y = conv(x, w) + beta * y (shapes checked by the caller; beta 0 or 1)
void CudaBackend::conv_fwd_beta(const Tensor& x, const Tensor& w, Tensor& y, const Conv2dParams& p, float beta) {
  // pointwise: y [NHW,O] (+)= x [NHW,C] W^T ([O,C])
  if (pointwise_gemm(*this, w, p, /*trans_w=*/true, x, beta, y)) return;
  ConvPlan& plan = conv_plan(kFwd, x, w, y, p);
  void* ws = conv_workspace(plan.workspace);
  float alpha = 1.f;
  DTRAIN_CUDNN_CHECK(cudnnConvolutionForward(cudnn_, &alpha, plan.x, x.data, plan.w, w.data,
                                             plan.conv, cudnnConvolutionFwdAlgo_t(plan.algo), ws,
                                             plan.workspace, &beta, plan.y, y.data),
                     conv_what("conv2d_fwd", x, w, y, p));
}

// ---- convolution over cat(a, b): the filter split along its input channels ----
// conv(cat(a, b), w) = conv(a, w[..., :Ca]) + conv(b, w[..., Ca:]). The two filter halves
// are copied into cat_ws_ (filters are small next to the activations a concatenation would
// copy); the second convolution adds with beta = 1 (one more read of y).
namespace {

struct CatShapes {
  int64_t ca, cb;
};
CatShapes check_cat(const Tensor& a, const Tensor& b, const Tensor& w, const char* op) {
  DTRAIN_CHECK(a.ndim() == 4 && b.ndim() == 4 && w.ndim() == 4 && a.dim(0) == b.dim(0) && a.dim(1) == b.dim(1) &&
                   a.dim(2) == b.dim(2) && a.dtype == b.dtype && w.dim(3) == a.dim(3) + b.dim(3),
               "{}: a {} and b {} do not concatenate to the input of w {}", op, a.str(), b.str(), w.str());
  return {a.dim(3), b.dim(3)};
}

}  // namespace

std::pair<Tensor, Tensor> CudaBackend::split_filter(const Tensor& w, int64_t ca, int64_t cb) {
  const int64_t rows_ = w.numel() / w.dim(3);
  const size_t ab = (size_t(rows_ * ca) * dtype_size(w.dtype) + 255) / 256 * 256;
  char* ws = static_cast<char*>(cat_ws_.get(ab + size_t(rows_ * cb) * dtype_size(w.dtype)));
  Tensor wa(ws, w.dtype, device(), Shape{w.dim(0), w.dim(1), w.dim(2), ca});
  Tensor wb(ws + ab, w.dtype, device(), Shape{w.dim(0), w.dim(1), w.dim(2), cb});
  Tensor wa2 = wa.view({rows_, ca}), wb2 = wb.view({rows_, cb});
  split_channels(w.view({rows_, ca + cb}), wa2, wb2);
  return {wa, wb};
}

void CudaBackend::conv2d_fwd_cat(const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y,
                                 const Conv2dParams& p) {
  const CatShapes c = check_cat(a, b, w, "conv2d_fwd_cat");
  auto [wa, wb] = split_filter(w, c.ca, c.cb);
  check_conv_shapes(a, wa, y, p, "conv2d_fwd_cat");
  check_conv_shapes(b, wb, y, p, "conv2d_fwd_cat");
  if (y.numel() == 0) return;
  conv_fwd_beta(a, wa, y, p, 0.f);
  conv_fwd_beta(b, wb, y, p, 1.f);
}

void CudaBackend::conv2d_bwd_data_cat(const Tensor& dy, const Tensor& w, Tensor& da, Tensor& db,
                                      const Conv2dParams& p) {
  const CatShapes c = check_cat(da, db, w, "conv2d_bwd_data_cat");
  auto [wa, wb] = split_filter(w, c.ca, c.cb);
  conv2d_bwd_data(dy, wa, da, p, /*accumulate=*/false);
  conv2d_bwd_data(dy, wb, db, p, /*accumulate=*/false);
}

void CudaBackend::conv2d_bwd_filter_cat(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& dw,
                                        const Conv2dParams& p, bool accumulate) {
  const CatShapes c = check_cat(a, b, dw, "conv2d_bwd_filter_cat");
  // the two halves' gradients in dw's dtype, then joined along the input channels into dw
  const int64_t rows_ = dw.numel() / dw.dim(3);
  const size_t es = dtype_size(dw.dtype);
  const size_t ba = (size_t(rows_ * c.ca) * es + 255) / 256 * 256, bb = (size_t(rows_ * c.cb) * es + 255) / 256 * 256;
  char* ws = static_cast<char*>(cat_ws_.get(ba + bb + size_t(dw.numel()) * es));
  Tensor ga(ws, dw.dtype, device(), Shape{dw.dim(0), dw.dim(1), dw.dim(2), c.ca});
  Tensor gb(ws + ba, dw.dtype, device(), Shape{dw.dim(0), dw.dim(1), dw.dim(2), c.cb});
  Tensor joined(ws + ba + bb, dw.dtype, device(), dw.shape);
  Tensor none;
  conv2d_bwd_filter(a, dy, ga, none, p, /*accumulate=*/false);
  conv2d_bwd_filter(b, dy, gb, none, p, /*accumulate=*/false);
  Tensor j2 = joined.view({rows_, c.ca + c.cb});
  concat_channels(ga.view({rows_, c.ca}), gb.view({rows_, c.cb}), j2);
  if (accumulate)
    add(dw, joined, dw);
  else
    copy(joined, dw);
}

void CudaBackend::conv2d_bwd_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                                  const Conv2dParams& p, bool accumulate) {
  check_conv_shapes(dx, w, dy, p, "conv2d_bwd_data");
  if (dx.numel() == 0) return;
  if (dy.numel() == 0) {
    if (!accumulate) fill(dx, 0.f);
    return;
  }
  // accumulate: beta = 1, dx = conv + dx rounded once (cuDNN and cuBLASLt blend in f32)
  const float beta = accumulate ? 1.f : 0.f;
  // pointwise: dx [NHW,C] (+)= dy [NHW,O] W ([O,C])
  if (pointwise_gemm(*this, w, p, /*trans_w=*/false, dy, beta, dx)) return;
  ConvPlan& plan = conv_plan(kBwdData, dx, w, dy, p);
  void* ws = conv_workspace(plan.workspace);
  float alpha = 1.f;
  DTRAIN_CUDNN_CHECK(cudnnConvolutionBackwardData(cudnn_, &alpha, plan.w, w.data, plan.y, dy.data,
                                                  plan.conv, cudnnConvolutionBwdDataAlgo_t(plan.algo),
                                                  ws, plan.workspace, &beta, plan.x, dx.data),
                     conv_what("conv2d_bwd_data", dx, w, dy, p));
}

void CudaBackend::conv2d_bwd_filter(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& dbias,
                                    const Conv2dParams& p, bool accumulate) {
  auto bias_grad = [&] {  // dbias (+)= sum of dy over the pixels (each path, after its shape checks)
    if (!dbias.defined()) return;
    DTRAIN_CHECK(dbias.numel() == dw.dim(0), "conv2d_bwd_filter: dbias {} for {} output channels",
                 dbias.str(), dw.dim(0));
    Tensor dy2 = rows(dy);
    sum_rows(dy2, dbias, accumulate);
  };
  if (pointwise(dw, p) && x.ndim() == 4 && dy.ndim() == 4 && x.dtype == dy.dtype && is_float(x.dtype) &&
      (dw.dtype == x.dtype || dw.dtype == DType::F32) && x.numel() > 0 && dy.numel() > 0) {
    DTRAIN_CHECK(x.dim(0) == dy.dim(0) && x.dim(1) == dy.dim(1) && x.dim(2) == dy.dim(2) &&
                     dw.dim(0) == dy.dim(3) && dw.dim(3) == x.dim(3),
                 "conv2d_bwd_filter: x {} dy {} dw {} for a 1x1 convolution", x.str(), dy.str(), dw.str());
    bias_grad();
    // dW [O,C] (+)= dy^T [O,NHW] x [NHW,C]; 16-bit operands accumulate into an f32 dW directly
    Tensor dw2 = dw.view({dw.dim(0), dw.dim(3)});
    gemm(true, false, 1.f, rows(dy), rows(x), accumulate ? 1.f : 0.f, dw2);
    return;
  }
  if (dw.dtype == DType::F32 && x.dtype != DType::F32 && is_float(x.dtype)) {
    // Mixed precision: 16-bit activations, f32 master gradients. cuDNN computes the filter
    // gradient in x's dtype into scratch; it is widened to f32 and added into dw (cast and
    // axpby, the same kernels as everywhere else). dbias is f32-capable already (sum_rows).
    const int64_t n = dw.numel();
    const size_t lo_bytes = (size_t(n) * dtype_size(x.dtype) + 255) / 256 * 256;
    char* ws = static_cast<char*>(mixed_ws_.get(lo_bytes + size_t(n) * 4));
    Tensor lo(ws, x.dtype, device(), dw.shape), wide(ws + lo_bytes, DType::F32, device(), dw.shape);
    Tensor no_bias;
    conv2d_bwd_filter(x, dy, lo, no_bias, p, /*accumulate=*/false);
    bias_grad();
    cast(lo, wide);
    axpby(1.f, wide, accumulate ? 1.f : 0.f, dw);
    return;
  }
  check_conv_shapes(x, dw, dy, p, "conv2d_bwd_filter");
  bias_grad();
  if (dw.numel() == 0) return;
  if (dy.numel() == 0) {
    if (!accumulate) fill(dw, 0.f);
    return;
  }
  ConvPlan& plan = conv_plan(kBwdFilter, x, dw, dy, p);
  void* ws = conv_workspace(plan.workspace);
  float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  DTRAIN_CUDNN_CHECK(cudnnConvolutionBackwardFilter(cudnn_, &alpha, plan.x, x.data, plan.y,
                                                    dy.data, plan.conv,
                                                    cudnnConvolutionBwdFilterAlgo_t(plan.algo), ws,
                                                    plan.workspace, &beta, plan.w, dw.data),
                     conv_what("conv2d_bwd_filter", x, dw, dy, p));
}

}  // namespace dtrain

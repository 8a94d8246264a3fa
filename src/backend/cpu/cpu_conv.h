#pragma once
// Internal to backend/cpu: convolution geometry shared by the oneDNN and im2col paths.
#include <cstdint>

#include "backend/backend.h"

namespace dtrain::cpu {

// x [N,H,W,C], w [O,KH,KW,C], y [N,OH,OW,O]
struct ConvDims {
  int64_t N = 0, H = 0, W = 0, C = 0, O = 0, KH = 0, KW = 0, OH = 0, OW = 0;
  Conv2dParams p;
  bool has_bias = false;
  // PyTorch's output size (floor).
  static int64_t out_size(int64_t in, int64_t k, int pad, int stride, int dil) {
    return (in + 2 * pad - int64_t(dil) * (k - 1) - 1) / stride + 1;
  }
};

// Validates shapes (x, w, y as named by `op`) and returns the geometry; throws RuntimeFault
// naming the op and the shapes on mismatch.
ConvDims conv_dims(const char* op, const Tensor& x, const Tensor& w, const Tensor& y,
                   const Conv2dParams& p);

struct ConvCache;
// oneDNN paths; return false when oneDNN has no implementation for the geometry (the caller
// falls back to im2col).
bool dnnl_conv_fwd(ConvCache& c, const ConvDims& d, const float* x, const float* w,
                   const float* b, float* y);
bool dnnl_conv_bwd_data(ConvCache& c, const ConvDims& d, const float* dy, const float* w,
                        float* dx);
bool dnnl_conv_bwd_filter(ConvCache& c, const ConvDims& d, const float* x, const float* dy,
                          float* dw, float* db, bool accumulate);
ConvCache* conv_cache_new();
// Name of the oneDNN implementation chosen for the last created primitive of each kind
// (benchmarks print it).
const char* dnnl_impl_name(ConvCache& c, int kind);

}  // namespace dtrain::cpu

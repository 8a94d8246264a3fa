#pragma once
// Index math shared by the CPU and CUDA U-Net ops (host/device inline functions, no
// dependencies): bilinear x2 taps with align_corners=False, and a stable softmax row.
#include <cmath>

#ifdef __CUDACC__
#define DTRAIN_HD __host__ __device__ __forceinline__
#else
#define DTRAIN_HD inline
#endif

namespace dtrain::unet {

// Output row o of a x2 upsampling of n input rows reads rows i0, i1 with weights w0, w1:
// src = (o + 0.5)/2 - 0.5 clamped at 0 (PyTorch area_pixel_compute_source_index).
struct Taps {
  int i0, i1;
  float w0, w1;
};
DTRAIN_HD Taps up2x_taps(int o, int n) {
  float src = 0.5f * float(o) - 0.25f;
  if (src < 0.f) src = 0.f;
  int i0 = int(src);
  if (i0 > n - 1) i0 = n - 1;
  int i1 = i0 + 1 < n ? i0 + 1 : n - 1;
  float l1 = src - float(i0);
  return Taps{i0, i1, 1.f - l1, l1};
}
// The output rows that may read input row i: [up2x_first(i), up2x_last(i, n)].
DTRAIN_HD int up2x_first(int i) { return 2 * i - 1 > 0 ? 2 * i - 1 : 0; }
DTRAIN_HD int up2x_last(int i, int n) { return 2 * i + 2 < 2 * n - 1 ? 2 * i + 2 : 2 * n - 1; }
// Weight with which output row o reads input row i.
DTRAIN_HD float up2x_weight(int o, int i, int n) {
  Taps t = up2x_taps(o, n);
  return (t.i0 == i ? t.w0 : 0.f) + (t.i1 == i ? t.w1 : 0.f);
}

// p = softmax(x[0..k)), max-subtracted.
DTRAIN_HD void softmax_row(const float* x, int k, float* p) {
  float m = x[0];
  for (int j = 1; j < k; ++j) m = x[j] > m ? x[j] : m;
  float s = 0.f;
  for (int j = 0; j < k; ++j) {
    p[j] = expf(x[j] - m);
    s += p[j];
  }
  const float inv = 1.f / s;
  for (int j = 0; j < k; ++j) p[j] *= inv;
}

}  // namespace dtrain::unet

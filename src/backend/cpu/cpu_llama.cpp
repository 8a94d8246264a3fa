// CpuBackend's Llama-family ops: RMS norm (and its backward, with the residual sum), rotary
// position embedding (RoPE, rotate_half form) and SwiGLU. The plain reference for the CUDA
// kernels in backend/cuda/llama_ops.cu. Row statistics are computed in double; the weight
// gradient's column sums use the fixed chunk partition (cpu::chunk_rows) combined serially, so
// results do not depend on the thread count.
#include <cmath>
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/chunked.h"
#include "core/error.h"

namespace dtrain {

namespace {
void need_numel(const char* op, const Tensor& t, const char* what, int64_t n) {
  if (!t.defined() || t.numel() != n)
    fault("cpu backend: {}: {} must have {} elements, got {}", op, what, n, t.str());
}
void need_f32(const char* op, const Tensor& t, const char* what, int64_t n) {
  if (!t.defined() || t.dtype != DType::F32 || t.numel() != n)
    fault("cpu backend: {}: {} must be f32 [{}], got {}", op, what, n, t.str());
}
}  // namespace

// ---------------------------------------------------------------- RMS norm
void CpuBackend::rmsnorm_fwd(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) {
  const char* op = "rmsnorm_fwd";
  require_all(Op::RmsNormFwd, x, weight, y);
  if (x.ndim() < 1 || x.dim(-1) < 1) fault("cpu backend: {}: bad input {}", op, x.str());
  const int64_t C = x.dim(-1), M = x.numel() / C;
  need_numel(op, weight, "weight", C);
  need_numel(op, y, "y", x.numel());
  need_f32(op, rstd, "rstd", M);
  const float* px = in_f32(x, 0);
  const float* pw = in_f32(weight, 1);
  float* py = out_f32(y, 2, false);
  float* pr = rstd.f32();
#pragma omp parallel for schedule(static) if (M * C > 16384)
  for (int64_t i = 0; i < M; ++i) {
    const float* r = px + i * C;
    double ss = 0;
    for (int64_t j = 0; j < C; ++j) ss += double(r[j]) * r[j];
    const float q = float(1.0 / std::sqrt(ss / double(C) + double(eps)));
    float* o = py + i * C;
    for (int64_t j = 0; j < C; ++j) o[j] = (r[j] * q) * pw[j];
    pr[i] = q;
  }
  store_f32(py, y);
}

void CpuBackend::rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd, Tensor& dx,
                             Tensor& dweight, bool accumulate, bool accumulate_dx) {
  const char* op = "rmsnorm_bwd";
  require_all(Op::RmsNormBwd, dy, x, weight, dx, dweight);
  if (x.ndim() < 1 || x.dim(-1) < 1) fault("cpu backend: {}: bad input {}", op, x.str());
  const int64_t C = x.dim(-1), M = x.numel() / C;
  need_numel(op, dy, "dy", x.numel());
  need_numel(op, weight, "weight", C);
  need_f32(op, rstd, "rstd", M);
  if (dx.defined()) need_numel(op, dx, "dx", x.numel());
  if (dweight.defined()) need_numel(op, dweight, "dweight", C);
  const float* pdy = in_f32(dy, 0);
  const float* px = in_f32(x, 1);
  const float* pw = in_f32(weight, 2);
  // accumulate_dx: the gradient goes to f32 scratch first, then is rounded and added
  float* pdx = !dx.defined() ? nullptr : accumulate_dx ? scratch(3, x.numel()) : out_f32(dx, 3, false);
  const float* pr = rstd.f32();
  if (pdx) {
#pragma omp parallel for schedule(static) if (M * C > 16384)
    for (int64_t i = 0; i < M; ++i) {
      const float* g = pdy + i * C;
      const float* r = px + i * C;
      const float q = pr[i];
      double s = 0;  // sum(dy * w * xhat)
      for (int64_t j = 0; j < C; ++j) s += double(g[j]) * pw[j] * (r[j] * q);
      const float b = float(s / double(C));
      float* o = pdx + i * C;
      for (int64_t j = 0; j < C; ++j) o[j] = q * (g[j] * pw[j] - (r[j] * q) * b);
    }
    if (!accumulate_dx) store_f32(pdx, dx);
  }
  if (dweight.defined()) {
    // column sums of dy * xhat over the fixed chunk partition
    double* part = scratch64(0, cpu::sum_rows_partials(M, C));
    const int64_t nchunks = cpu::chunk_partials(M, C, C, part, [&](int64_t i, double* a) {
      const float* g = pdy + i * C;
      const float* r = px + i * C;
      const float q = pr[i];
      for (int64_t j = 0; j < C; ++j) a[j] += double(g[j]) * (r[j] * q);
    });
    float* dw = out_f32(dweight, 4, accumulate);
    for (int64_t j = 0; j < C; ++j) {
      double sw = 0;
      for (int64_t c = 0; c < nchunks; ++c) sw += part[c * C + j];
      dw[j] = float((accumulate ? dw[j] : 0.0) + sw);
    }
    store_f32(dw, dweight);
  }
  // last: the add reuses the scratch slots that hold the widened dy and x
  if (pdx && accumulate_dx) add_rounded(pdx, dx, 5);
}

// ---------------------------------------------------------------- RoPE
namespace {
// x [B,T,W] rotated into y per head of hs = 2 * half columns for the first rot heads; sign +1
// is the forward (angle), -1 the backward (minus the angle). The values' columns are copied.
void rope_rows(const float* x, float* y, const float* cs, const float* sn, const int32_t* pos, int64_t B,
               int64_t T, int64_t W, int64_t rot, int64_t half, float sign) {
  const int64_t hs = 2 * half;
#pragma omp parallel for schedule(static) if (B * T * W > 65536)
  for (int64_t i = 0; i < B * T; ++i) {
    const int64_t p = pos ? pos[i] : i % T;
    const float* c = cs + p * half;
    const float* s = sn + p * half;
    const float* xr = x + i * W;
    float* yr = y + i * W;
    for (int64_t h = 0; h < rot; ++h)
      for (int64_t j = 0; j < half; ++j) {
        const float a = xr[h * hs + j], b = xr[h * hs + half + j], sj = sign * s[j];
        yr[h * hs + j] = a * c[j] - b * sj;
        yr[h * hs + half + j] = b * c[j] + a * sj;
      }
    for (int64_t k = rot * hs; k < W; ++k) yr[k] = xr[k];
  }
}
}  // namespace

static void rope_impl(CpuBackend& be, Op opk, const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin,
                      const Tensor& positions, int rot_heads, Tensor& y, float sign) {
  be.require_all(opk, x, y);
  if (x.ndim() != 3) fault("cpu backend: {}: x {} must be [B,T,W]", op, x.str());
  if (cos.dtype != DType::F32 || sin.dtype != DType::F32 || cos.ndim() != 2 || cos.shape != sin.shape ||
      cos.dim(1) < 1)
    fault("cpu backend: {}: cos {} / sin {} must be f32 [P, head_size/2]", op, cos.str(), sin.str());
  const int64_t B = x.dim(0), T = x.dim(1), W = x.dim(2), P = cos.dim(0), half = cos.dim(1);
  if (rot_heads < 0 || rot_heads * 2 * half > W)
    fault("cpu backend: {}: {} heads of {} columns do not fit rows of {}", op, rot_heads, 2 * half, W);
  need_numel(op, y, "y", x.numel());
  const int32_t* pos = nullptr;
  if (positions.defined()) {
    if (positions.dtype != DType::I32 || positions.numel() != B * T)
      fault("cpu backend: {}: positions {} must be i32 [{},{}]", op, positions.str(), B, T);
    pos = positions.i32();
    for (int64_t i = 0; i < B * T; ++i)
      if (pos[i] < 0 || pos[i] >= P)
        fault("cpu backend: {}: position {} at [{},{}] is outside the rotary table [0, {})", op, pos[i], i / T,
              i % T, P);
  } else if (T > P) {
    fault("cpu backend: {}: {} positions exceed the rotary table's {}", op, T, P);
  }
  const float* px = be.in_f32(x, 0);
  float* py = be.out_f32(y, 1, false);
  rope_rows(px, py, cos.f32(), sin.f32(), pos, B, T, W, rot_heads, half, sign);
  be.store_f32(py, y);
}

void CpuBackend::rope_fwd(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                          int rot_heads, Tensor& y) {
  rope_impl(*this, Op::RopeFwd, "rope_fwd", x, cos, sin, positions, rot_heads, y, 1.f);
}

void CpuBackend::rope_bwd(const Tensor& dy, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                          int rot_heads, Tensor& dx) {
  rope_impl(*this, Op::RopeBwd, "rope_bwd", dy, cos, sin, positions, rot_heads, dx, -1.f);
}

// ---------------------------------------------------------------- SwiGLU
namespace {
int64_t swiglu_width(const char* op, const Tensor& gu) {
  if (gu.ndim() < 1 || gu.dim(-1) % 2 != 0 || gu.dim(-1) == 0)
    fault("cpu backend: {}: gu {} must end in 2 * intermediate columns (gate | up)", op, gu.str());
  return gu.dim(-1) / 2;
}
}  // namespace

void CpuBackend::swiglu_fwd(const Tensor& gu, Tensor& y) {
  const char* op = "swiglu_fwd";
  require_all(Op::SwigluFwd, gu, y);
  const int64_t I = swiglu_width(op, gu), M = gu.numel() / (2 * I);
  need_numel(op, y, "y", M * I);
  const float* pg = in_f32(gu, 0);
  float* py = out_f32(y, 1, false);
#pragma omp parallel for schedule(static) if (M * I > 65536)
  for (int64_t i = 0; i < M; ++i) {
    const float* g = pg + i * 2 * I;
    const float* u = g + I;
    float* o = py + i * I;
    for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
  }
  store_f32(py, y);
}

void CpuBackend::swiglu_bwd(const Tensor& gu, const Tensor& dy, Tensor& dgu) {
  const char* op = "swiglu_bwd";
  require_all(Op::SwigluBwd, gu, dy, dgu);
  const int64_t I = swiglu_width(op, gu), M = gu.numel() / (2 * I);
  need_numel(op, dy, "dy", M * I);
  need_numel(op, dgu, "dgu", gu.numel());
  const float* pg = in_f32(gu, 0);
  const float* pdy = in_f32(dy, 1);
  float* pd = out_f32(dgu, 2, false);
#pragma omp parallel for schedule(static) if (M * I > 65536)
  for (int64_t i = 0; i < M; ++i) {
    const float* g = pg + i * 2 * I;
    const float* u = g + I;
    const float* d = pdy + i * I;
    float* dg = pd + i * 2 * I;
    float* du = dg + I;
    for (int64_t j = 0; j < I; ++j) {
      const float sg = 1.f / (1.f + std::exp(-g[j]));
      dg[j] = d[j] * u[j] * (sg * (1.f + g[j] * (1.f - sg)));
      du[j] = d[j] * (g[j] * sg);
    }
  }
  store_f32(pd, dgu);
}

}  // namespace dtrain

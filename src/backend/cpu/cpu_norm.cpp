// CpuBackend batch norm over x [M, C] (NHWC flattened; C = last dim). Statistics are
// reduced in double over fixed row chunks (cpu::chunk_rows) combined serially in chunk
// order: deterministic for any thread count. Mean and variance are two passes (no
// catastrophic cancellation). Running stats follow PyTorch: r = (1-momentum)*r +
// momentum*batch, with the unbiased variance for running_var.
#include <cmath>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/chunked.h"
#include "core/error.h"

namespace dtrain {

namespace {
struct Mc {
  int64_t M, C;
};
Mc bn_dims(const char* op, const Tensor& x, std::initializer_list<const Tensor*> per_channel) {
  if (x.ndim() < 1 || x.dim(-1) < 1) fault("cpu backend: {}: bad input {}", op, x.str());
  Mc d{x.numel() / x.dim(-1), x.dim(-1)};
  for (const Tensor* t : per_channel)
    if (t->defined() && t->numel() != d.C)
      fault("cpu backend: {}: per-channel tensor {} does not match {} channels of x {}", op,
            t->str(), d.C, x.str());
  return d;
}
void need_f32(const char* op, const Tensor& t, const char* what) {
  if (t.defined() && t.dtype != DType::F32)
    fault("cpu backend: {}: {} must be f32 (statistics are always f32), got {}", op, what,
          t.str());
}

// out[j] = sum over rows of f(row, j) for j < C, chunked; part holds nchunks*C doubles.
template <typename F>
void chunked_col_sum(int64_t M, int64_t C, double* part, double* out, F f) {
  const int64_t nchunks = cpu::chunk_partials(M, C, C, part, f);
  for (int64_t j = 0; j < C; ++j) out[j] = 0;
  for (int64_t c = 0; c < nchunks; ++c)
    for (int64_t j = 0; j < C; ++j) out[j] += part[c * C + j];
}
// Rounds v to the storage dtype t (what a separate op's store would do).
inline float round_to(DType t, float v) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  if (t == DType::F16) return f16_to_f32(f32_to_f16(v));
  return v;
}
int64_t nparts(int64_t M, int64_t C) {
  const int64_t R = cpu::chunk_rows(C);
  return (M + R - 1) / R * C;
}
// y[r, j] = x[r, j] * scale[j] + shift[j] for the [M, C] rows (parallel above 64Ki elements).
void scale_shift(int64_t M, int64_t C, const float* px, const float* scale, const float* shift,
                 float* py) {
#pragma omp parallel for schedule(static) if (M * C > 65536)
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = px + r * C;
    float* yr = py + r * C;
    for (int64_t j = 0; j < C; ++j) yr[j] = xr[j] * scale[j] + shift[j];
  }
}
}  // namespace

// y = relu?(round(bn) + residual) over the f32 image py of y (rounded on store).
void CpuBackend::apply_epilogue(const char* op, const BnEpilogue& ep, const Tensor& y, float* py) {
  if (!ep.residual.defined() && !ep.relu) return;
  const int64_t n = y.numel();
  const float* pr = nullptr;
  if (ep.residual.defined()) {
    if (ep.residual.numel() != n || ep.residual.dtype != y.dtype)
      fault("cpu backend: {}: residual {} does not match y {}", op, ep.residual.str(), y.str());
    pr = in_f32(ep.residual, 8);
  }
  const DType t = y.dtype;
  // three plain loops (vectorisable) rather than one with per-element branches
  if (pr && t != DType::F32) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) py[i] = round_to(t, py[i]) + pr[i];
  } else if (pr) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) py[i] += pr[i];
  }
  if (ep.relu) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) py[i] = py[i] > 0.f ? py[i] : 0.f;
  }
}

void CpuBackend::batchnorm_fwd_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                     Tensor& y, Tensor& running_mean, Tensor& running_var,
                                     Tensor& save_mean, Tensor& save_invstd, float momentum,
                                     float eps, const BnEpilogue& ep) {
  const char* op = "batchnorm_fwd_train";
  require_all(Op::BatchNormFwdTrain, x, gamma, beta, y);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&running_mean, &running_var,
                                                              &save_mean, &save_invstd})
    need_f32(op, *t, "statistics");
  const Mc d = bn_dims(op, x, {&gamma, &beta, &running_mean, &running_var, &save_mean, &save_invstd});
  const int64_t M = d.M, C = d.C;
  if (y.numel() != x.numel()) fault("cpu backend: {}: y {} differs from x {}", op, y.str(), x.str());
  if (M < 2)
    user_error("batch norm in training needs more than 1 value per channel, got input {}",
               x.shape.str());
  const float* px = in_f32(x, 0);
  const float* pg = in_f32(gamma, 2);
  const float* pb = in_f32(beta, 3);
  float* py = out_f32(y, 1, false);
  double* part = scratch64(0, nparts(M, C));
  double* mean = scratch64(1, C);
  double* var = scratch64(2, C);
  chunked_col_sum(M, C, part, mean, [&](int64_t r, double* acc) {
    const float* row = px + r * C;
    for (int64_t j = 0; j < C; ++j) acc[j] += row[j];
  });
  for (int64_t j = 0; j < C; ++j) mean[j] /= double(M);
  chunked_col_sum(M, C, part, var, [&](int64_t r, double* acc) {
    const float* row = px + r * C;
    for (int64_t j = 0; j < C; ++j) {
      const double t = double(row[j]) - mean[j];
      acc[j] += t * t;
    }
  });
  float* scale = scratch(10, 2 * C);
  float* shift = scale + C;
  float* rm = running_mean.defined() ? running_mean.f32() : nullptr;
  float* rv = running_var.defined() ? running_var.f32() : nullptr;
  for (int64_t j = 0; j < C; ++j) {
    const double v = var[j] / double(M);
    const double invstd = 1.0 / std::sqrt(v + double(eps));
    const double g = pg ? pg[j] : 1.0;
    scale[j] = float(g * invstd);
    shift[j] = float((pb ? pb[j] : 0.0) - mean[j] * g * invstd);
    if (save_mean.defined()) save_mean.f32()[j] = float(mean[j]);
    if (save_invstd.defined()) save_invstd.f32()[j] = float(invstd);
    if (rm) rm[j] = float((1.0 - momentum) * rm[j] + double(momentum) * mean[j]);
    if (rv) rv[j] = float((1.0 - momentum) * rv[j] + double(momentum) * v * M / double(M - 1));
  }
  scale_shift(M, C, px, scale, shift, py);
  apply_epilogue(op, ep, y, py);
  store_f32(py, y);
}

void CpuBackend::batchnorm_fwd_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                    const Tensor& running_mean, const Tensor& running_var,
                                    Tensor& y, float eps, const BnEpilogue& ep) {
  const char* op = "batchnorm_fwd_eval";
  require_all(Op::BatchNormFwdEval, x, gamma, beta, y);
  need_f32(op, running_mean, "running_mean");
  need_f32(op, running_var, "running_var");
  if (!running_mean.defined() || !running_var.defined())
    fault("cpu backend: {}: running statistics are required", op);
  const Mc d = bn_dims(op, x, {&gamma, &beta, &running_mean, &running_var});
  const int64_t M = d.M, C = d.C;
  if (y.numel() != x.numel()) fault("cpu backend: {}: y {} differs from x {}", op, y.str(), x.str());
  const float* px = in_f32(x, 0);
  const float* pg = in_f32(gamma, 2);
  const float* pb = in_f32(beta, 3);
  float* py = out_f32(y, 1, false);
  float* scale = scratch(10, 2 * C);
  float* shift = scale + C;
  for (int64_t j = 0; j < C; ++j) {
    const double invstd = 1.0 / std::sqrt(double(running_var.f32()[j]) + double(eps));
    const double g = pg ? pg[j] : 1.0;
    scale[j] = float(g * invstd);
    shift[j] = float((pb ? pb[j] : 0.0) - double(running_mean.f32()[j]) * g * invstd);
  }
  scale_shift(M, C, px, scale, shift, py);
  apply_epilogue(op, ep, y, py);
  store_f32(py, y);
}

// xhat = (x - mean) * invstd; dbeta = sum dy; dgamma = sum dy * xhat;
// dx = gamma * invstd * (dy - dbeta/M - xhat * dgamma/M)
void CpuBackend::batchnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                               const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx,
                               Tensor& dgamma, Tensor& dbeta, bool accumulate,
                               const BnReluBwd& relu) {
  // the mask is read from y (relu.beta, an option to recompute it, is not needed here)
  const Tensor& relu_y = relu.y;
  Tensor dy_masked = relu.dy_masked;  // a view: written through
  const char* op = "batchnorm_bwd";
  require_all(Op::BatchNormBwd, dy, x, gamma, dx, dgamma, dbeta);
  need_f32(op, save_mean, "save_mean");
  need_f32(op, save_invstd, "save_invstd");
  if (!save_mean.defined() || !save_invstd.defined())
    fault("cpu backend: {}: save_mean and save_invstd are required", op);
  const Mc d = bn_dims(op, x, {&gamma, &save_mean, &save_invstd, &dgamma, &dbeta});
  const int64_t M = d.M, C = d.C;
  if (dy.numel() != x.numel() || (dx.defined() && dx.numel() != x.numel()))
    fault("cpu backend: {}: dy {} / dx {} differ from x {}", op, dy.str(), dx.str(), x.str());
  const float* px = in_f32(x, 0);
  const float* pdy = in_f32(dy, 4);
  if (relu_y.defined()) {  // the fused ReLU's backward: dy where the output was positive
    if (relu_y.numel() != x.numel())
      fault("cpu backend: {}: relu_y {} does not match x {}", op, relu_y.str(), x.str());
    const float* py = in_f32(relu_y, 9);
    const int64_t n = x.numel();
    float* m = scratch(11, n);
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) m[i] = py[i] > 0.f ? pdy[i] : 0.f;
    pdy = m;
    if (dy_masked.defined()) {
      if (dy_masked.numel() != x.numel() || dy_masked.dtype != dy.dtype)
        fault("cpu backend: {}: dy_masked {} does not match dy {}", op, dy_masked.str(), dy.str());
      cast(Tensor(m, DType::F32, device(), dy_masked.shape), dy_masked);  // exact: dy's values or 0
    }
  } else if (dy_masked.defined()) {
    fault("cpu backend: {}: dy_masked needs relu_y", op);
  }
  const float* pg = in_f32(gamma, 2);
  const float* mean = save_mean.f32();
  const float* invstd = save_invstd.f32();
  double* part = scratch64(0, nparts(M, 2 * C));
  double* sums = scratch64(1, 2 * C);  // [sum dy | sum dy*xhat]
  chunked_col_sum(M, 2 * C, part, sums, [&](int64_t r, double* acc) {
    const float* xr = px + r * C;
    const float* dyr = pdy + r * C;
    for (int64_t j = 0; j < C; ++j) {
      acc[j] += dyr[j];
      acc[C + j] += double(dyr[j]) * (double(xr[j]) - mean[j]) * invstd[j];
    }
  });
  const double* sdy = sums;
  const double* sdyx = sums + C;
  if (dgamma.defined()) {
    float* p = out_f32(dgamma, 6, accumulate);
    for (int64_t j = 0; j < C; ++j) p[j] = float((accumulate ? p[j] : 0.0) + sdyx[j]);
    store_f32(p, dgamma);
  }
  if (dbeta.defined()) {
    float* p = out_f32(dbeta, 7, accumulate);
    for (int64_t j = 0; j < C; ++j) p[j] = float((accumulate ? p[j] : 0.0) + sdy[j]);
    store_f32(p, dbeta);
  }
  if (!dx.defined()) return;
  // dx = k1 * dy + k2 * x + k3 per channel
  float* k = scratch(10, 3 * C);
  for (int64_t j = 0; j < C; ++j) {
    const double g = pg ? pg[j] : 1.0, is = invstd[j];
    const double a = g * is;
    const double b = sdyx[j] / double(M);  // coefficient of xhat
    k[j] = float(a);
    k[C + j] = float(-a * b * is);
    k[2 * C + j] = float(-a * sdy[j] / double(M) + a * b * is * mean[j]);
  }
  float* pdx = out_f32(dx, 5, false);
#pragma omp parallel for schedule(static) if (M * C > 65536)
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = px + r * C;
    const float* dyr = pdy + r * C;
    float* dxr = pdx + r * C;
    for (int64_t j = 0; j < C; ++j) dxr[j] = k[j] * dyr[j] + k[C + j] * xr[j] + k[2 * C + j];
  }
  store_f32(pdx, dx);
}

}  // namespace dtrain

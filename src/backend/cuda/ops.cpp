// CudaBackend op bodies for the families with dtrain's own kernels (elementwise,
// reductions, batch norm, activations, pooling, loss, optimizers): validate shapes and
// dtypes on the host, launch (kernels.h), check the launch.
#include <cmath>
#include <initializer_list>

#include <fmt/format.h>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"

namespace dtrain {
namespace k = cuda_kernels;
namespace {

void expect_float(const Tensor& t, const char* op, const char* name) {
  DTRAIN_CHECK(t.defined() && is_float(t.dtype) && t.device.is_cuda(),
               "{}: {} must be a float CUDA tensor, got {}", op, name, t.str());
}
void expect_same(const Tensor& a, const Tensor& b, const char* op) {
  DTRAIN_CHECK(a.dtype == b.dtype && a.numel() == b.numel(), "{}: {} vs {}", op, a.str(), b.str());
}
// An elementwise op's operands: `first` a float CUDA tensor, the others of its dtype and size.
void expect_elementwise(const char* op, const Tensor& first, const char* name,
                        std::initializer_list<const Tensor*> others) {
  expect_float(first, op, name);
  for (const Tensor* t : others) expect_same(first, *t, op);
}
void expect_f32_vec(const Tensor& t, int64_t n, const char* op, const char* name) {
  DTRAIN_CHECK(t.defined() && t.dtype == DType::F32 && t.numel() == n,
               "{}: {} must be f32 [{}], got {}", op, name, n, t.str());
}
// Per-channel parameter vectors: f32 or the activation dtype.
void expect_param_vec(const Tensor& t, int64_t n, DType act, const char* op, const char* name) {
  DTRAIN_CHECK(t.defined() && (t.dtype == DType::F32 || t.dtype == act) && t.numel() == n,
               "{}: {} must be [{}] in f32 or {}, got {}", op, name, n, dtype_name(act), t.str());
}
std::string what(const char* op, const Tensor& t) { return fmt::format("{} {}", op, t.str()); }
// A batch norm forward's operands: x float, y like x, gamma and beta per channel (the last
// axis), running statistics f32. Returns the channel count.
int64_t expect_bn_fwd(const char* op, const Tensor& x, const Tensor& y, const Tensor& gamma,
                      const Tensor& beta, const Tensor& running_mean, const Tensor& running_var) {
  expect_float(x, op, "x");
  expect_same(x, y, op);
  const int64_t C = x.dim(-1);
  expect_param_vec(gamma, C, x.dtype, op, "gamma");
  DTRAIN_CHECK(beta.dtype == gamma.dtype && beta.numel() == C, "{}: beta {}", op, beta.str());
  expect_f32_vec(running_mean, C, op, "running_mean");
  expect_f32_vec(running_var, C, op, "running_var");
  return C;
}
// An average pooling op from `in` to `out`: checks that `in` is a float CUDA tensor, `ok`
// and equal dtypes, runs launch() and checks the launch.
template <typename F>
void pool_op(const char* op, const Tensor& in, const char* in_name, const Tensor& out,
             const char* out_name, bool ok, F&& launch) {
  expect_float(in, op, in_name);
  DTRAIN_CHECK(ok && in.dtype == out.dtype, "{}: {} {} {} {}", op, in_name, in.str(), out_name,
               out.str());
  launch();
  DTRAIN_KERNEL_CHECK(what(op, in));
}

k::PoolGeom pool_geom(const Tensor& x, const Tensor& y, const Pool2dParams& p, const char* op) {
  DTRAIN_CHECK(x.ndim() == 4 && y.ndim() == 4 && x.dim(0) == y.dim(0) && x.dim(3) == y.dim(3),
               "{}: x {} y {} must be NHWC with equal N and C", op, x.str(), y.str());
  DTRAIN_CHECK(p.kernel_h > 0 && p.kernel_w > 0 && p.stride_h > 0 && p.stride_w > 0 &&
                   p.pad_h >= 0 && p.pad_w >= 0 && 2 * p.pad_h <= p.kernel_h &&
                   2 * p.pad_w <= p.kernel_w,
               "{}: bad pooling params (kernel {}x{} stride {}x{} pad {}x{}; pad at most half the kernel)",
               op, p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w);
  int64_t oh = (x.dim(1) + 2 * p.pad_h - p.kernel_h) / p.stride_h + 1;
  int64_t ow = (x.dim(2) + 2 * p.pad_w - p.kernel_w) / p.stride_w + 1;
  DTRAIN_CHECK(y.dim(1) == oh && y.dim(2) == ow, "{}: y {} but x {} gives [{},{}] spatial", op,
               y.str(), x.str(), oh, ow);
  return k::PoolGeom{int(x.dim(0)), int(x.dim(1)), int(x.dim(2)), int(x.dim(3)), int(oh), int(ow),
                     p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w};
}

}  // namespace

// ---- elementwise ----
void CudaBackend::fill(Tensor& y, float value) {
  expect_float(y, "fill", "y");
  k::fill(y.data, y.dtype, y.numel(), value, stream_);
  DTRAIN_KERNEL_CHECK(what("fill", y));
}
void CudaBackend::copy(const Tensor& x, Tensor& y) {
  DTRAIN_CHECK(x.dtype == y.dtype && x.numel() == y.numel(), "copy: {} -> {}", x.str(), y.str());
  copy_device(y.data, x.data, x.nbytes());
}
void CudaBackend::cast(const Tensor& x, Tensor& y) {
  expect_float(x, "cast", "x");
  expect_float(y, "cast", "y");
  DTRAIN_CHECK(x.numel() == y.numel(), "cast: {} -> {}", x.str(), y.str());
  if (x.dtype == y.dtype) return copy(x, y);
  k::cast(x.data, x.dtype, y.data, y.dtype, x.numel(), stream_);
  DTRAIN_KERNEL_CHECK(what("cast", x));
}
void CudaBackend::add(const Tensor& a, const Tensor& b, Tensor& y) {
  expect_elementwise("add", a, "a", {&b, &y});
  k::add(a.data, b.data, y.data, y.dtype, y.numel(), stream_);
  DTRAIN_KERNEL_CHECK(what("add", y));
}
void CudaBackend::axpby(float alpha, const Tensor& x, float beta, Tensor& y) {
  expect_elementwise("axpby", x, "x", {&y});
  k::axpby(alpha, x.data, beta, y.data, y.dtype, y.numel(), stream_);
  DTRAIN_KERNEL_CHECK(what("axpby", y));
}
void CudaBackend::scale(Tensor& y, float s) {
  expect_float(y, "scale", "y");
  k::scale(y.data, y.dtype, y.numel(), s, stream_);
  DTRAIN_KERNEL_CHECK(what("scale", y));
}
// sum of x or of x^2 in double on the device (fixed order), read back through pinned memory
double CudaBackend::reduce_to_host(const Tensor& x, bool square, const char* op) {
  expect_float(x, op, "x");
  double* out = reduce_dev_ + k::kReduceBlocks;
  k::sum_squares(x.data, x.dtype, x.numel(), reduce_dev_, out, stream_, square);
  DTRAIN_KERNEL_CHECK(what(op, x));
  copy_to_host(host_pinned_, out, sizeof(double));
  return *static_cast<double*>(host_pinned_);
}
double CudaBackend::sum(const Tensor& x) { return reduce_to_host(x, false, "sum"); }
void CudaBackend::sum_into(const Tensor& x, double scale, Tensor& acc, bool accumulate) {
  expect_float(x, "sum_into", "x");
  DTRAIN_CHECK(acc.dtype == DType::F64 && acc.numel() == 1 && acc.device.is_cuda(),
               "sum_into: acc {} must be a CUDA f64 [1]", acc.str());
  k::sum_squares(x.data, x.dtype, x.numel(), reduce_dev_, acc.ptr<double>(), stream_, false, scale,
                 accumulate);
  DTRAIN_KERNEL_CHECK(what("sum_into", x));
}
double CudaBackend::sum_squares(const Tensor& x) { return reduce_to_host(x, true, "sum_squares"); }
void CudaBackend::sum_rows(const Tensor& x, Tensor& y, bool accumulate) {
  expect_float(x, "sum_rows", "x");
  expect_float(y, "sum_rows", "y");
  int64_t N = y.numel();
  DTRAIN_CHECK(x.ndim() >= 1 && x.dim(-1) == N, "sum_rows: x {} y {}", x.str(), y.str());
  int64_t M = N ? x.numel() / N : 0;
  if (N == 0) return;
  void* scratch = scratch_.get(k::colsum_scratch_bytes(M, N));
  k::sum_rows(x.data, x.dtype, M, N, y.data, y.dtype, accumulate, scratch, stream_);
  DTRAIN_KERNEL_CHECK(what("sum_rows", x));
}
bool CudaBackend::all_finite(const Tensor& x) {
  expect_float(x, "all_finite", "x");
  int* flag = reinterpret_cast<int*>(reduce_dev_ + k::kReduceBlocks + 1);
  k::all_finite(x.data, x.dtype, x.numel(), flag, stream_);
  DTRAIN_KERNEL_CHECK(what("all_finite", x));
  copy_to_host(host_pinned_, flag, sizeof(int));
  return *static_cast<int*>(host_pinned_) == 0;
}
void CudaBackend::add_bias(Tensor& y, const Tensor& bias) {
  expect_float(y, "add_bias", "y");
  int64_t N = bias.numel();
  DTRAIN_CHECK(y.ndim() >= 1 && y.dim(-1) == N, "add_bias: y {} bias {}", y.str(), bias.str());
  expect_param_vec(bias, N, y.dtype, "add_bias", "bias");
  k::add_bias(y.data, y.dtype, bias.data, bias.dtype, N ? y.numel() / N : 0, N, stream_);
  DTRAIN_KERNEL_CHECK(what("add_bias", y));
}

// ---- batch norm ----
// The forward's epilogue is fused into the normalisation pass (norm.cu bn_apply_k).
const void* CudaBackend::bn_residual(const char* op, const BnEpilogue& ep, const Tensor& y) {
  if (!ep.residual.defined()) return nullptr;
  expect_same(y, ep.residual, op);
  return ep.residual.data;
}
void CudaBackend::batchnorm_fwd_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      Tensor& y, Tensor& running_mean, Tensor& running_var,
                                      Tensor& save_mean, Tensor& save_invstd, float momentum,
                                      float eps, const BnEpilogue& ep) {
  const char* op = "batchnorm_fwd_train";
  const int64_t C = expect_bn_fwd(op, x, y, gamma, beta, running_mean, running_var);
  const int64_t M = C ? x.numel() / C : 0;
  expect_f32_vec(save_mean, C, op, "save_mean");
  expect_f32_vec(save_invstd, C, op, "save_invstd");
  DTRAIN_CHECK(M > 0, "{}: empty batch {}", op, x.str());
  void* scratch = scratch_.get(k::bn_scratch_bytes(M, C));
  k::bn_fwd_train(x.data, x.dtype, M, C, gamma.data, beta.data, gamma.dtype, y.data,
                  running_mean.f32(), running_var.f32(), save_mean.f32(), save_invstd.f32(),
                  momentum, eps, scratch, bn_residual(op, ep, y), ep.relu, stream_);
  DTRAIN_KERNEL_CHECK(what(op, x));
}
void CudaBackend::batchnorm_fwd_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                     const Tensor& running_mean, const Tensor& running_var,
                                     Tensor& y, float eps, const BnEpilogue& ep) {
  const char* op = "batchnorm_fwd_eval";
  const int64_t C = expect_bn_fwd(op, x, y, gamma, beta, running_mean, running_var);
  const int64_t M = C ? x.numel() / C : 0;
  void* scratch = scratch_.get(k::bn_eval_scratch_bytes(C));
  k::bn_fwd_eval(x.data, x.dtype, M, C, gamma.data, beta.data, gamma.dtype, running_mean.f32(),
                 running_var.f32(), y.data, eps, scratch, bn_residual(op, ep, y), ep.relu, stream_);
  DTRAIN_KERNEL_CHECK(what(op, x));
}
void CudaBackend::batchnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx,
                                Tensor& dgamma, Tensor& dbeta, bool accumulate,
                                const BnReluBwd& relu) {
  const Tensor& relu_y = relu.y;
  const Tensor& dy_masked = relu.dy_masked;
  const char* op = "batchnorm_bwd";
  expect_float(x, op, "x");
  expect_same(x, dy, op);
  if (dx.defined()) expect_same(x, dx, op);
  int64_t C = x.dim(-1), M = C ? x.numel() / C : 0;
  expect_param_vec(gamma, C, x.dtype, op, "gamma");
  expect_f32_vec(save_mean, C, op, "save_mean");
  expect_f32_vec(save_invstd, C, op, "save_invstd");
  DType tg = DType::F32;
  if (dgamma.defined()) {
    expect_param_vec(dgamma, C, x.dtype, op, "dgamma");
    tg = dgamma.dtype;
  }
  if (dbeta.defined()) {
    expect_param_vec(dbeta, C, x.dtype, op, "dbeta");
    DTRAIN_CHECK(!dgamma.defined() || dbeta.dtype == dgamma.dtype, "{}: dgamma {} dbeta {}", op,
                 dgamma.str(), dbeta.str());
    tg = dbeta.dtype;
  }
  DTRAIN_CHECK(M > 0, "{}: empty batch {}", op, x.str());
  if (relu_y.defined()) expect_same(x, relu_y, op);  // the fused ReLU's mask, applied in the kernels
  if (dy_masked.defined()) {
    DTRAIN_CHECK(relu_y.defined(), "{}: dy_masked needs relu.y", op);
    expect_same(x, dy_masked, op);
  }
  k::BnMask mask;
  if (relu_y.defined()) {
    if (relu.beta.defined()) {  // recomputed from x: y is not read
      expect_param_vec(relu.beta, C, x.dtype, op, "beta");
      DTRAIN_CHECK(relu.beta.dtype == gamma.dtype, "{}: beta {} gamma {}", op, relu.beta.str(),
                   gamma.str());
      mask.beta = relu.beta.data;
    } else {
      mask.y = relu_y.data;
    }
    mask.out = dy_masked.data;
  }
  void* scratch = scratch_.get(k::bn_scratch_bytes(M, C));
  k::bn_bwd(dy.data, x.data, x.dtype, M, C, gamma.data, gamma.dtype, save_mean.f32(),
            save_invstd.f32(), dx.data, dgamma.data, dbeta.data, tg, accumulate, scratch, mask,
            stream_);
  DTRAIN_KERNEL_CHECK(what(op, x));
}

// ---- activations ----
void CudaBackend::relu_fwd(const Tensor& x, Tensor& y) {
  expect_elementwise("relu_fwd", x, "x", {&y});
  k::relu_fwd(x.data, y.data, x.dtype, x.numel(), stream_);
  DTRAIN_KERNEL_CHECK(what("relu_fwd", x));
}
void CudaBackend::relu_bwd(const Tensor& y, const Tensor& dy, Tensor& dx) {
  expect_elementwise("relu_bwd", y, "y", {&dy, &dx});
  k::relu_bwd(y.data, dy.data, dx.data, y.dtype, y.numel(), stream_);
  DTRAIN_KERNEL_CHECK(what("relu_bwd", y));
}

// ---- pooling ----
void CudaBackend::maxpool2d_fwd(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p) {
  expect_float(x, "maxpool2d_fwd", "x");
  DTRAIN_CHECK(x.dtype == y.dtype, "maxpool2d_fwd: x {} y {}", x.str(), y.str());
  if (argmax.defined())
    DTRAIN_CHECK(argmax.dtype == DType::U8 && argmax.shape == y.shape && p.kernel_h * p.kernel_w <= 256,
                 "maxpool2d_fwd: argmax {} must be u8 like y {} (window {}x{} <= 256 cells)",
                 argmax.str(), y.str(), p.kernel_h, p.kernel_w);
  k::maxpool_fwd(x.data, y.data, static_cast<uint8_t*>(argmax.data), x.dtype,
                 pool_geom(x, y, p, "maxpool2d_fwd"), stream_);
  DTRAIN_KERNEL_CHECK(what("maxpool2d_fwd", x));
}
void CudaBackend::maxpool2d_bwd(const Tensor& argmax, const Tensor& dy, Tensor& dx,
                                const Pool2dParams& p, bool accumulate) {
  expect_float(dx, "maxpool2d_bwd", "dx");
  DTRAIN_CHECK(dx.dtype == dy.dtype, "maxpool2d_bwd: dx {} dy {}", dx.str(), dy.str());
  DTRAIN_CHECK(argmax.defined() && argmax.dtype == DType::U8 && argmax.shape == dy.shape &&
                   p.kernel_h * p.kernel_w <= 256,
               "maxpool2d_bwd: argmax {} must be u8 like dy {}", argmax.str(), dy.str());
  k::maxpool_bwd(static_cast<const uint8_t*>(argmax.data), dy.data, dx.data, dx.dtype,
                 pool_geom(dx, dy, p, "maxpool2d_bwd"), accumulate, stream_);
  DTRAIN_KERNEL_CHECK(what("maxpool2d_bwd", dx));
}
void CudaBackend::avgpool2d_fwd(const Tensor& x, Tensor& y, const Pool2dParams& p) {
  pool_op("avgpool2d_fwd", x, "x", y, "y", true, [&] {
    k::avgpool_fwd(x.data, y.data, x.dtype, pool_geom(x, y, p, "avgpool2d_fwd"), stream_);
  });
}
void CudaBackend::avgpool2d_bwd(const Tensor& dy, Tensor& dx, const Pool2dParams& p) {
  pool_op("avgpool2d_bwd", dy, "dy", dx, "dx", true, [&] {
    k::avgpool_bwd(dy.data, dx.data, dy.dtype, pool_geom(dx, dy, p, "avgpool2d_bwd"), stream_);
  });
}
void CudaBackend::global_avgpool_fwd(const Tensor& x, Tensor& y) {
  const bool ok = x.ndim() == 4 && y.numel() == x.dim(0) * x.dim(3);
  pool_op("global_avgpool_fwd", x, "x", y, "y", ok, [&] {
    k::global_avgpool_fwd(x.data, y.data, x.dtype, int(x.dim(0)), int(x.dim(1) * x.dim(2)),
                          int(x.dim(3)), stream_);
  });
}
void CudaBackend::global_avgpool_bwd(const Tensor& dy, Tensor& dx) {
  const bool ok = dx.ndim() == 4 && dy.numel() == dx.dim(0) * dx.dim(3);
  pool_op("global_avgpool_bwd", dy, "dy", dx, "dx", ok, [&] {
    k::global_avgpool_bwd(dy.data, dx.data, dy.dtype, int(dx.dim(0)), int(dx.dim(1) * dx.dim(2)),
                          int(dx.dim(3)), stream_);
  });
}

// ---- loss ----
void CudaBackend::softmax_xent(const Tensor& logits, const Tensor& labels, float label_smoothing,
                               float grad_scale, Tensor& losses, Tensor& dlogits) {
  const char* op = "softmax_xent";
  expect_float(logits, op, "logits");
  DTRAIN_CHECK(logits.ndim() == 2, "{}: logits {} must be [N,C]", op, logits.str());
  int64_t N = logits.dim(0), C = logits.dim(1);
  DTRAIN_CHECK(labels.dtype == DType::I32 && labels.numel() == N, "{}: labels {} for logits {}", op,
               labels.str(), logits.str());
  expect_f32_vec(losses, N, op, "losses");
  if (dlogits.defined()) expect_same(logits, dlogits, op);
  k::softmax_xent(logits.data, logits.dtype, int(N), int(C), labels.ptr<int32_t>(),
                  label_smoothing, grad_scale, losses.f32(),
                  dlogits.defined() ? dlogits.data : nullptr, stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
}

// ---- optimizers ----
int64_t CudaBackend::upload_segments(const std::vector<ParamSegment>& segs, int64_t buffer_len,
                                     const char* op) {
  for (const ParamSegment& s : segs)
    DTRAIN_CHECK(s.offset >= 0 && s.count >= 0 && s.offset + s.count <= buffer_len,
                 "{}: segment [{}, +{}) outside the flat buffer of {}", op, s.offset, s.count,
                 buffer_len);
  bool same = segs_uploaded_ && segs.size() == segs_host_.size();
  for (size_t i = 0; same && i < segs.size(); ++i)
    same = segs[i].offset == segs_host_[i].offset && segs[i].count == segs_host_[i].count &&
           segs[i].decay == segs_host_[i].decay;
  if (same) return segs_total_;
  std::vector<k::DevSegment> table;
  int64_t total = 0;
  for (const ParamSegment& s : segs) {
    if (s.count == 0) continue;
    table.push_back(k::DevSegment{s.offset, s.count, total, s.decay ? 1 : 0, 0});
    total += s.count;
  }
  if (!table.empty()) {
    void* d = segs_dev_.get(table.size() * sizeof(k::DevSegment));
    // Synchronous w.r.t. `table` (pageable source is staged before the call returns).
    copy_from_host(d, table.data(), table.size() * sizeof(k::DevSegment));
  }
  segs_host_ = segs;
  segs_uploaded_ = true;
  segs_total_ = total;
  nsegs_dev_ = int(table.size());
  return total;
}

void CudaBackend::sgd_step(Tensor& params, const Tensor& grads, Tensor& momentum_buf,
                           const std::vector<ParamSegment>& segments, const SgdArgs& a) {
  const char* op = "sgd_step";
  int64_t n = params.numel();
  expect_f32_vec(params, n, op, "params");
  expect_f32_vec(grads, n, op, "grads");
  if (a.momentum != 0.f) expect_f32_vec(momentum_buf, n, op, "momentum_buf");
  int64_t total = upload_segments(segments, n, op);
  k::SgdHyper h{a.lr, a.momentum, a.dampening, a.weight_decay, a.grad_scale, a.nesterov ? 1 : 0,
                a.first_step ? 1 : 0};
  k::sgd_step(params.f32(), grads.f32(),
              a.momentum != 0.f ? momentum_buf.f32() : nullptr,
              static_cast<const k::DevSegment*>(segs_dev_.data()), nsegs_dev_, total, h, stream_);
  DTRAIN_KERNEL_CHECK(what(op, params));
}

void CudaBackend::adamw_step(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                             const std::vector<ParamSegment>& segments, const AdamWArgs& a) {
  const char* op = "adamw_step";
  int64_t n = params.numel();
  expect_f32_vec(params, n, op, "params");
  expect_f32_vec(grads, n, op, "grads");
  expect_f32_vec(m, n, op, "m");
  expect_f32_vec(v, n, op, "v");
  DTRAIN_CHECK(a.step >= 1, "{}: step must be >= 1, got {}", op, a.step);
  int64_t total = upload_segments(segments, n, op);
  double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  k::AdamWHyper h{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale,
                  float(double(a.lr) / bc1), float(std::sqrt(bc2))};
  k::adamw_step(params.f32(), grads.f32(), m.f32(), v.f32(),
                static_cast<const k::DevSegment*>(segs_dev_.data()), nsegs_dev_, total, h, stream_);
  DTRAIN_KERNEL_CHECK(what(op, params));
}

}  // namespace dtrain

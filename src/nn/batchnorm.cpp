#include "nn/layers.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace dtrain {

BatchNorm2d::BatchNorm2d(ParamStore& ps, const std::string& name, int channels, BatchNormOptions o)
    : ps_(ps), name_(name), c_(channels), opt_(o) {
  ParamDesc w;
  w.name = join_name(name, "weight");
  w.shape = Shape{channels};
  w.init = o.zero_init ? Init::Zeros : Init::Ones;
  w.decay = false;
  w.read_f32 = true;
  w_ = ps.declare(w);
  ParamDesc b;
  b.name = join_name(name, "bias");
  b.shape = Shape{channels};
  b.init = Init::Zeros;
  b.decay = false;
  b.read_f32 = true;
  b_ = ps.declare(b);
  rm_ = ps.declare_buffer(join_name(name, "running_mean"), Shape{channels}, 0.f);
  rv_ = ps.declare_buffer(join_name(name, "running_var"), Shape{channels}, 1.f);
  nbt_ = ps.declare_counter(join_name(name, "num_batches_tracked"));
}

Tensor BatchNorm2d::forward(Ctx& ctx, const Tensor& x) { return forward_impl(ctx, x, Tensor()); }

Tensor BatchNorm2d::forward_residual(Ctx& ctx, const Tensor& x, const Tensor& residual) {
  DTRAIN_CHECK(residual.defined() && residual.shape == x.shape && residual.dtype == x.dtype,
               "{}: residual {} does not match input {}", name_, residual.str(), x.str());
  return forward_impl(ctx, x, residual);
}

Tensor BatchNorm2d::forward_impl(Ctx& ctx, const Tensor& x, const Tensor& residual) {
  DTRAIN_CHECK(x.ndim() >= 2 && x.dim(-1) == c_, "{}: input {} does not end in {} channels",
               name_, x.shape.str(), c_);
  Tensor y = ctx.arena.alloc(x.dtype, x.shape);
  BnEpilogue ep;
  ep.residual = residual;
  ep.relu = opt_.relu;
  if (ctx.training) {
    if (x.numel() / c_ < 2)
      user_error("{}: training-mode batch norm needs more than 1 value per channel, got input {}",
                 name_, x.shape.str());
    mean_ = ctx.arena.alloc(DType::F32, Shape{c_});
    invstd_ = ctx.arena.alloc(DType::F32, Shape{c_});
    synced_ = bool(ctx.sync_sum);
    if (synced_) {
      forward_sync(ctx, x, y, ep);
    } else {
      Tensor rm = ps_.buffer(rm_), rv = ps_.buffer(rv_);
      if (ctx.replaying) {  // a recomputed forward: the running statistics moved the first time
        rm = ctx.arena.alloc(DType::F32, Shape{c_});
        rv = ctx.arena.alloc(DType::F32, Shape{c_});
        ctx.be.copy(ps_.buffer(rm_), rm);
        ctx.be.copy(ps_.buffer(rv_), rv);
      }
      ctx.be.batchnorm_fwd_train(x, ps_.param(w_), ps_.param(b_), y, rm, rv, mean_, invstd_,
                                 opt_.momentum, opt_.eps, ep);
    }
    if (!ctx.replaying) ps_.counter(nbt_) += 1;
    x_ = x;
    relu_y_ = opt_.relu ? y : Tensor();
    residual_ = residual.defined();
    trained_ = true;
  } else {
    ctx.be.batchnorm_fwd_eval(x, ps_.param(w_), ps_.param(b_), ps_.buffer(rm_), ps_.buffer(rv_), y,
                              opt_.eps, ep);
    x_ = relu_y_ = Tensor();
    trained_ = residual_ = false;
  }
  return y;
}

Tensor BatchNorm2d::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(!residual_, "{}: forward_residual's backward is backward_residual", name_);
  return backward_impl(ctx, dy, Tensor());
}

std::pair<Tensor, Tensor> BatchNorm2d::backward_residual(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(residual_, "{}: backward_residual without forward_residual", name_);
  Tensor dsum = ctx.arena.alloc(dy.dtype, dy.shape);
  if (!relu_y_.defined()) ctx.be.copy(dy, dsum);  // no ReLU: the sum's gradient is dy
  Tensor dx = backward_impl(ctx, dy, relu_y_.defined() ? dsum : Tensor());
  return {dx, dsum};
}

// masked (with the fused ReLU): receives dy * (y > 0)
Tensor BatchNorm2d::backward_impl(Ctx& ctx, const Tensor& dy, Tensor masked) {
  DTRAIN_CHECK(trained_ && x_.defined(), "{}: backward needs a training-mode forward", name_);
  const bool residual = residual_;
  residual_ = false;
  if (synced_) return backward_sync(ctx, dy, masked);
  Tensor dx = ctx.arena.alloc(dy.dtype, x_.shape);
  Tensor dw = ps_.grad(w_), db = ps_.grad(b_);
  BnReluBwd relu;
  relu.y = relu_y_;
  // without a residual the mask follows from x, the statistics and beta (a backend may
  // recompute it rather than read y)
  if (relu_y_.defined() && !residual) relu.beta = ps_.param(b_);
  relu.dy_masked = masked;
  ctx.be.batchnorm_bwd(dy, x_, ps_.param(w_), mean_, invstd_, dx, dw, db, /*accumulate=*/true, relu);
  ctx.notify_grad(w_);
  ctx.notify_grad(b_);
  x_ = relu_y_ = Tensor();
  trained_ = false;
  return dx;
}

// ---------------------------------------------------------------- synchronised batch norm
// model.sync_bn (PyTorch's SyncBatchNorm): the batch statistics are those of the global
// batch over all ranks. Built from the backend's batch-norm ops and one small all-reduce
// per direction (Ctx::sync_sum), so every backend gets it without new kernels:
//  forward: local mean/var (a training forward into scratch, running stats untouched) ->
//    all-reduce [n*mean, n*(var+mean^2), n] -> global mean/var -> y by the eval-mode op with
//    those statistics; the running stats move with the global mean and unbiased variance.
//  backward: the backend's backward with the global mean/invstd gives dx for LOCAL sums of
//    dy and dy*xhat, and those local sums (= dbeta, dgamma). With the global sums G and
//    counts N (local n):
//      dx = gamma*invstd*(dy - G1/N - xhat*G2/N) = dx_local + A_c + B_c*x,
//      B_c = gamma*invstd^2*(L2/n - G2/N), A_c = gamma*invstd*(L1/n - G1/N) - B_c*mean,
//    a per-channel affine map of x, which the eval-mode op computes too (weight B_c*sqrt(1+eps),
//    bias A_c, mean 0, variance 1). dgamma/dbeta stay the local sums (data parallelism
//    averages them over ranks, as DDP does with SyncBatchNorm).
namespace {

std::vector<float> to_host_f32(Ctx& ctx, const Tensor& t) {
  std::vector<float> v;
  copy_to_host_f32(ctx.be, ctx.arena, t, v);
  return v;
}

Tensor upload_f32(Ctx& ctx, const std::vector<float>& v) {
  Tensor t = ctx.arena.alloc(DType::F32, Shape{int64_t(v.size())});
  ctx.be.copy_from_host(t.data, v.data(), v.size() * 4);
  return t;
}

}  // namespace

Tensor BatchNorm2d::forward_sync(Ctx& ctx, const Tensor& x, Tensor& y, const BnEpilogue& ep) {
  Backend& be = ctx.be;
  const size_t C = size_t(c_);
  const double n = double(x.numel() / c_);
  // local statistics (the training forward's output and running-stat update are discarded)
  Tensor scratch_y = ctx.arena.alloc(x.dtype, x.shape);
  Tensor rm_tmp = ctx.arena.alloc(DType::F32, Shape{c_}), rv_tmp = ctx.arena.alloc(DType::F32, Shape{c_});
  be.fill(rm_tmp, 0.f);
  be.fill(rv_tmp, 1.f);
  be.batchnorm_fwd_train(x, ps_.param(w_), ps_.param(b_), scratch_y, rm_tmp, rv_tmp, mean_, invstd_,
                         opt_.momentum, opt_.eps);
  const std::vector<float> mean_l = to_host_f32(ctx, mean_), invstd_l = to_host_f32(ctx, invstd_);
  std::vector<float> packed(2 * C + 1);
  for (size_t c = 0; c < C; ++c) {
    const double m = mean_l[c], var = 1.0 / (double(invstd_l[c]) * invstd_l[c]) - double(opt_.eps);
    packed[c] = float(n * m);
    packed[C + c] = float(n * (std::max(var, 0.0) + m * m));
  }
  packed[2 * C] = float(n);
  Tensor t = upload_f32(ctx, packed);
  ctx.sync_sum(t);
  packed = to_host_f32(ctx, t);
  global_count_ = packed[2 * C];
  const double N = global_count_;
  std::vector<float> mean_g(C), var_g(C), invstd_g(C), var_unbiased(C);
  for (size_t c = 0; c < C; ++c) {
    const double m = packed[c] / N;
    const double var = std::max(double(packed[C + c]) / N - m * m, 0.0);
    mean_g[c] = float(m);
    var_g[c] = float(var);
    invstd_g[c] = float(1.0 / std::sqrt(var + double(opt_.eps)));
    var_unbiased[c] = float(N > 1 ? var * N / (N - 1) : var);
  }
  mean_host_ = mean_g;
  invstd_host_ = invstd_g;
  Tensor mg = upload_f32(ctx, mean_g), vg = upload_f32(ctx, var_g);
  be.batchnorm_fwd_eval(x, ps_.param(w_), ps_.param(b_), mg, vg, y, opt_.eps, ep);
  be.copy_device(mean_.data, mg.data, C * 4);
  be.copy_from_host(invstd_.data, invstd_g.data(), C * 4);
  if (ctx.replaying) return y;  // a recomputed forward: the running statistics moved the first time
  Tensor rm = ps_.buffer(rm_), rv = ps_.buffer(rv_);
  Tensor vu = upload_f32(ctx, var_unbiased);
  be.axpby(opt_.momentum, mg, 1.f - opt_.momentum, rm);
  be.axpby(opt_.momentum, vu, 1.f - opt_.momentum, rv);
  return y;
}

Tensor BatchNorm2d::backward_sync(Ctx& ctx, const Tensor& dy_in, Tensor masked) {
  Backend& be = ctx.be;
  Tensor dy = dy_in;
  if (relu_y_.defined()) {  // the fused ReLU's backward first
    dy = masked.defined() ? masked : ctx.arena.alloc(dy_in.dtype, dy_in.shape);
    be.relu_bwd(relu_y_, dy_in, dy);
  }
  const size_t C = size_t(c_);
  const double n = double(x_.numel() / c_), N = global_count_;
  Tensor dx = ctx.arena.alloc(dy.dtype, x_.shape);
  Tensor dg_l = ctx.arena.alloc(DType::F32, Shape{c_}), db_l = ctx.arena.alloc(DType::F32, Shape{c_});
  be.batchnorm_bwd(dy, x_, ps_.param(w_), mean_, invstd_, dx, dg_l, db_l, /*accumulate=*/false);
  // the parameter gradients are the local sums
  Tensor dw = ps_.grad(w_), db = ps_.grad(b_);
  be.axpby(1.f, dg_l, 1.f, dw);
  be.axpby(1.f, db_l, 1.f, db);
  ctx.notify_grad(w_);
  ctx.notify_grad(b_);
  const std::vector<float> L2 = to_host_f32(ctx, dg_l), L1 = to_host_f32(ctx, db_l);
  std::vector<float> packed(2 * C);
  for (size_t c = 0; c < C; ++c) packed[c] = L1[c], packed[C + c] = L2[c];
  Tensor t = upload_f32(ctx, packed);
  ctx.sync_sum(t);
  const std::vector<float> G = to_host_f32(ctx, t);
  const std::vector<float> gamma = to_host_f32(ctx, ps_.param(w_));
  const std::vector<float>& mean = mean_host_;
  const std::vector<float>& invstd = invstd_host_;
  std::vector<float> weight(C), bias(C), zeros(C, 0.f), ones(C, 1.f);
  for (size_t c = 0; c < C; ++c) {
    const double gi = double(gamma[c]) * invstd[c];
    const double B = gi * invstd[c] * (L2[c] / n - G[C + c] / N);
    const double A = gi * (L1[c] / n - G[c] / N) - B * mean[c];
    weight[c] = float(B * std::sqrt(1.0 + double(opt_.eps)));  // the eval op divides by sqrt(1 + eps)
    bias[c] = float(A);
  }
  Tensor corr = ctx.arena.alloc(dx.dtype, x_.shape);
  Tensor w = upload_f32(ctx, weight), b = upload_f32(ctx, bias), z = upload_f32(ctx, zeros), o = upload_f32(ctx, ones);
  be.batchnorm_fwd_eval(x_, w, b, z, o, corr, opt_.eps);
  be.add(dx, corr, dx);
  x_ = relu_y_ = Tensor();
  trained_ = false;
  return dx;
}

}  // namespace dtrain

// CudaBackend's Llama-family ops: validation + launches of llama_ops.cu.
#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/expect.h"
#include "backend/cuda/llama_kernels.h"

namespace dtrain {
namespace k = cuda_kernels;
using namespace cuda_expect;

void CudaBackend::rmsnorm_fwd(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) {
  Tensor none;
  rmsnorm_fwd_impl(x, none, none, weight, y, rstd, eps);
}

void CudaBackend::add_rmsnorm_fwd(const Tensor& a, const Tensor& b, Tensor& h, const Tensor& weight, Tensor& y,
                                  Tensor& rstd, float eps) {
  expect_like(b, a.dtype, a.numel(), "add_rmsnorm_fwd", "b");
  expect_like(h, a.dtype, a.numel(), "add_rmsnorm_fwd", "h");
  rmsnorm_fwd_impl(a, b, h, weight, y, rstd, eps);
}

void CudaBackend::rmsnorm_fwd_impl(const Tensor& x, const Tensor& res, Tensor& h, const Tensor& weight, Tensor& y,
                                   Tensor& rstd, float eps) {
  const char* op = res.defined() ? "add_rmsnorm_fwd" : "rmsnorm_fwd";
  expect_float(x, op, "x");
  const int64_t C = x.ndim() ? x.dim(-1) : 0, M = C ? x.numel() / C : 0;
  expect_like(y, x.dtype, x.numel(), op, "y");
  expect_param(weight, C, x.dtype, op, "weight");
  expect_like(rstd, DType::F32, M, op, "rstd");
  k::rmsnorm_fwd(x.data, res.data, h.data, x.dtype, M, C, weight.data, weight.dtype, y.data, rstd.f32(), eps, stream_);
  DTRAIN_KERNEL_CHECK(what(op, x));
}

void CudaBackend::rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd, Tensor& dx,
                              Tensor& dweight, bool accumulate, bool accumulate_dx) {
  const char* op = "rmsnorm_bwd";
  expect_float(x, op, "x");
  const int64_t C = x.ndim() ? x.dim(-1) : 0, M = C ? x.numel() / C : 0;
  expect_like(dy, x.dtype, x.numel(), op, "dy");
  if (dx.defined()) expect_like(dx, x.dtype, x.numel(), op, "dx");
  expect_param(weight, C, x.dtype, op, "weight");
  expect_like(rstd, DType::F32, M, op, "rstd");
  if (dweight.defined()) expect_param(dweight, C, x.dtype, op, "dweight");
  void* scratch = dweight.defined() ? scratch_.get(k::rmsnorm_bwd_scratch_bytes(M, C)) : nullptr;
  k::rmsnorm_bwd(dy.data, x.data, x.dtype, M, C, weight.data, weight.dtype, rstd.f32(), dx.data, accumulate_dx,
                 dweight.data, dweight.defined() ? dweight.dtype : DType::F32, accumulate, scratch, stream_);
  DTRAIN_KERNEL_CHECK(what(op, x));
}

void CudaBackend::rope_impl(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin,
                            const Tensor& positions, int rot_heads, Tensor& y, float sign) {
  expect_float(x, op, "x");
  DTRAIN_CHECK(x.ndim() == 3, "{}: x {} must be [B,T,W]", op, x.str());
  DTRAIN_CHECK(cos.dtype == DType::F32 && sin.dtype == DType::F32 && cos.ndim() == 2 && cos.shape == sin.shape &&
                   cos.dim(1) > 0 && cos.device.is_cuda() && sin.device.is_cuda(),
               "{}: cos {} / sin {} must be f32 [P, head_size/2] on the device", op, cos.str(), sin.str());
  const int64_t B = x.dim(0), T = x.dim(1), W = x.dim(2), P = cos.dim(0), half = cos.dim(1);
  DTRAIN_CHECK(rot_heads >= 0 && rot_heads * 2 * half <= W, "{}: {} heads of {} columns do not fit rows of {}", op,
               rot_heads, 2 * half, W);
  expect_like(y, x.dtype, x.numel(), op, "y");
  if (positions.defined())
    DTRAIN_CHECK(positions.dtype == DType::I32 && positions.numel() == B * T && positions.device.is_cuda(),
                 "{}: positions {} must be i32 [{},{}]", op, positions.str(), B, T);
  else
    DTRAIN_CHECK(T <= P, "{}: {} positions exceed the rotary table's {}", op, T, P);
  k::rope(x.data, y.data, x.dtype, B, T, W, rot_heads, half, cos.f32(), sin.f32(), P,
          positions.defined() ? positions.i32() : nullptr, sign, stream_);
  DTRAIN_KERNEL_CHECK(what(op, x));
}

void CudaBackend::rope_fwd(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                           int rot_heads, Tensor& y) {
  rope_impl("rope_fwd", x, cos, sin, positions, rot_heads, y, 1.f);
}

void CudaBackend::rope_bwd(const Tensor& dy, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                           int rot_heads, Tensor& dx) {
  rope_impl("rope_bwd", dy, cos, sin, positions, rot_heads, dx, -1.f);
}

namespace {
int64_t swiglu_width(const char* op, const Tensor& gu) {
  expect_float(gu, op, "gu");
  DTRAIN_CHECK(gu.ndim() >= 1 && gu.dim(-1) > 0 && gu.dim(-1) % 2 == 0,
               "{}: gu {} must end in 2 * intermediate columns (gate | up)", op, gu.str());
  return gu.dim(-1) / 2;
}
}  // namespace

void CudaBackend::swiglu_fwd(const Tensor& gu, Tensor& y) {
  const char* op = "swiglu_fwd";
  const int64_t I = swiglu_width(op, gu), M = gu.numel() / (2 * I);
  expect_like(y, gu.dtype, M * I, op, "y");
  k::swiglu_fwd(gu.data, y.data, gu.dtype, M, I, stream_);
  DTRAIN_KERNEL_CHECK(what(op, gu));
}

void CudaBackend::swiglu_bwd(const Tensor& gu, const Tensor& dy, Tensor& dgu) {
  const char* op = "swiglu_bwd";
  const int64_t I = swiglu_width(op, gu), M = gu.numel() / (2 * I);
  expect_like(dy, gu.dtype, M * I, op, "dy");
  expect_like(dgu, gu.dtype, gu.numel(), op, "dgu");
  k::swiglu_bwd(gu.data, dy.data, dgu.data, gu.dtype, M, I, stream_);
  DTRAIN_KERNEL_CHECK(what(op, gu));
}

}  // namespace dtrain

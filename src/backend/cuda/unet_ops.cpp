// CudaBackend U-Net ops: validate on the host, launch unet_ops.cu's kernels, check.
#include <fmt/format.h>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/unet_kernels.h"

namespace dtrain {
namespace k = cuda_kernels;
namespace {

std::string what(const char* op, const Tensor& t) { return fmt::format("{} {}", op, t.str()); }

void expect_up2x(const char* op, const Tensor& small, const Tensor& big) {
  DTRAIN_CHECK(small.defined() && big.defined() && is_float(small.dtype) &&
                   small.dtype == big.dtype && small.device.is_cuda() && small.ndim() == 4 &&
                   big.ndim() == 4 && big.dim(0) == small.dim(0) &&
                   big.dim(1) == 2 * small.dim(1) && big.dim(2) == 2 * small.dim(2) &&
                   big.dim(3) == small.dim(3),
               "{}: expected float CUDA NHWC tensors [N,H,W,C] and [N,2H,2W,C] of one dtype, got {} "
               "and {}",
               op, small.str(), big.str());
}

}  // namespace

void CudaBackend::upsample_bilinear2x_fwd(const Tensor& x, Tensor& y) {
  expect_up2x("upsample_bilinear2x_fwd", x, y);
  k::upsample2x_fwd(x.data, y.data, x.dtype, int(x.dim(0)), int(x.dim(1)), int(x.dim(2)),
                    int(x.dim(3)), stream_);
  DTRAIN_KERNEL_CHECK(what("upsample_bilinear2x_fwd", x));
}

void CudaBackend::upsample_bilinear2x_bwd(const Tensor& dy, Tensor& dx) {
  expect_up2x("upsample_bilinear2x_bwd", dx, dy);
  k::upsample2x_bwd(dy.data, dx.data, dx.dtype, int(dx.dim(0)), int(dx.dim(1)), int(dx.dim(2)),
                    int(dx.dim(3)), stream_);
  DTRAIN_KERNEL_CHECK(what("upsample_bilinear2x_bwd", dy));
}

void CudaBackend::concat_channels(const Tensor& a, const Tensor& b, Tensor& y) {
  const char* op = "concat_channels";
  DTRAIN_CHECK(a.ndim() >= 1 && a.ndim() == b.ndim() && a.ndim() == y.ndim() &&
                   a.dtype == y.dtype && b.dtype == y.dtype && y.device.is_cuda(),
               "{}: a {} b {} y {} must have equal rank and dtype", op, a.str(), b.str(), y.str());
  const int r = a.ndim() - 1;
  const int64_t Ca = a.dim(r), Cb = b.dim(r), C = y.dim(r);
  const int64_t rows = Ca ? a.numel() / Ca : 0;
  DTRAIN_CHECK(C == Ca + Cb && (!Cb || b.numel() / Cb == rows) && (!C || y.numel() / C == rows),
               "{}: a {} b {} y {}: expected y = [..., Ca+Cb]", op, a.str(), b.str(), y.str());
  k::concat_rows(a.data, b.data, y.data, rows, Ca, Cb, dtype_size(y.dtype), stream_);
  DTRAIN_KERNEL_CHECK(what(op, y));
}

void CudaBackend::split_channels(const Tensor& dy, Tensor& da, Tensor& db) {
  const char* op = "split_channels";
  const int r = dy.ndim() - 1;
  DTRAIN_CHECK(r >= 0 && (da.defined() || db.defined()) && dy.device.is_cuda(),
               "{}: dy {} with no output", op, dy.str());
  const int64_t C = dy.dim(r);
  const int64_t Ca = da.defined() ? da.dim(r) : C - db.dim(r);
  const int64_t Cb = C - Ca;
  const int64_t rows = C ? dy.numel() / C : 0;
  DTRAIN_CHECK(Ca >= 0 && Cb >= 0 &&
                   (!da.defined() || (da.dtype == dy.dtype && da.numel() == rows * Ca)) &&
                   (!db.defined() ||
                    (db.dtype == dy.dtype && db.dim(r) == Cb && db.numel() == rows * Cb)),
               "{}: dy {} da {} db {}: expected dy = [..., Ca+Cb]", op, dy.str(), da.str(), db.str());
  k::split_rows(dy.data, da.defined() ? da.data : nullptr, db.defined() ? db.data : nullptr, rows,
                Ca, Cb, dtype_size(dy.dtype), stream_);
  DTRAIN_KERNEL_CHECK(what(op, dy));
}

void CudaBackend::softmax_dice(const Tensor& logits, const Tensor& labels, float smooth,
                               float grad_scale, Tensor& loss, Tensor& dlogits) {
  const char* op = "softmax_dice";
  DTRAIN_CHECK(logits.defined() && is_float(logits.dtype) && logits.device.is_cuda() &&
                   logits.ndim() >= 2,
               "{}: logits must be a float CUDA tensor [..., K], got {}", op, logits.str());
  const int64_t K = logits.dim(logits.ndim() - 1);
  const int64_t P = K ? logits.numel() / K : 0;
  DTRAIN_CHECK(K >= 1 && K <= k::kDiceMaxClasses, "{}: {} classes (the CUDA kernel takes 1..{})",
               op, K, k::kDiceMaxClasses);
  DTRAIN_CHECK(labels.dtype == DType::I32 && labels.numel() == P,
               "{}: labels {} must be i32 with one label per pixel of logits {}", op, labels.str(),
               logits.str());
  if (loss.defined())
    DTRAIN_CHECK(loss.dtype == DType::F32 && loss.numel() == 1 && loss.device.is_cuda(),
                 "{}: loss {} must be a CUDA f32 [1]", op, loss.str());
  if (dlogits.defined())
    DTRAIN_CHECK(dlogits.dtype == logits.dtype && dlogits.numel() == logits.numel(),
                 "{}: dlogits {} vs logits {}", op, dlogits.str(), logits.str());
  const size_t pbytes = size_t(k::dice_partial_count(P, int(K))) * sizeof(double);
  char* ws = static_cast<char*>(scratch_.get(pbytes + size_t(2 * K + 1) * sizeof(float)));
  auto* partials = reinterpret_cast<double*>(ws);
  auto* coef = reinterpret_cast<float*>(ws + pbytes);
  k::softmax_dice(logits.data, logits.dtype, P, int(K), labels.ptr<int32_t>(), smooth, grad_scale,
                  partials, coef, dlogits.defined() ? dlogits.data : nullptr, stream_);
  DTRAIN_KERNEL_CHECK(what(op, logits));
  if (loss.defined()) copy_device(loss.data, coef + 2 * K, sizeof(float));
}

}  // namespace dtrain

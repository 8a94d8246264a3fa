// CpuBackend: gemm (OpenBLAS cblas_sgemm, row-major) and add_bias.
#include <cblas.h>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace dtrain {

void CpuBackend::gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b,
                      float beta, Tensor& c) {
  require_all(Op::Gemm, a, b, c);
  if (a.ndim() != 2 || b.ndim() != 2 || c.ndim() != 2)
    fault("cpu backend: gemm: expected 2-D tensors, got a {} b {} c {}", a.str(), b.str(), c.str());
  // op(a) [M,K], op(b) [K,N], c [M,N]
  const int64_t M = c.dim(0), N = c.dim(1);
  const int64_t K = trans_a ? a.dim(0) : a.dim(1);
  const int64_t am = trans_a ? a.dim(1) : a.dim(0);
  const int64_t bk = trans_b ? b.dim(1) : b.dim(0), bn = trans_b ? b.dim(0) : b.dim(1);
  if (am != M || bk != K || bn != N)
    fault("cpu backend: gemm: shapes do not match: a {}{} b {}{} c {}", a.str(),
          trans_a ? "^T" : "", b.str(), trans_b ? "^T" : "", c.str());
  const float* pa = in_f32(a, 0);
  const float* pb = in_f32(b, 1);
  float* pc = out_f32(c, 2, beta != 0.f);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // c = beta * c
    for (int64_t i = 0; i < M * N; ++i) pc[i] = beta == 0.f ? 0.f : beta * pc[i];
  } else {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, int(M), int(N), int(K), alpha, pa,
                int(a.dim(1)), pb, int(b.dim(1)), beta, pc, int(N));
  }
  store_f32(pc, c);
}

void CpuBackend::add_bias(Tensor& y, const Tensor& bias) {
  require(Op::AddBias, y);
  require(Op::AddBias, bias);
  const int64_t N = bias.numel();
  if (N == 0 || y.numel() % N != 0 || y.dim(-1) != N)
    fault("cpu backend: add_bias: y {} is not [M,{}] for bias {}", y.str(), N, bias.str());
  const int64_t M = y.numel() / N;
  const float* pb = in_f32(bias, 0);
  float* py = out_f32(y, 1, true);
#pragma omp parallel for schedule(static) if (M * N > 65536)
  for (int64_t i = 0; i < M; ++i) {
    float* row = py + i * N;
    for (int64_t j = 0; j < N; ++j) row[j] += pb[j];
  }
  store_f32(py, y);
}

}  // namespace dtrain

// CpuBackend: gemm (OpenBLAS cblas_sgemm, row-major) and add_bias.
#include <cblas.h>
#include <omp.h>

#include <algorithm>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace dtrain {

namespace cpu {
// OpenBLAS runs single-threaded (its pthread pool would spin against the OpenMP team that
// oneDNN and our loops use); parallelism comes from splitting C into one block of rows (or
// of columns when M is small) per OpenMP thread. Each element of C is computed by one
// sgemm call over the whole K, so the result does not depend on the split.
void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  auto call = [&](int64_t m, int64_t n, const float* a, const float* b, float* c) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                int(m), int(n), int(K), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
  };
  const int T = omp_get_max_threads();
  if (T <= 1 || double(M) * double(N) * double(K) < 2e5 || (M < 2 * T && N < 16 * T)) {
    call(M, N, A, B, C);
    return;
  }
  const bool by_rows = M >= 8 * T || M >= N;
  const int64_t len = by_rows ? M : N;
  const int64_t step = (len + T - 1) / T;
#pragma omp parallel for schedule(static) num_threads(T)
  for (int t = 0; t < T; ++t) {
    const int64_t b = int64_t(t) * step, e = std::min(len, b + step);
    if (b >= e) continue;
    if (by_rows)  // rows of C <- rows of op(A)
      call(e - b, N, ta ? A + b : A + b * lda, B, C + b * ldc);
    else  // columns of C <- columns of op(B)
      call(M, e - b, A, tb ? B + b * ldb : B + b, C + b);
  }
}
}  // namespace cpu

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
    cpu::sgemm(trans_a, trans_b, M, N, K, alpha, pa, a.dim(1), pb, b.dim(1), beta, pc, N);
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

// Batch norm's fused epilogue (y = relu?(bn(x) + residual?)) and the backward's fused ReLU
// mask (and, for a residual block, the masked gradient it writes for the shortcut): on the
// CPU they equal the separate ops (batch norm, add, relu / relu_bwd, batch norm backward)
// bit for bit, in f32 and with 16-bit storage; on CUDA they match the CPU.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "gpu_skip.h"
#include "backend/backend.h"
#include "core/buffer.h"
#include "gradcheck.h"
#include "op_harness.h"

using namespace dtrain;
using testing::HostDev;
using testing::HostVec;
using testing::rounded;

namespace {

using Outputs = std::vector<std::pair<std::string, HostVec>>;

// fused: the epilogue inside the batch-norm ops; otherwise the separate ops.
// recompute: the backward gets beta too (a backend may recompute the mask from x).
// gb_scale scales gamma and beta (tiny values put f16 outputs where positives round to zero).
Outputs run(Backend& be, DType t, bool fused, bool residual, int64_t M, int64_t C,
            bool recompute = false, float gb_scale = 1.f) {
  HostDev d(be);
  const HostVec x = rounded(testing::random_vec(size_t(M * C), 11, -2, 2), t);
  const HostVec r = rounded(testing::random_vec(size_t(M * C), 12, -1, 1), t);
  const HostVec dy = rounded(testing::random_vec(size_t(M * C), 13), t);
  HostVec g = testing::random_vec(size_t(C), 14, 0.5, 1.5), b = testing::random_vec(size_t(C), 15);
  for (HostVec* v : {&g, &b})
    for (float& e : *v) e *= gb_scale;
  Tensor tx = d.up(x, t, {M, C}), tr = d.up(r, t, {M, C}), tdy = d.up(dy, t, {M, C});
  Tensor tg = d.up(g, DType::F32, {C}), tb = d.up(b, DType::F32, {C});
  Tensor rm = d.up(HostVec(size_t(C), 0.f), DType::F32, {C}), rv = d.up(HostVec(size_t(C), 1.f), DType::F32, {C});
  Tensor mean = d.up(HostVec(size_t(C)), DType::F32, {C}), invstd = d.up(HostVec(size_t(C)), DType::F32, {C});
  Tensor y = d.up(HostVec(size_t(M * C)), t, {M, C}), ye = d.up(HostVec(size_t(M * C)), t, {M, C});
  BnEpilogue ep;
  ep.relu = true;
  if (residual) ep.residual = tr;
  if (fused) {
    be.batchnorm_fwd_train(tx, tg, tb, y, rm, rv, mean, invstd, 0.1f, 1e-5f, ep);
    be.batchnorm_fwd_eval(tx, tg, tb, rm, rv, ye, 1e-5f, ep);
  } else {
    be.batchnorm_fwd_train(tx, tg, tb, y, rm, rv, mean, invstd, 0.1f, 1e-5f);
    be.batchnorm_fwd_eval(tx, tg, tb, rm, rv, ye, 1e-5f);
    for (Tensor* o : {&y, &ye}) {
      if (residual) be.add(*o, tr, *o);
      be.relu_fwd(*o, *o);
    }
  }
  Tensor dx = d.up(HostVec(size_t(M * C)), t, {M, C});
  Tensor dg = d.up(HostVec(size_t(C), 0.25f), DType::F32, {C}), db = d.up(HostVec(size_t(C), 0.25f), DType::F32, {C});
  // gm: the masked gradient (a residual block's shortcut receives it)
  Tensor gm = d.up(HostVec(size_t(M * C), 9.f), t, {M, C});
  if (fused && !residual) {
    BnReluBwd relu;
    relu.y = y;
    if (recompute) relu.beta = tb;
    be.batchnorm_bwd(tdy, tx, tg, mean, invstd, dx, dg, db, true, relu);
    be.relu_bwd(y, tdy, gm);
  } else if (fused) {  // the mask and the masked gradient made by the batch norm's backward
    BnReluBwd relu;
    relu.y = y;
    relu.dy_masked = gm;
    be.batchnorm_bwd(tdy, tx, tg, mean, invstd, dx, dg, db, true, relu);
  } else {  // the ReLU's backward as its own op
    be.relu_bwd(y, tdy, gm);
    be.batchnorm_bwd(gm, tx, tg, mean, invstd, dx, dg, db, true);
  }
  return {{"y", d.down(y)}, {"y_eval", d.down(ye)}, {"running_mean", d.down(rm)}, {"running_var", d.down(rv)},
          {"dx", d.down(dx)}, {"dgamma", d.down(dg)}, {"dbeta", d.down(db)}, {"dy_masked", d.down(gm)}};
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("batchnorm epilogue on the cpu: relu and residual+relu equal the separate ops bit for bit") {
  auto cpu = make_backend("cpu");
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    for (bool residual : {false, true}) {
      CAPTURE(dtype_name(t));
      CAPTURE(residual);
      const Outputs sep = run(*cpu, t, false, residual, 50, 12);
      const Outputs fused = run(*cpu, t, true, residual, 50, 12, !residual);
      for (size_t i = 0; i < sep.size(); ++i) {
        CAPTURE(sep[i].first);
        CHECK(testing::bit_equal(fused[i].second, sep[i].second));
        CHECK(!testing::all_zero(fused[i].second));
      }
      // the ReLU really cut: some outputs are zero, some positive
      const HostVec& y = fused[0].second;
      int zeros = 0;
      for (float v : y) zeros += v == 0.f;
      CHECK(zeros > 0);
      CHECK(zeros < int(y.size()));
    }
}
}  // TEST_SUITE unit

TEST_SUITE("gpu") {
TEST_CASE("batchnorm epilogue on cuda matches the cpu") {
  GPU_OR_SKIP();
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  struct Case { int64_t M, C; };
  const Case cases[] = {{50, 12}, {3 * 7 * 5, 64}, {2 * 9 * 9, 3}};
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    for (bool residual : {false, true})
      for (const Case& c : cases) {
        CAPTURE(dtype_name(t));
        CAPTURE(residual);
        CAPTURE(c.M);
        CAPTURE(c.C);
        const Outputs want = run(*cpu, t, true, residual, c.M, c.C);
        const Outputs got = run(*gpu, t, true, residual, c.M, c.C);
        if (!residual) {
          // the mask recomputed from x (not reading y) is exactly y > 0: bit-equal outputs
          const Outputs rec = run(*gpu, t, true, false, c.M, c.C, true);
          for (size_t i = 0; i < got.size(); ++i) {
            CAPTURE(got[i].first);
            CHECK(testing::bit_equal(rec[i].second, got[i].second));
          }
        }
        for (size_t i = 0; i < want.size(); ++i) {
          CAPTURE(want[i].first);
          // 16-bit activations differ where a rounding flips (2^-8 bf16, 2^-11 f16), and so may
          // the ReLU mask of an output that rounds to zero on one side only, which reaches
          // dx, dgamma and dbeta; the running statistics depend on x alone (f32 sums)
          const bool stats = want[i].first.rfind("running", 0) == 0;
          const double tol = stats || t == DType::F32 ? 1e-4 : t == DType::BF16 ? 1e-2 : 2e-3;
          const double e = testing::nerr(got[i].second, want[i].second);
          CHECK_MESSAGE(e <= tol, want[i].first << " nerr " << e);
          CHECK(!testing::all_zero(got[i].second));
        }
      }
}

// The ReLU mask recomputed from x must equal y > 0 also where a positive pre-activation
// rounds to zero in f16 (below 2^-25): gamma and beta ~2e-8 put many outputs there.
TEST_CASE("batchnorm epilogue on cuda: the recomputed ReLU mask at f16's rounding-to-zero edge") {
  // the data reach the edge (checked on the CPU, so also where no GPU is): some positive
  // pre-activations round to zero, others survive as f16 subnormals
  auto cpu = make_backend("cpu");
  const Outputs want = run(*cpu, DType::F16, true, false, 3 * 7 * 5, 64, false, 2e-8f);
  const Outputs wide = run(*cpu, DType::F32, true, false, 3 * 7 * 5, 64, false, 2e-8f);
  int pos16 = 0, pos32 = 0;
  for (float v : want[0].second) pos16 += v > 0.f;
  for (float v : wide[0].second) pos32 += v > 0.f;
  CHECK(pos16 > 0);
  CHECK(pos32 > pos16);
  GPU_OR_SKIP();
  auto gpu = make_backend("cuda");
  const Outputs got = run(*gpu, DType::F16, true, false, 3 * 7 * 5, 64, false, 2e-8f);
  const Outputs rec = run(*gpu, DType::F16, true, false, 3 * 7 * 5, 64, true, 2e-8f);
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(got[i].first);
    CHECK(testing::bit_equal(rec[i].second, got[i].second));
  }
}
}  // TEST_SUITE gpu

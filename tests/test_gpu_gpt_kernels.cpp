// The GPT kernels' fast paths on CUDA against the CPU reference, in f32, bf16 and f16:
// warp-per-row layer norm (row widths that take the vectorised kernels and widths that fall
// back to the block kernels), vectorised GELU, the one-read masked cross-entropy, and the
// sort-based embedding backward (repeated ids, unused rows, accumulate on and off), and the
// MLP's GEMMs with the GELU and its gradient fused into cuBLASLt epilogues. Both
// backends get the same 16-bit-rounded inputs and store the same dtypes (the CPU
// emulates 16-bit storage with f32 arithmetic); tolerances are normalised L2 errors per output
// dtype (16-bit outputs differ where a rounding flips: 2^-8 bf16, 2^-11 f16).
// Without a CUDA device every case prints a visible skip.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gpu_skip.h"
#include "backend/backend.h"
#include "core/buffer.h"
#include "core/rng.h"
#include "gradcheck.h"
#include "op_harness.h"

using namespace dtrain;
using testing::HostDev;
using testing::HostVec;
using testing::rounded;

namespace {

double tol16(DType t) { return t == DType::BF16 ? 1e-2 : t == DType::F16 ? 2e-3 : 1e-5; }

using Outputs = std::vector<std::pair<std::string, HostVec>>;

// Every op once on `be` with activations in dtype t (parameters and their gradients f32).
Outputs run_ops(Backend& be, DType t, int64_t M, int64_t C, uint64_t seed) {
  HostDev d(be);
  Outputs out;
  const HostVec x = rounded(testing::random_vec(size_t(M * C), seed + 1, -2, 2), t);
  const HostVec dy = rounded(testing::random_vec(size_t(M * C), seed + 2), t);
  const HostVec g = testing::random_vec(size_t(C), seed + 3, 0.5, 1.5), b = testing::random_vec(size_t(C), seed + 4);
  Tensor tx = d.up(x, t, {M, C}), tdy = d.up(dy, t, {M, C});
  Tensor tg = d.up(g, DType::F32, {C}), tb = d.up(b, DType::F32, {C});
  Tensor y = d.up(HostVec(size_t(M * C)), t, {M, C});
  Tensor mean = d.up(HostVec(size_t(M)), DType::F32, {M}), rstd = d.up(HostVec(size_t(M)), DType::F32, {M});
  be.layernorm_fwd(tx, tg, tb, y, mean, rstd, 1e-5f);
  // the residual add fused in: h = x + dy, y2 = layernorm(h)
  {
    Tensor h = d.up(HostVec(size_t(M * C)), t, {M, C}), y2 = d.up(HostVec(size_t(M * C)), t, {M, C});
    Tensor m2 = d.up(HostVec(size_t(M)), DType::F32, {M}), r2 = d.up(HostVec(size_t(M)), DType::F32, {M});
    be.add_layernorm_fwd(tx, tdy, h, tg, tb, y2, m2, r2, 1e-5f);
    out.push_back({"addln.h", d.down(h)});
    out.push_back({"addln.y", d.down(y2)});
    out.push_back({"addln.rstd", d.down(r2)});
  }
  Tensor dx = d.up(HostVec(size_t(M * C)), t, {M, C});
  Tensor dg = d.up(HostVec(size_t(C), 0.5f), DType::F32, {C}), db = d.up(HostVec(size_t(C), 0.5f), DType::F32, {C});
  be.layernorm_bwd(tdy, tx, tg, mean, rstd, dx, dg, db, true, false);
  // accumulate_dx: a residual gradient plus the layer norm's input gradient
  Tensor dxa = d.up(rounded(testing::random_vec(size_t(M * C), seed + 7), t), t, {M, C});
  Tensor dg2 = d.up(HostVec(size_t(C)), DType::F32, {C}), db2 = d.up(HostVec(size_t(C)), DType::F32, {C});
  be.layernorm_bwd(tdy, tx, tg, mean, rstd, dxa, dg2, db2, false, true);
  out.push_back({"ln.y", d.down(y)});
  out.push_back({"ln.dx.acc", d.down(dxa)});
  out.push_back({"ln.mean", d.down(mean)});
  out.push_back({"ln.rstd", d.down(rstd)});
  out.push_back({"ln.dx", d.down(dx)});
  out.push_back({"ln.dgamma", d.down(dg)});
  out.push_back({"ln.dbeta", d.down(db)});

  Tensor gy = d.up(HostVec(size_t(M * C)), t, {M, C}), gdx = d.up(HostVec(size_t(M * C)), t, {M, C});
  be.gelu_fwd(tx, gy);
  be.gelu_bwd(tx, tdy, gdx);
  out.push_back({"gelu.y", d.down(gy)});
  out.push_back({"gelu.dx", d.down(gdx)});

  // masked cross-entropy over C padded columns, the last 3 never predicted
  Rng r(seed + 5, 1);
  std::vector<int32_t> labels(static_cast<size_t>(M));
  for (auto& l : labels) l = int32_t(r.below(uint64_t(C - 3)));
  Tensor lab = d.labels(labels);
  Tensor losses = d.up(HostVec(size_t(M)), DType::F32, {M}), dz = d.up(HostVec(size_t(M * C)), t, {M, C});
  be.softmax_xent_masked(tx, lab, C - 3, 0.25f, losses, dz);
  out.push_back({"xent.loss", d.down(losses)});
  out.push_back({"xent.dlogits", d.down(dz)});

  // embedding backward: M positions as [1, M], ids with repeats
  const int64_t V = 11;
  std::vector<int32_t> ids(static_cast<size_t>(M));
  for (auto& i : ids) i = int32_t(r.below(5)) * 2;  // ids 0, 2, .., 8: repeats, odd rows unused
  Tensor tids = d.labels(ids).view({1, M});
  const HostVec w0 = testing::random_vec(size_t(V * C), seed + 6);
  for (bool acc : {true, false}) {
    Tensor dwte = d.up(w0, DType::F32, {V, C}), dwpe = d.up(HostVec(size_t(M * C), 1.f), DType::F32, {M, C});
    be.embedding_bwd(tdy, tids, dwte, dwpe, acc);
    out.push_back({acc ? "emb.dwte.acc" : "emb.dwte", d.down(dwte)});
    out.push_back({acc ? "emb.dwpe.acc" : "emb.dwpe", d.down(dwpe)});
  }
  return out;
}

// which outputs are 16-bit (rounded to t) and which f32 (sums of the same rounded inputs)
bool is_activation(const std::string& name) {
  return name == "ln.y" || name == "ln.dx" || name == "ln.dx.acc" || name == "addln.h" || name == "addln.y" || name == "gelu.y" || name == "gelu.dx" || name == "xent.dlogits";
}

}  // namespace

TEST_SUITE("gpu") {
TEST_CASE("cuda gpt kernels: vectorised and warp-per-row paths match the CPU in every dtype") {
  GPU_OR_SKIP();
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  struct Case { int64_t M, C; };
  // 768: GPT-2 (warp path, 3 or 6 vectors a lane); 20: f32 vectors only (bf16/f16 fall back);
  // 2056: wider than the warp kernels take for 16-bit; 64: one vector a lane
  const Case cases[] = {{37, 768}, {9, 20}, {4, 2056}, {64, 64}};
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    for (const Case& c : cases) {
      CAPTURE(dtype_name(t));
      CAPTURE(c.M);
      CAPTURE(c.C);
      const Outputs want = run_ops(*cpu, t, c.M, c.C, 40);
      const Outputs got = run_ops(*gpu, t, c.M, c.C, 40);
      REQUIRE(want.size() == got.size());
      for (size_t i = 0; i < want.size(); ++i) {
        CAPTURE(want[i].first);
        // f32 outputs of 16-bit inputs (statistics, losses, parameter gradients) are sums in
        // f32 on both sides; the losses read 16-bit logits exactly, so 1e-4 holds for all
        const double tol = is_activation(want[i].first) ? tol16(t) : 1e-4;
        const double e = testing::nerr(got[i].second, want[i].second);
        CHECK_MESSAGE(e <= tol, want[i].first << " nerr " << e);
        CHECK(!testing::all_zero(got[i].second));
        bool finite = true;
        for (float v : got[i].second) finite = finite && std::isfinite(v);
        CHECK(finite);
      }
      const Outputs again = run_ops(*gpu, t, c.M, c.C, 40);
      for (size_t i = 0; i < got.size(); ++i) {
        CAPTURE(got[i].first);
        CHECK(testing::bit_equal(got[i].second, again[i].second));  // deterministic
      }
    }
  }
}

// GPT's MLP GEMMs with the GELU fused (cuBLASLt GELU_AUX_BIAS / DGELU epilogues on CUDA)
// against the CPU's separate passes. N = 3072 and 96 take the fused path; N = 36 (not a
// multiple of 8) falls back to gemm + gelu on CUDA too.
TEST_CASE("cuda gpt kernels: GEMMs with fused GELU and GELU-gradient epilogues match the CPU") {
  GPU_OR_SKIP();
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  struct Case { int64_t M, K, N; };
  const Case cases[] = {{64, 768, 3072}, {37, 64, 96}, {9, 20, 36}};
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    for (const Case& c : cases) {
      CAPTURE(dtype_name(t));
      CAPTURE(c.M);
      CAPTURE(c.K);
      CAPTURE(c.N);
      const HostVec x = rounded(testing::random_vec(size_t(c.M * c.K), 51, -1, 1), t);
      const HostVec w = rounded(testing::random_vec(size_t(c.N * c.K), 52, -0.1f, 0.1f), t);
      const HostVec bias = rounded(testing::random_vec(size_t(c.N), 53, -0.5f, 0.5f), t);
      const HostVec dy = rounded(testing::random_vec(size_t(c.M * c.K), 54, -1, 1), t);
      auto run = [&](Backend& be) {
        HostDev d(be);
        // forward: x [M,K] W^T (W [N,K]) + bias -> pre, gelu(pre)
        Tensor tx = d.up(x, t, {c.M, c.K}), tw = d.up(w, t, {c.N, c.K}), tb = d.up(bias, t, {c.N});
        Tensor pre = d.up(HostVec(size_t(c.M * c.N)), t, {c.M, c.N}), y = d.up(HostVec(size_t(c.M * c.N)), t, {c.M, c.N});
        be.gemm_bias_gelu(false, true, tx, tw, tb, pre, y);
        // backward of the next Linear: dy [M,K] W' ([K,N]) times gelu'(pre)
        Tensor tdy = d.up(dy, t, {c.M, c.K}), w2 = d.up(w, t, {c.K, c.N});
        Tensor dpre = d.up(HostVec(size_t(c.M * c.N)), t, {c.M, c.N});
        be.gemm_dgelu(false, false, tdy, w2, pre, dpre);
        return std::vector<HostVec>{d.down(pre), d.down(y), d.down(dpre)};
      };
      const auto want = run(*cpu), got = run(*gpu);
      const char* names[] = {"pre", "gelu", "dgelu"};
      for (size_t i = 0; i < 3; ++i) {
        CAPTURE(names[i]);
        // f32: a K-term sum in a different order (no TF32: precision.tf32 is off by default)
        const double tol = t == DType::F32 ? 1e-5 : tol16(t);
        const double e = testing::nerr(got[i], want[i]);
        CHECK_MESSAGE(e <= tol, names[i] << " nerr " << e);
        CHECK(!testing::all_zero(got[i]));
      }
      CHECK(testing::bit_equal(run(*gpu)[2], got[2]));  // deterministic
    }
  }
}

// A Linear's weight and bias gradients (Backend::linear_wgrad): on CUDA the bias gradient
// comes out of the weight-gradient GEMM (BGRADA for [in,out] weights, BGRADB for [out,in]),
// written to scratch and added, so both accumulate into the f32 master gradients.
TEST_CASE("cuda gpt kernels: weight-gradient GEMM with the bias gradient epilogue matches the CPU") {
  GPU_OR_SKIP();
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  struct Case { int64_t M, in, out; };
  const Case cases[] = {{256, 768, 2304}, {37, 64, 96}, {9, 20, 36}};
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    for (const Case& c : cases) {
      for (bool in_out : {true, false}) {
        CAPTURE(dtype_name(t));
        CAPTURE(c.M);
        CAPTURE(c.in);
        CAPTURE(c.out);
        CAPTURE(in_out);
        const HostVec dy = rounded(testing::random_vec(size_t(c.M * c.out), 61, -1, 1), t);
        const HostVec x = rounded(testing::random_vec(size_t(c.M * c.in), 62, -1, 1), t);
        const HostVec w0 = testing::random_vec(size_t(c.in * c.out), 63), b0 = testing::random_vec(size_t(c.out), 64);
        auto run = [&](Backend& be) {
          HostDev d(be);
          Tensor tdy = d.up(dy, t, {c.M, c.out}), tx = d.up(x, t, {c.M, c.in});
          Tensor dw = in_out ? d.up(w0, DType::F32, {c.in, c.out}) : d.up(w0, DType::F32, {c.out, c.in});
          Tensor db = d.up(b0, DType::F32, {c.out});
          be.linear_wgrad(tdy, tx, in_out, dw, db);
          be.linear_wgrad(tdy, tx, in_out, dw, db);  // twice: both accumulate
          return std::vector<HostVec>{d.down(dw), d.down(db)};
        };
        const auto want = run(*cpu), got = run(*gpu);
        for (size_t i = 0; i < 2; ++i) {
          CAPTURE(i);
          const double e = testing::nerr(got[i], want[i]);
          CHECK_MESSAGE(e <= 1e-4, (i == 0 ? "dw" : "dbias") << " nerr " << e);
        }
      }
    }
  }
}
}  // TEST_SUITE gpu

// Causal attention on CUDA in bf16/f16 (flash attention: flash_attn.cu) against the CPU
// reference in f32 on the same 16-bit-rounded inputs, forward and backward, for partial
// tiles (T = 1, 17, 100, 257, ...), every head size the kernels take and one they do not
// (the probabilities path). Without a CUDA device the case prints a visible skip.
//
// Tolerance: relative L2 error of out and of each of dq, dk, dv (slices of dqkv) <= 4u,
// u = 2^-8 (bf16) or 2^-11 (f16). The outputs are rounded to 16 bits (error ~u/2 per
// element alone), and the kernels round P and dS to 16 bits before their products, as
// FlashAttention does. A host simulation of the kernels' loops and rounding points against
// an f64 reference gave 0.4u-1.1u on these shapes (softmax inputs up to |q.k|/sqrt(hs) ~ 6);
// 4u leaves room for the GPU's summation order. The probabilities path (16-bit scores
// and probabilities stored in [B,H,T,T]) gets 8u.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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

namespace {

constexpr size_t kGuard = 256;  // bytes after every GPU output that must stay 0xFF

float round_to(DType t, float v) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  if (t == DType::F16) return f16_to_f32(f32_to_f16(v));
  return v;
}

HostVec random_rounded(DType t, size_t n, uint64_t seed, float lo, float hi) {
  HostVec v = testing::random_vec(n, seed, lo, hi);
  for (float& f : v) f = round_to(t, f);
  return v;
}

// A GPU tensor of dtype t followed by kGuard bytes, every byte 0xFF first (NaN in f32,
// bf16 and f16: an element the op does not write reads back as NaN), then `init`.
struct GpuTensor {
  Buffer buf;
  Tensor t;
  GpuTensor(Backend& be, DType dt, Shape s, const HostVec* init = nullptr)
      : buf(be, size_t(s.numel()) * dtype_size(dt) + kGuard) {
    t = buf.tensor(dt, s);
    std::vector<unsigned char> bytes(buf.bytes(), 0xFF);
    if (init) {
      REQUIRE(int64_t(init->size()) == s.numel());
      for (size_t i = 0; i < init->size(); ++i) {
        const float f = (*init)[i];
        if (dt == DType::F32) {
          std::memcpy(&bytes[i * 4], &f, 4);
        } else {
          const uint16_t h = dt == DType::BF16 ? f32_to_bf16(f) : f32_to_f16(f);
          std::memcpy(&bytes[i * 2], &h, 2);
        }
      }
    }
    be.copy_from_host(buf.data(), bytes.data(), bytes.size());
  }
  // The values as f32; `guard_ok` says whether the bytes after the tensor are untouched.
  HostVec read(Backend& be, bool* guard_ok) const {
    std::vector<unsigned char> bytes(buf.bytes());
    be.copy_to_host(bytes.data(), buf.data(), bytes.size());
    const size_t n = size_t(t.numel()), es = dtype_size(t.dtype);
    *guard_ok = std::all_of(bytes.begin() + long(n * es), bytes.end(),
                            [](unsigned char c) { return c == 0xFF; });
    HostVec v(n);
    for (size_t i = 0; i < n; ++i) {
      if (t.dtype == DType::F32) {
        std::memcpy(&v[i], &bytes[i * 4], 4);
      } else {
        uint16_t h;
        std::memcpy(&h, &bytes[i * 2], 2);
        v[i] = t.dtype == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
    }
    return v;
  }
};

size_t count_nonfinite(const HostVec& v) {
  return size_t(std::count_if(v.begin(), v.end(), [](float f) { return !std::isfinite(f); }));
}

// Part p (0 = q, 1 = k, 2 = v) of a [B,T,3C] tensor.
HostVec part(const HostVec& x, int64_t C, int p) {
  HostVec out;
  out.reserve(x.size() / 3);
  for (size_t r = 0; r < x.size() / size_t(3 * C); ++r)
    out.insert(out.end(), x.begin() + long(r * 3 * C + p * C), x.begin() + long(r * 3 * C + (p + 1) * C));
  return out;
}

double norm(const HostVec& v) { return std::sqrt(testing::dot(v, v)); }
float max_abs(const HostVec& v) {
  float m = 0.f;
  for (float f : v) m = std::max(m, std::fabs(f));
  return m;
}

// lse[b,h,t] = log sum_{s<=t} exp(q_t.k_s / sqrt(hs)) in double.
std::vector<double> lse_reference(const HostVec& qkv, int64_t B, int64_t T, int64_t H,
                                  int64_t hs) {
  const int64_t C = H * hs;
  std::vector<double> out(size_t(B * H * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> s(size_t(t + 1));
        double mx = -1e300;
        for (int64_t u = 0; u <= t; ++u) {
          double d = 0;
          for (int64_t j = 0; j < hs; ++j)
            d += double(qkv[size_t((b * T + t) * 3 * C + h * hs + j)]) *
                 qkv[size_t((b * T + u) * 3 * C + C + h * hs + j)];
          s[size_t(u)] = d / std::sqrt(double(hs));
          mx = std::max(mx, s[size_t(u)]);
        }
        double se = 0;
        for (double v : s) se += std::exp(v - mx);
        out[size_t((b * H + h) * T + t)] = mx + std::log(se);
      }
  return out;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("attention on CUDA in bf16 and f16 (flash) matches the CPU reference forward and backward") {
  GPU_OR_SKIP();
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  struct Case {
    int64_t B, T, H, hs;
  };
  // hs = 24 is not a flash head size: the probabilities path, for comparison.
  const Case cases[] = {{1, 1, 2, 64},  {2, 17, 3, 64},  {1, 64, 2, 64}, {2, 100, 2, 64},
                        {1, 257, 2, 64}, {2, 1024, 2, 64}, {2, 130, 4, 32}, {1, 77, 2, 128},
                        {2, 33, 2, 16},  {3, 65, 1, 16},  {2, 50, 2, 24}};
  uint64_t seed = 100;
  for (DType dt : {DType::BF16, DType::F16}) {
    const double u = std::ldexp(1.0, dt == DType::BF16 ? -8 : -11);
    for (const Case& c : cases) {
      const int64_t B = c.B, T = c.T, H = c.H, hs = c.hs, C = H * hs;
      const AttentionSaved sv = gpu->attention_saved(B, H, T, hs, dt);
      const bool flash = hs != 24;
      const double tol = (flash ? 4 : 8) * u;
      const std::string what = std::string(dtype_name(dt)) + " B=" + std::to_string(B) +
                               " T=" + std::to_string(T) + " H=" + std::to_string(H) +
                               " hs=" + std::to_string(hs) + (flash ? " (flash)" : " (probs)");
      CAPTURE(what);
      if (flash) {
        CHECK(sv.dtype == DType::F32);
        CHECK(sv.shape == Shape{B, H, T});
      } else {
        CHECK(sv.dtype == dt);
        CHECK(sv.shape == Shape{B, H, T, T});
      }
      const HostVec qkv = random_rounded(dt, size_t(B * T * 3 * C), ++seed, -1.5f, 1.5f);
      const HostVec dout = random_rounded(dt, size_t(B * T * C), ++seed, -1.f, 1.f);

      // CPU reference (f32 on the rounded values)
      HostDev d(*cpu);
      Tensor cq = d.up(qkv, Shape{B, T, 3 * C}), co = d.zeros(Shape{B, T, C});
      Tensor cp = d.zeros(Shape{B, H, T, T}), cg = d.up(dout, Shape{B, T, C});
      Tensor cd = d.zeros(Shape{B, T, 3 * C});
      cpu->attention_fwd(cq, co, cp, int(H));
      cpu->attention_bwd(cg, cq, co, cp, cd, int(H));
      const HostVec out_ref = d.down(co), dqkv_ref = d.down(cd);

      // CUDA: outputs start as NaN (every element must be written) with guard bytes after
      GpuTensor gq(*gpu, dt, Shape{B, T, 3 * C}, &qkv), gg(*gpu, dt, Shape{B, T, C}, &dout);
      GpuTensor go(*gpu, dt, Shape{B, T, C}), gs(*gpu, sv.dtype, sv.shape);
      GpuTensor gd(*gpu, dt, Shape{B, T, 3 * C}), gd2(*gpu, dt, Shape{B, T, 3 * C});
      gpu->attention_fwd(gq.t, go.t, gs.t, int(H));
      gpu->attention_bwd(gg.t, gq.t, go.t, gs.t, gd.t, int(H));
      bool g_out = false, g_saved = false, g_dqkv = false, g_dqkv2 = false;
      const HostVec out = go.read(*gpu, &g_out), saved = gs.read(*gpu, &g_saved);
      const HostVec dqkv = gd.read(*gpu, &g_dqkv);
      CHECK_MESSAGE(g_out, "bytes after out overwritten");
      CHECK_MESSAGE(g_saved, "bytes after saved overwritten");
      CHECK_MESSAGE(g_dqkv, "bytes after dqkv overwritten");
      CHECK(count_nonfinite(out) == 0);
      CHECK(count_nonfinite(saved) == 0);
      CHECK(count_nonfinite(dqkv) == 0);

      const double e_out = testing::nerr(out, out_ref);
      MESSAGE(what << ": out rel err " << e_out);
      CHECK(e_out <= tol);
      CHECK(!testing::all_zero(out));
      for (int p = 0; p < 3; ++p) {
        const HostVec got = part(dqkv, C, p), want = part(dqkv_ref, C, p);
        const std::string name = p == 0 ? "dq" : p == 1 ? "dk" : "dv";
        CAPTURE(name);
        if (norm(want) > 1e-6 * norm(part(dqkv_ref, C, 2))) {
          const double e = testing::nerr(got, want);
          MESSAGE(what << ": " << name << " rel err " << e);
          CHECK(e <= tol);
          CHECK(!testing::all_zero(got));
        } else {
          // T = 1: dq = dk = 0 exactly (dS = P (dP - D) with P = 1 and D = dP); the kernels
          // get D from the rounded output, so only rounding noise remains.
          CHECK(max_abs(got) <= 1e-3f);
        }
      }
      if (flash) {  // the saved log-sum-exp itself
        const std::vector<double> lse = lse_reference(qkv, B, T, H, hs);
        double worst = 0;
        for (size_t i = 0; i < lse.size(); ++i) worst = std::max(worst, std::fabs(saved[i] - lse[i]));
        CHECK(worst <= 1e-3);
      }

      // deterministic: the backward again (into fresh NaN memory) and the forward again
      gpu->attention_bwd(gg.t, gq.t, go.t, gs.t, gd2.t, int(H));
      const HostVec dqkv2 = gd2.read(*gpu, &g_dqkv2);
      CHECK(testing::bit_equal(dqkv, dqkv2));
      gpu->attention_fwd(gq.t, go.t, gs.t, int(H));
      CHECK(testing::bit_equal(go.read(*gpu, &g_out), out));
      CHECK(testing::bit_equal(gs.read(*gpu, &g_saved), saved));
    }
  }
}

}  // TEST_SUITE("gpu")

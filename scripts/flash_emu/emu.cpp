// Runs the flash attention kernels of src/backend/cuda/flash_attn.cu on the CPU: one host
// thread per CUDA thread, blocks one after another, __syncthreads and the warp-collective
// instructions (ldmatrix, mma.sync, shuffles) emulated as the PTX ISA documents them
// (wrappers.inc), cp.async landing only at its wait; outputs start as NaN and shared memory
// as garbage. Compares out, the LSE and dq/dk/dv with an f64 reference, for multi-head and
// grouped-query attention (Hkv key/value heads, query head h reading h / (H / Hkv)). A development
// check for machines without a GPU (run.sh); the gpu rows of the parity table (tests/backend/parity/rows_attention.cpp) are the real one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <array>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>
#include <algorithm>
#include "core/dtype.h"
#include "backend/cuda/flash_attn.h"
#include "backend/cuda/flash_frag.h"

struct U3 { unsigned x = 0, y = 0, z = 0; };
thread_local U3 t_threadIdx, t_blockIdx, t_gridDim, t_blockDim;
thread_local unsigned char* t_smem;
#define threadIdx t_threadIdx
#define blockIdx t_blockIdx
#define gridDim t_gridDim
#define blockDim t_blockDim
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
using std::min;

namespace dtrain::cuda_kernels {
inline float to_f(__nv_bfloat16 v) { uint16_t h; std::memcpy(&h, &v, 2); uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float to_f(__half v) { return __half2float(v); }
}
#include "kernels.inc"

using namespace dtrain::cuda_kernels;

static std::atomic<int> g_failures{0};

template <typename F>
void launch(U3 grid, int threads, size_t smem_bytes, F&& body) {
  std::vector<unsigned char> sm(smem_bytes + 64, 0xCD);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        BlockCtx blk(threads);
        std::fill(sm.begin(), sm.end(), 0xCD);  // garbage until written
        std::vector<std::thread> th;
        for (int t = 0; t < threads; ++t)
          th.emplace_back([&, t] {
            t_threadIdx = {unsigned(t), 0, 0};
            t_blockIdx = {x, y, z};
            t_gridDim = grid;
            t_blockDim = {unsigned(threads), 1, 1};
            t_smem = sm.data();
            t_blk = &blk;
            body();
            if (!t_pending.empty()) std::printf("FAIL: cp.async copies never waited for\n"), ++g_failures;
          });
        for (auto& t : th) t.join();
      }
}

static bool BF = true;
uint16_t to16(float f) {
  if (BF) return dtrain::f32_to_bf16(f);
  return dtrain::f32_to_f16(f);
}
float from16(uint16_t h) { return BF ? dtrain::bf16_to_f32(h) : dtrain::f16_to_f32(h); }

template <typename E, int HS>
void run_case(int B, int T, int H, int Hkv, uint64_t seed) {
  const int C = H * HS, ld = C + 2 * Hkv * HS, g = H / Hkv;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> U(-1, 1);
  std::vector<uint16_t> qkv(size_t(B) * T * ld), dout(size_t(B) * T * C);
  for (auto& v : qkv) v = to16(1.5f * U(rng));
  for (auto& v : dout) v = to16(U(rng));
  std::vector<uint16_t> out(size_t(B) * T * C, 0xFFFF), dqkv(qkv.size(), 0xFFFF);
  std::vector<float> lse(size_t(B) * H * T, NAN), dsum(size_t(B) * H * T, NAN);
  const float scale = 1.f / std::sqrt(float(HS)), scale2 = scale * 1.4426950408889634f;
  const unsigned nt = unsigned((T + 63) / 64);
  const int tb = int(Tile<HS>::kBytes);
  launch({unsigned(H), unsigned(B), nt}, 128, 5 * tb, [&] { flash_fwd_k<E, HS>(qkv.data(), out.data(), lse.data(), T, H, Hkv, scale2); });
  const int64_t rows = int64_t(B) * T * H;
  std::vector<E> dout_t(dout.size()), out_t(out.size());
  std::memcpy(dout_t.data(), dout.data(), dout.size() * 2);
  std::memcpy(out_t.data(), out.data(), out.size() * 2);
  launch({unsigned((rows + 7) / 8), 1, 1}, 256, 0, [&] { flash_dsum_k<E>(dout_t.data(), out_t.data(), dsum.data(), rows, T, H, HS); });
  launch({unsigned(Hkv), unsigned(B), nt}, 128, 6 * tb + 4 * 64 * 4, [&] { flash_bwd_dkdv_k<E, HS>(dout.data(), qkv.data(), lse.data(), dsum.data(), dqkv.data(), T, H, Hkv, scale2, scale); });
  launch({unsigned(H), unsigned(B), nt}, 128, 6 * tb, [&] { flash_bwd_dq_k<E, HS>(dout.data(), qkv.data(), lse.data(), dsum.data(), dqkv.data(), T, H, Hkv, scale2, scale); });

  // f64 reference
  // column of head h's value x in part 0 (q, query head h) or 1/2 (k/v of query head h's key/value head)
  auto col = [&](int part, int h, int x) { return part == 0 ? h * HS + x : C + (part - 1) * Hkv * HS + (h / g) * HS + x; };
  auto q = [&](int b, int i, int part, int h, int x) { return double(from16(qkv[(size_t(b) * T + i) * ld + col(part, h, x)])); };
  std::vector<double> oref(out.size()), dref(qkv.size(), 0.0), lref(lse.size());
  for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) {
    std::vector<double> P(size_t(T) * T, 0.0);
    for (int i = 0; i < T; ++i) {
      double mx = -1e300; std::vector<double> s(i + 1);
      for (int j = 0; j <= i; ++j) { double d = 0; for (int x = 0; x < HS; ++x) d += q(b, i, 0, h, x) * q(b, j, 1, h, x); s[j] = d * scale; mx = std::max(mx, s[j]); }
      double se = 0; for (int j = 0; j <= i; ++j) se += std::exp(s[j] - mx);
      lref[(size_t(b) * H + h) * T + i] = mx + std::log(se);
      for (int j = 0; j <= i; ++j) P[size_t(i) * T + j] = std::exp(s[j] - mx) / se;
      for (int x = 0; x < HS; ++x) { double o = 0; for (int j = 0; j <= i; ++j) o += P[size_t(i) * T + j] * q(b, j, 2, h, x); oref[(size_t(b) * T + i) * C + h * HS + x] = o; }
    }
    for (int i = 0; i < T; ++i) {
      auto gr = [&](int x) { return double(from16(dout[(size_t(b) * T + i) * C + h * HS + x])); };
      std::vector<double> dp(i + 1); double dot = 0;
      for (int j = 0; j <= i; ++j) { double d = 0; for (int x = 0; x < HS; ++x) { d += gr(x) * q(b, j, 2, h, x); dref[(size_t(b) * T + j) * ld + col(2, h, x)] += P[size_t(i) * T + j] * gr(x); } dp[j] = d; dot += P[size_t(i) * T + j] * d; }
      for (int j = 0; j <= i; ++j) { double w = P[size_t(i) * T + j] * (dp[j] - dot) * scale; for (int x = 0; x < HS; ++x) { dref[(size_t(b) * T + i) * ld + col(0, h, x)] += w * q(b, j, 1, h, x); dref[(size_t(b) * T + j) * ld + col(1, h, x)] += w * q(b, i, 0, h, x); } }
    }
  }
  auto rel = [&](const std::vector<uint16_t>& got, const std::vector<double>& want, int part, size_t* nonfin) {
    double se = 0, sw = 0;
    for (size_t k = 0; k < want.size(); ++k) {
      const int c = int(k % ld);
      if (part >= 0 && (c < C ? 0 : c < C + Hkv * HS ? 1 : 2) != part) continue;
      double v = from16(got[k]);
      if (!std::isfinite(v)) { ++*nonfin; continue; }
      se += (v - want[k]) * (v - want[k]); sw += want[k] * want[k];
    }
    return sw > 0 ? std::sqrt(se / sw) : std::sqrt(se);
  };
  size_t nf = 0;
  double eo = rel(out, oref, -1, &nf), eq = rel(dqkv, dref, 0, &nf), ek = rel(dqkv, dref, 1, &nf), ev = rel(dqkv, dref, 2, &nf);
  double el = 0; for (size_t k = 0; k < lse.size(); ++k) { if (!std::isfinite(lse[k])) ++nf; el = std::max(el, std::fabs(lse[k] - lref[k])); }
  // 4 units of roundoff, as the parity table (T = 1: dq = dk = 0, absolute)
  const double tol = 4 * std::ldexp(1.0, BF ? -8 : -11);
  const bool ok = nf == 0 && eo <= tol && (T == 1 || (eq <= tol && ek <= tol)) && ev <= tol && el <= 1e-3;
  if (!ok) ++g_failures;
  std::printf("%s %s B=%d T=%d H=%d Hkv=%d hs=%d: nonfinite %zu | out %.2e dq %.2e dk %.2e dv %.2e | lse max abs %.2e\n", ok ? "ok  " : "FAIL", BF ? "bf16" : "f16", B, T, H, Hkv, HS, nf, eo, eq, ek, ev, el);
}

int main() {
  for (int m = 0; m < 2; ++m) {
    BF = m == 0;
    auto go = [&](auto tag) {
      using T = decltype(tag);
      run_case<T, 64>(1, 1, 2, 2, 1);
      run_case<T, 64>(2, 17, 3, 3, 2);
      run_case<T, 64>(1, 64, 2, 2, 3);
      run_case<T, 32>(1, 70, 4, 2, 9);   // grouped-query: 2 query heads per key/value head
      run_case<T, 16>(2, 33, 3, 1, 10);  // multi-query
      if (std::getenv("QUICK")) return;
      run_case<T, 64>(2, 100, 2, 2, 4);
      run_case<T, 64>(1, 257, 1, 1, 5);
      run_case<T, 32>(2, 130, 2, 2, 6);
      run_case<T, 128>(1, 77, 2, 2, 7);
      run_case<T, 16>(2, 33, 2, 2, 8);
      run_case<T, 64>(1, 130, 4, 1, 11);
    };
    if (BF) go(__nv_bfloat16{}); else go(__half{});
  }
  std::printf("%s\n", g_failures ? "FAILED" : "all ok");
  return g_failures.load() ? 1 : 0;
}

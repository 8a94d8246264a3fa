// The fragment formulas of the flash attention kernels (backend/cuda/flash_frag.h), checked
// on the CPU: ldmatrix.x4 and mma.m16n8k16 are emulated lane by lane as the PTX ISA
// documents them, fed with the kernels' per-lane addresses, and the two products the
// kernels build (S = A B^T from shared-memory tiles, O = P V with P taken from the
// accumulator registers) must equal plain matrix products. Integer values: exact.
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/cuda/flash_frag.h"

namespace fr = dtrain::cuda_kernels::frag;

namespace {

using Reg = std::array<float, 2>;          // a 32-bit register: (lo, hi) 16-bit halves
using Lanes4 = std::array<std::array<Reg, 4>, 32>;
using Acc = std::array<std::array<float, 4>, 32>;  // one 16x8 f32 accumulator tile

struct Smem {  // a row-major tile with row stride ld
  int rows, ld;
  std::vector<float> v;
  Smem(int r, int cols, int pad, int seed) : rows(r), ld(cols + pad), v(size_t(r * (cols + pad))) {
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = float(int(((i + 1) * 2654435761u + uint64_t(seed) * 97) >> 9 & 7) - 4);
  }
  float at(int r, int c) const { return v[size_t(r * ld + c)]; }
};

// ldmatrix.x4 (PTX ISA): lane 8m + r gives the address (row, col) of row r of matrix m;
// register m of lane L receives row L/4, columns 2(L%4), 2(L%4)+1 of matrix m, or with
// .trans column L/4, rows 2(L%4), 2(L%4)+1.
Lanes4 ldmatrix_x4(const Smem& s, const std::array<std::array<int, 2>, 32>& addr, bool trans) {
  Lanes4 out{};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, q = lane % 4;
    for (int m = 0; m < 4; ++m)
      for (int h = 0; h < 2; ++h) {
        if (!trans) {
          const auto [r, c] = addr[size_t(8 * m + g)];
          out[size_t(lane)][size_t(m)][size_t(h)] = s.at(r, c + 2 * q + h);
        } else {
          const auto [r, c] = addr[size_t(8 * m + 2 * q + h)];
          out[size_t(lane)][size_t(m)][size_t(h)] = s.at(r, c + g);
        }
      }
  }
  return out;
}

// mma.m16n8k16 (PTX ISA layouts for 16-bit A/B and f32 C/D): d += A B. Element a_i of a lane
// is half i%2 of register i/2; b_i likewise with registers b[0], b[1].
void mma(Acc& d, const Lanes4& a, const Lanes4& b, int breg0) {
  float A[16][16] = {}, Bm[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, q = lane % 4;
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const int col = q * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = a[size_t(lane)][size_t(i / 2)][size_t(i % 2)];
    }
    for (int i = 0; i < 4; ++i) {
      const int k = q * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      Bm[k][g] = b[size_t(lane)][size_t(breg0 + i / 2)][size_t(i % 2)];
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, q = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = q * 2 + (i & 1);
      float s = 0;
      for (int k = 0; k < 16; ++k) s += A[row][k] * Bm[k][col];
      d[size_t(lane)][size_t(i)] += s;
    }
  }
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("flash attention fragments: emulated ldmatrix and mma compose S = Q K^T and O = P V") {
  constexpr int HS = 32, NK = 32, r0 = 16;  // rows r0..r0+15 of Q against 32 keys
  const Smem Q(32, HS, 8, 1), K(NK, HS, 8, 2), V(NK, HS, 8, 3);
  // S (16 x NK) as NK/8 accumulator tiles, the loops of gemm_abt
  std::vector<Acc> S(NK / 8, Acc{});
  for (int kk = 0; kk < HS / 16; ++kk) {
    std::array<std::array<int, 2>, 32> aa{}, ba{};
    for (int lane = 0; lane < 32; ++lane) aa[size_t(lane)] = {r0 + fr::a_row(lane), kk * 16 + fr::a_col(lane)};
    const Lanes4 a = ldmatrix_x4(Q, aa, false);
    for (int nn = 0; nn < NK / 16; ++nn) {
      for (int lane = 0; lane < 32; ++lane)
        ba[size_t(lane)] = {nn * 16 + fr::bt_row(lane), kk * 16 + fr::bt_col(lane)};
      const Lanes4 b = ldmatrix_x4(K, ba, false);
      mma(S[size_t(2 * nn)], a, b, 0);
      mma(S[size_t(2 * nn + 1)], a, b, 2);
    }
  }
  std::vector<std::vector<float>> Sref(16, std::vector<float>(NK));
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < NK; ++j) {
      float s = 0;
      for (int x = 0; x < HS; ++x) s += Q.at(r0 + i, x) * K.at(j, x);
      Sref[size_t(i)][size_t(j)] = s;
    }
  int bad = 0;
  for (int n = 0; n < NK / 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e)
        bad += S[size_t(n)][size_t(lane)][size_t(e)] !=
               Sref[size_t(fr::c_row(lane, e))][size_t(n * 8 + fr::c_col(lane, e))];
  CHECK(bad == 0);

  // O (16 x HS) = S V with S straight from the accumulators, the loops of gemm_pb
  std::vector<Acc> O(HS / 8, Acc{});
  for (int kk = 0; kk < NK / 16; ++kk) {
    Lanes4 a{};
    for (int lane = 0; lane < 32; ++lane)
      for (int r = 0; r < 4; ++r) {
        const Acc& t = S[size_t(2 * kk + fr::a_from_c_tile(r))];
        const int e = fr::a_from_c_elem(r);
        a[size_t(lane)][size_t(r)] = {t[size_t(lane)][size_t(e)], t[size_t(lane)][size_t(e + 1)]};
      }
    for (int dn = 0; dn < HS / 16; ++dn) {
      std::array<std::array<int, 2>, 32> ba{};
      for (int lane = 0; lane < 32; ++lane)
        ba[size_t(lane)] = {kk * 16 + fr::b_row(lane), dn * 16 + fr::b_col(lane)};
      const Lanes4 b = ldmatrix_x4(V, ba, true);
      mma(O[size_t(2 * dn)], a, b, 0);
      mma(O[size_t(2 * dn + 1)], a, b, 2);
    }
  }
  bad = 0;
  for (int n = 0; n < HS / 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const int i = fr::c_row(lane, e), x = n * 8 + fr::c_col(lane, e);
        float o = 0;
        for (int j = 0; j < NK; ++j) o += Sref[size_t(i)][size_t(j)] * V.at(j, x);
        bad += O[size_t(n)][size_t(lane)][size_t(e)] != o;
      }
  CHECK(bad == 0);
}

}  // TEST_SUITE("unit")

// Flash attention (causal, bf16/f16, head size 16/32/64/128) on tensor cores, written for
// dtrain after the FlashAttention-2 algorithm (Dao, 2023): the [T,T] score matrix never
// leaves the chip.
//
// Tiles: 64 queries x 64 keys; a block has 4 warps, each owning 16 rows of the block's
// tile (queries in the forward and dQ kernels, keys in the dK/dV kernel). Q/K/V/dO tiles
// are staged in shared memory with cp.async (rows padded by 16 bytes so ldmatrix is free of
// bank conflicts; rows >= T are zero-filled), the tile the loop reads next is loaded while
// the current one is used (two buffers). Products are mma.sync m16n8k16 with f32
// accumulators; a probability tile goes from the accumulator registers straight into the
// A operand of the next product (flash_frag.h). Scores use the log2 domain:
// s2 = q.k * scale * log2(e), p = exp2(s2 - m).
//
// Grouped-query attention (GQA/MQA): H query heads share Hkv key/value heads, query head h
// reading key/value head h / (H / Hkv); qkv rows are [q (H heads) | k (Hkv) | v (Hkv)].
//
//  forward  block (query tile, head, batch), key tiles 0..diagonal: online softmax with a
//           running max m and sum l per row, O rescaled in registers; writes out and the
//           natural-log LSE = (m + log2 l) * ln 2.
//  dsum     one warp per (b, t, h): D = sum dO * O (f32).
//  dK, dV   block (key tile, key/value head, batch), for each of the head's query heads in
//           order, query tiles diagonal..end: recomputes
//           S^T = K Q^T and P^T = exp(S^T scale - LSE), dP^T = V dO^T, dS^T = P^T (dP^T - D);
//           dV += P^T dO, dK += dS^T Q (times scale at the end).
//  dQ       block (query tile, head, batch), key tiles 0..diagonal: dQ += dS K * scale.
// No atomics: each output element is summed by one thread in loop order (deterministic).
// Needs sm_80+ (cp.async, ldmatrix, bf16 mma); the backend checks the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/flash_attn.h"
#include "backend/cuda/flash_frag.h"
#include "backend/cuda/flash_ptx.cuh"

namespace dtrain::cuda_kernels {
namespace {
using namespace flash_ptx;

constexpr int kTile = kFlashTile;          // rows of a query or key tile
constexpr int kWarps = kTile / 16;         // one warp per 16 rows
constexpr int kBlock = kWarps * 32;        // threads per block
constexpr int kNT = kTile / 8;             // n8 accumulator tiles across a 64-wide tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A [kTile, HS] 16-bit tile in shared memory, row stride HS + 8 elements: the 8 rows an
// ldmatrix phase reads then start 16 bytes apart modulo 128 (distinct bank groups).
template <int HS>
struct Tile {
  static constexpr int kLd = HS + 8;
  static constexpr int kElems = kTile * kLd;
  static constexpr int kBytes = kElems * 2;
};

// Two floats rounded to T, packed lo | hi << 16 (lo = the element with the smaller index).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t u;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&u, &v, 4);
  }
  return u;
}
template <typename T>
__device__ __forceinline__ void store2(uint16_t* p, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(p) = pack2<T>(lo, hi);
}

// ---- fragments from shared-memory tiles (formulas: flash_frag.h) ----
template <int LD>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const uint16_t* s, int r0, int c0,
                                       int lane) {
  ldsm_x4(a, s + (r0 + frag::a_row(lane)) * LD + c0 + frag::a_col(lane));
}
// B for n8 tiles n0, n0+8 over k0..k0+15 from a [n][k] tile: {b[0],b[1]}, {b[2],b[3]}.
template <int LD>
__device__ __forceinline__ void load_bt(uint32_t (&b)[4], const uint16_t* s, int n0, int k0,
                                        int lane) {
  ldsm_x4(b, s + (n0 + frag::bt_row(lane)) * LD + k0 + frag::bt_col(lane));
}
// The same from a [k][n] tile.
template <int LD>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const uint16_t* s, int k0, int n0,
                                       int lane) {
  ldsm_x4<true>(b, s + (k0 + frag::b_row(lane)) * LD + n0 + frag::b_col(lane));
}
// Columns 16kk..16kk+15 of a 16 x kTile accumulator as an A operand (rounded to T).
template <typename T>
__device__ __forceinline__ void a_from_acc(uint32_t (&a)[4], const float (&acc)[kNT][4], int kk) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int n = 2 * kk + frag::a_from_c_tile(r), e = frag::a_from_c_elem(r);
    a[r] = pack2<T>(acc[n][e], acc[n][e + 1]);
  }
}

// acc[kNT][4] (16 rows x kTile cols) += A (16 rows r0.. of tile `sa`, all HS columns) times
// the transpose of tile `sb` ([kTile][HS]): S = Q K^T and its relatives.
template <typename T, int HS>
__device__ __forceinline__ void gemm_abt(float (&acc)[kNT][4], const uint16_t* sa, int r0,
                                         const uint16_t* sb, int lane) {
  constexpr int LD = Tile<HS>::kLd;
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk) {
    uint32_t a[4];
    load_a<LD>(a, sa, r0, kk * 16, lane);
#pragma unroll
    for (int nn = 0; nn < kTile / 16; ++nn) {
      uint32_t b[4];
      load_bt<LD>(b, sb, nn * 16, kk * 16, lane);
      mma<T>(acc[2 * nn], a, b[0], b[1]);
      mma<T>(acc[2 * nn + 1], a, b[2], b[3]);
    }
  }
}

// out[HS/8][4] (16 x HS) += P (16 x kTile, accumulator registers) times tile `sb` ([kTile][HS]).
template <typename T, int HS>
__device__ __forceinline__ void gemm_pb(float (&out)[HS / 8][4], const float (&p)[kNT][4],
                                        const uint16_t* sb, int lane) {
  constexpr int LD = Tile<HS>::kLd;
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    uint32_t a[4];
    a_from_acc<T>(a, p, kk);
#pragma unroll
    for (int dn = 0; dn < HS / 16; ++dn) {
      uint32_t b[4];
      load_b<LD>(b, sb, kk * 16, dn * 16, lane);
      mma<T>(out[2 * dn], a, b[0], b[1]);
      mma<T>(out[2 * dn + 1], a, b[2], b[3]);
    }
  }
}

// Rows row0..row0+kTile-1 (columns 0..HS-1) of a matrix at g with row stride ld elements
// into tile s (cp.async, not yet committed); rows >= nrows become zeros.
template <int HS>
__device__ __forceinline__ void load_tile(uint16_t* s, const uint16_t* g, int64_t ld, int row0,
                                          int nrows) {
  constexpr int kChunks = HS / 8;  // 16-byte chunks per row
#pragma unroll
  for (int c = threadIdx.x; c < kTile * kChunks; c += kBlock) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = row0 + r < nrows;
    const uint16_t* src = g + (ok ? int64_t(row0 + r) * ld : int64_t(0)) + ch * 8;
    cp_async<16>(s + r * Tile<HS>::kLd + ch * 8, src, ok ? 16 : 0);
  }
}

__device__ __forceinline__ float shfl_quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float shfl_quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// A query-tile block (the forward and dQ grids: (H, B, query tiles), heaviest (last) query
// tiles first): lane, the warp's first row rw, query tile q0, head h, batch b, C and the
// qkv row stride ld, head h's Q columns and its key/value head's K, V columns, and the key
// tiles 0..diagonal (n_kt).
struct QueryBlock {
  int lane, rw, q0, h, b;
  int64_t C, ld;
  const uint16_t *Q, *K, *V;
  int n_kt;
};
template <int HS>
__device__ __forceinline__ QueryBlock query_block(const uint16_t* qkv, int T_, int H, int Hkv) {
  const int q0 = (int(gridDim.z) - 1 - int(blockIdx.z)) * kTile, h = blockIdx.x, b = blockIdx.y;
  const int64_t C = int64_t(H) * HS, ld = C + 2 * int64_t(Hkv) * HS;
  const uint16_t* row = qkv + int64_t(b) * T_ * ld;
  const uint16_t* K = row + C + int64_t(h / (H / Hkv)) * HS;
  return {int(threadIdx.x & 31), int(threadIdx.x >> 5) * 16, q0, h, b, C, ld, row + int64_t(h) * HS, K,
          K + int64_t(Hkv) * HS, (min(q0 + kTile, T_) - 1) / kTile + 1};
}

// Waits for key tile kt (buffer kt & 1) and starts loading tile kt + 1 of K and V into the
// other buffer.
template <int HS>
__device__ __forceinline__ void next_kv_tile(uint16_t* sK, uint16_t* sV, const uint16_t* K,
                                             const uint16_t* V, int64_t ld, int kt, int n_kt,
                                             int T_) {
  const int buf = kt & 1;
  cp_async_wait_all();
  __syncthreads();  // tile kt visible; every warp is done with buffer buf ^ 1
  if (kt + 1 < n_kt) {
    load_tile<HS>(sK + (buf ^ 1) * Tile<HS>::kElems, K, ld, (kt + 1) * kTile, T_);
    load_tile<HS>(sV + (buf ^ 1) * Tile<HS>::kElems, V, ld, (kt + 1) * kTile, T_);
    cp_async_commit();
  }
}

// The first key query i of row b sees: its document's first token, i - docpos[b,i], with
// packed documents (docpos not null; Backend::attention_fwd's doc_pos), else 0 (rows >= T: 0).
__device__ __forceinline__ int first_key(const int32_t* docpos, int b, int i, int T_) {
  return docpos && i < T_ ? i - docpos[int64_t(b) * T_ + i] : 0;
}

// ---------------------------------------------------------------- forward
// Grid (H, B, query tiles), heaviest (last) query tiles first. Shared: Q, K[2], V[2].
template <typename T, int HS>
__global__ void __launch_bounds__(kBlock)
    flash_fwd_k(const uint16_t* qkv, uint16_t* out, float* lse, const int32_t* docpos, int T_, int H, int Hkv,
                float scale2) {
  using Tl = Tile<HS>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sK = sQ + Tl::kElems;
  uint16_t* sV = sK + 2 * Tl::kElems;
  const auto [lane, rw, q0, h, b, C, ld, Q, K, V, n_kt] = query_block<HS>(qkv, T_, H, Hkv);

  load_tile<HS>(sQ, Q, ld, q0, T_);
  load_tile<HS>(sK, K, ld, 0, T_);
  load_tile<HS>(sV, V, ld, 0, T_);
  cp_async_commit();

  float o[HS / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows i0, i0 + 8 (log2 domain)
  const int i0 = q0 + rw + frag::c_row(lane, 0);
  int lo[2];  // rows i0, i0 + 8: the first key of their document
#pragma unroll
  for (int r = 0; r < 2; ++r) lo[r] = first_key(docpos, b, i0 + 8 * r, T_);
  for (int kt = 0; kt < n_kt; ++kt) {
    const int buf = kt & 1;
    next_kv_tile<HS>(sK, sV, K, V, ld, kt, n_kt, T_);
    const int k0 = kt * kTile;
    float s[kNT][4] = {};
    gemm_abt<T, HS>(s, sQ, rw, sK + buf * Tl::kElems, lane);
    const bool diag = k0 + kTile - 1 > q0;  // some key > some query: mask j > i
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = q0 + rw + frag::c_row(lane, e), j = k0 + n * 8 + frag::c_col(lane, e);
        s[n][e] = ((diag && j > i) || j < lo[e >> 1]) ? -INFINITY : s[n][e] * scale2;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // elements 2r, 2r+1 of every n8 tile are row i0 + 8r
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kNT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = shfl_quad_max(mx);
      const float m_new = fmaxf(m[r], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // row fully masked so far
      const float alpha = exp2f(m[r] - m_use);
      m[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[n][e] = exp2f(s[n][e] - m_use);
          sum += s[n][e];
        }
      l[r] = l[r] * alpha + sum;  // this lane's columns; the quad is summed at the end
#pragma unroll
      for (int dn = 0; dn < HS / 8; ++dn) o[dn][2 * r] *= alpha, o[dn][2 * r + 1] *= alpha;
    }
    gemm_pb<T, HS>(o, s, sV + buf * Tl::kElems, lane);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lt = shfl_quad_sum(l[r]);
    const int i = i0 + 8 * r;
    if (i < T_) {
      const float inv = 1.f / lt;
      uint16_t* orow = out + (int64_t(b) * T_ + i) * C + int64_t(h) * HS + frag::c_col(lane, 0);
#pragma unroll
      for (int dn = 0; dn < HS / 8; ++dn)
        store2<T>(orow + dn * 8, o[dn][2 * r] * inv, o[dn][2 * r + 1] * inv);
      if ((lane & 3) == 0) lse[(int64_t(b) * H + h) * T_ + i] = (m[r] + log2f(lt)) * kLn2;
    }
  }
}

// ---------------------------------------------------------------- backward
// dsum[(b*H + h)*T + t] = dout . out over the head's hs columns; one warp per (b, t, h).
template <typename T>
__global__ void flash_dsum_k(const T* dout, const T* out, float* dsum, int64_t rows, int T_,
                             int H, int hs) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (r >= rows) return;  // r is uniform over the warp
  const int lane = threadIdx.x & 31, h = int(r % H);
  const int64_t bt = r / H, off = bt * H * hs + int64_t(h) * hs;
  float acc = 0.f;
  for (int j = lane; j < hs; j += 32) acc += to_f(dout[off + j]) * to_f(out[off + j]);
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, w);
  if (lane == 0) dsum[(bt / T_ * H + h) * T_ + bt % T_] = acc;
}

// Query tile qt of Q and dO into a buffer, with its rows' LSE and D (zeros for rows >= T).
template <int HS>
__device__ __forceinline__ void load_query_tile(uint16_t* sQ, uint16_t* sO, float* sL, float* sD,
                                                const uint16_t* Q, const uint16_t* dO,
                                                const float* L, const float* D, int64_t ld,
                                                int64_t C, int qt, int T_) {
  static_assert(kBlock == 2 * kTile, "one thread per LSE and per D value");
  load_tile<HS>(sQ, Q, ld, qt * kTile, T_);
  load_tile<HS>(sO, dO, C, qt * kTile, T_);
  const int x = threadIdx.x % kTile, i = qt * kTile + x;
  const bool ok = i < T_;
  if (threadIdx.x < kTile) cp_async<4>(sL + x, L + (ok ? i : 0), ok ? 4 : 0);
  else cp_async<4>(sD + x, D + (ok ? i : 0), ok ? 4 : 0);
}

// Grid (Hkv, B, key tiles), heaviest (first) key tiles first. Shared: K, V, Q[2], dO[2], then f32 LSE[2][kTile], D[2][kTile].
// Accumulators are transposed (rows = this warp's 16 keys, columns = a tile's queries). The
// loop runs over (query head of the group, query tile) pairs, heads in order, so a key/value
// head's gradient sums its query heads' in a fixed order (one head: the tiles alone).
template <typename T, int HS>
__global__ void __launch_bounds__(kBlock)
    flash_bwd_dkdv_k(const uint16_t* dout, const uint16_t* qkv, const float* lse,
                     const float* dsum, const int32_t* docpos, uint16_t* dqkv, int T_, int H, int Hkv,
                     float scale2, float scale) {
  using Tl = Tile<HS>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sV = sK + Tl::kElems;
  uint16_t* sQ = sV + Tl::kElems;
  uint16_t* sO = sQ + 2 * Tl::kElems;
  float* sL = reinterpret_cast<float*>(sO + 2 * Tl::kElems);
  float* sD = sL + 2 * kTile;
  const int lane = threadIdx.x & 31, rw = (threadIdx.x >> 5) * 16;
  const int k0 = int(blockIdx.z) * kTile, kv = blockIdx.x, b = blockIdx.y, g = H / Hkv;
  const int64_t C = int64_t(H) * HS, ld = C + 2 * int64_t(Hkv) * HS;
  const uint16_t* row0 = qkv + int64_t(b) * T_ * ld;
  const int qt0 = k0 / kTile, n_qt = (T_ + kTile - 1) / kTile;  // query tiles diagonal..end
  const int nq = n_qt - qt0, n_it = g * nq;                      // (group head, query tile) pairs
  // iteration `it`'s query tile of head kv*g + it/nq into buffer `to`
  auto load_it = [&](int it, int to) {
    const int h = kv * g + it / nq;
    load_query_tile<HS>(sQ + to * Tl::kElems, sO + to * Tl::kElems, sL + to * kTile, sD + to * kTile,
                        row0 + int64_t(h) * HS, dout + int64_t(b) * T_ * C + int64_t(h) * HS,
                        lse + (int64_t(b) * H + h) * T_, dsum + (int64_t(b) * H + h) * T_, ld, C, qt0 + it % nq, T_);
  };

  load_tile<HS>(sK, row0 + C + int64_t(kv) * HS, ld, k0, T_);
  load_tile<HS>(sV, row0 + C + int64_t(Hkv + kv) * HS, ld, k0, T_);
  load_it(0, 0);
  cp_async_commit();

  float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
  for (int it = 0; it < n_it; ++it) {
    const int qt = qt0 + it % nq;
    const int buf = it & 1, nb = buf ^ 1;
    cp_async_wait_all();
    __syncthreads();  // tile `it` visible; every warp is done with buffer nb
    if (it + 1 < n_it) {
      load_it(it + 1, nb);
      cp_async_commit();
    }
    const uint16_t* q_s = sQ + buf * Tl::kElems;
    const uint16_t* o_s = sO + buf * Tl::kElems;
    const float* l_s = sL + buf * kTile;
    const float* d_s = sD + buf * kTile;
    const int q0 = qt * kTile;
    float st[kNT][4] = {}, dpt[kNT][4] = {};
    gemm_abt<T, HS>(st, sK, rw, q_s, lane);   // S^T = K Q^T
    gemm_abt<T, HS>(dpt, sV, rw, o_s, lane);  // dP^T = V dO^T
    const bool edge = k0 + kTile - 1 > q0 || q0 + kTile > T_;  // causal mask or rows >= T
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int x = n * 8 + frag::c_col(lane, e);          // query within the tile
        const int i = q0 + x, j = k0 + rw + frag::c_row(lane, e);  // query, key
        float p = exp2f(st[n][e] * scale2 - l_s[x] * kLog2e);
        if ((edge && (j > i || i >= T_)) || j < first_key(docpos, b, i, T_)) p = 0.f;
        dpt[n][e] = p * (dpt[n][e] - d_s[x]);  // dS^T
        st[n][e] = p;                          // P^T
      }
    gemm_pb<T, HS>(dv, st, o_s, lane);   // dV += P^T dO
    gemm_pb<T, HS>(dk, dpt, q_s, lane);  // dK += dS^T Q
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = k0 + rw + frag::c_row(lane, 2 * r);
    if (j >= T_) continue;
    uint16_t* row = dqkv + (int64_t(b) * T_ + j) * ld + C + int64_t(kv) * HS + frag::c_col(lane, 0);
#pragma unroll
    for (int dn = 0; dn < HS / 8; ++dn) {
      store2<T>(row + dn * 8, dk[dn][2 * r] * scale, dk[dn][2 * r + 1] * scale);
      store2<T>(row + int64_t(Hkv) * HS + dn * 8, dv[dn][2 * r], dv[dn][2 * r + 1]);
    }
  }
}

// Grid (H, B, query tiles), heaviest (last) query tiles first. Shared: Q, dO, K[2], V[2].
template <typename T, int HS>
__global__ void __launch_bounds__(kBlock)
    flash_bwd_dq_k(const uint16_t* dout, const uint16_t* qkv, const float* lse, const float* dsum,
                   const int32_t* docpos, uint16_t* dqkv, int T_, int H, int Hkv, float scale2, float scale) {
  using Tl = Tile<HS>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sO = sQ + Tl::kElems;
  uint16_t* sK = sO + Tl::kElems;
  uint16_t* sV = sK + 2 * Tl::kElems;
  const auto [lane, rw, q0, h, b, C, ld, Q, K, V, n_kt] = query_block<HS>(qkv, T_, H, Hkv);
  const int64_t stat = (int64_t(b) * H + h) * T_;

  load_tile<HS>(sQ, Q, ld, q0, T_);
  load_tile<HS>(sO, dout + int64_t(b) * T_ * C + int64_t(h) * HS, C, q0, T_);
  load_tile<HS>(sK, K, ld, 0, T_);
  load_tile<HS>(sV, V, ld, 0, T_);
  cp_async_commit();

  const int i0 = q0 + rw + frag::c_row(lane, 0);
  float lrow[2], drow[2];  // rows i0, i0 + 8: LSE in log2 units, D
  int lo[2];               // and the first key of their document
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + 8 * r;
    lrow[r] = i < T_ ? lse[stat + i] * kLog2e : 0.f;
    drow[r] = i < T_ ? dsum[stat + i] : 0.f;
    lo[r] = first_key(docpos, b, i, T_);
  }
  float dq[HS / 8][4] = {};
  for (int kt = 0; kt < n_kt; ++kt) {
    const int buf = kt & 1;
    next_kv_tile<HS>(sK, sV, K, V, ld, kt, n_kt, T_);
    const uint16_t* k_s = sK + buf * Tl::kElems;
    const int k0 = kt * kTile;
    float s[kNT][4] = {}, dp[kNT][4] = {};
    gemm_abt<T, HS>(s, sQ, rw, k_s, lane);                    // S = Q K^T
    gemm_abt<T, HS>(dp, sO, rw, sV + buf * Tl::kElems, lane);  // dP = dO V^T
    const bool diag = k0 + kTile - 1 > q0;
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + (e >> 1) * 8, j = k0 + n * 8 + frag::c_col(lane, e);
        float p = exp2f(s[n][e] * scale2 - lrow[e >> 1]);
        if ((diag && j > i) || j < lo[e >> 1]) p = 0.f;
        s[n][e] = p * (dp[n][e] - drow[e >> 1]);  // dS
      }
    gemm_pb<T, HS>(dq, s, k_s, lane);  // dQ += dS K
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + 8 * r;
    if (i >= T_) continue;
    uint16_t* row = dqkv + (int64_t(b) * T_ + i) * ld + int64_t(h) * HS + frag::c_col(lane, 0);
#pragma unroll
    for (int dn = 0; dn < HS / 8; ++dn)
      store2<T>(row + dn * 8, dq[dn][2 * r] * scale, dq[dn][2 * r + 1] * scale);
  }
}

// ---------------------------------------------------------------- launch helpers
// Calls f(T{}, std::integral_constant<int, HS>{}) for a supported (dtype, head size).
template <typename F>
void dispatch_flash(DType t, int64_t hs, F&& f) {
  auto by_hs = [&](auto tag) {
    switch (hs) {
      case 16: f(tag, std::integral_constant<int, 16>{}); break;
      case 32: f(tag, std::integral_constant<int, 32>{}); break;
      case 64: f(tag, std::integral_constant<int, 64>{}); break;
      case 128: f(tag, std::integral_constant<int, 128>{}); break;
      default: break;  // callers check flash_attn_supported first
    }
  };
  if (t == DType::BF16) by_hs(__nv_bfloat16{});
  else if (t == DType::F16) by_hs(__half{});
}

// Opts the kernel into more than 48 KiB of dynamic shared memory when it needs it (an
// error surfaces through cudaGetLastError, which the caller checks after the launch).
template <typename K>
void allow_smem(K kernel, int bytes) {
  if (bytes > 48 * 1024)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// Tiles in z, the slowest dimension the hardware hands out blocks in: every (head, sample)'s
// heaviest tiles start first, and the short diagonal-only tiles fill the end.
dim3 tile_grid(int64_t B, int64_t T, int64_t H) {
  return dim3(unsigned(H), unsigned(B), unsigned((T + kTile - 1) / kTile));
}

float scale_of(int64_t hs) { return 1.f / sqrtf(float(hs)); }

}  // namespace

bool flash_attn_supported(DType t, int64_t hs) {
  return (t == DType::BF16 || t == DType::F16) && (hs == 16 || hs == 32 || hs == 64 || hs == 128);
}

void flash_attn_fwd(const void* qkv, void* out, float* lse, const int32_t* docpos, DType t, int64_t B,
                    int64_t T, int64_t H, int64_t Hkv, int64_t hs, cudaStream_t s) {
  if (B * T == 0) return;
  dispatch_flash(t, hs, [&](auto tag, auto hs_c) {
    using E = decltype(tag);
    constexpr int HS = decltype(hs_c)::value;
    constexpr int smem = 5 * Tile<HS>::kBytes;
    allow_smem(flash_fwd_k<E, HS>, smem);
    flash_fwd_k<E, HS><<<tile_grid(B, T, H), kBlock, smem, s>>>(
        static_cast<const uint16_t*>(qkv), static_cast<uint16_t*>(out), lse, docpos, int(T), int(H), int(Hkv),
        scale_of(hs) * kLog2e);
  });
}

void flash_attn_bwd_dsum(const void* dout, const void* out, float* dsum, DType t, int64_t B,
                         int64_t T, int64_t H, int64_t hs, cudaStream_t s) {
  const int64_t rows = B * T * H;
  if (rows == 0) return;
  constexpr int kWarpsPerBlock = 8;
  const unsigned grid = unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch_flash(t, hs, [&](auto tag, auto) {
    using E = decltype(tag);
    flash_dsum_k<E><<<grid, kWarpsPerBlock * 32, 0, s>>>(static_cast<const E*>(dout),
                                                        static_cast<const E*>(out), dsum, rows,
                                                        int(T), int(H), int(hs));
  });
}

namespace {
// The dK/dV kernel (DQ false) or the dQ kernel (DQ true): same arguments, grid and block.
// The dQ grid has a block per query head, the dK/dV grid one per key/value head.
template <bool DQ>
void flash_bwd(const void* dout, const void* qkv, const float* lse, const float* dsum, const int32_t* docpos,
               void* dqkv, DType t, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t hs, cudaStream_t s) {
  if (B * T == 0) return;
  dispatch_flash(t, hs, [&](auto tag, auto hs_c) {
    using E = decltype(tag);
    constexpr int HS = decltype(hs_c)::value;
    constexpr int smem = 6 * Tile<HS>::kBytes + (DQ ? 0 : 4 * kTile * int(sizeof(float)));
    const auto kernel = DQ ? &flash_bwd_dq_k<E, HS> : &flash_bwd_dkdv_k<E, HS>;
    allow_smem(kernel, smem);
    kernel<<<tile_grid(B, T, DQ ? H : Hkv), kBlock, smem, s>>>(
        static_cast<const uint16_t*>(dout), static_cast<const uint16_t*>(qkv), lse, dsum, docpos,
        static_cast<uint16_t*>(dqkv), int(T), int(H), int(Hkv), scale_of(hs) * kLog2e, scale_of(hs));
  });
}
}  // namespace

void flash_attn_bwd_dkdv(const void* dout, const void* qkv, const float* lse, const float* dsum,
                         const int32_t* docpos, void* dqkv, DType t, int64_t B, int64_t T, int64_t H,
                         int64_t Hkv, int64_t hs, cudaStream_t s) {
  flash_bwd<false>(dout, qkv, lse, dsum, docpos, dqkv, t, B, T, H, Hkv, hs, s);
}

void flash_attn_bwd_dq(const void* dout, const void* qkv, const float* lse, const float* dsum,
                       const int32_t* docpos, void* dqkv, DType t, int64_t B, int64_t T, int64_t H,
                       int64_t Hkv, int64_t hs, cudaStream_t s) {
  flash_bwd<true>(dout, qkv, lse, dsum, docpos, dqkv, t, B, T, H, Hkv, hs, s);
}

}  // namespace dtrain::cuda_kernels

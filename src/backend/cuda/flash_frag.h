#pragma once
// Fragment geometry of the warp-level tensor-core instructions the flash attention kernels
// use (PTX ISA: ldmatrix.m8n8.x4.b16 and mma.m16n8k16 with 16-bit inputs, f32 accumulators).
// Host and device code share these formulas, so a CPU unit test (test_flash_frag.cpp)
// can emulate the instructions as the PTX ISA documents them and check that the
// compositions the kernels build (A and B operands from shared memory, P as an A operand
// straight from an accumulator) compute the right products.
//
// Documented layouts, with g = lane / 4 and q = lane % 4:
//  * mma A (16x16, row-major): reg 0 = (g, 2q..2q+1), reg 1 = (g+8, 2q..), reg 2 =
//    (g, 2q+8..), reg 3 = (g+8, 2q+8..); B (16x8, k x n): reg 0 = (k 2q..2q+1, n g),
//    reg 1 = (k 2q+8.., n g); C/D (16x8 f32): c0,c1 = (g, 2q..2q+1), c2,c3 = (g+8, 2q..).
//    The lower half of a 32-bit register holds the element with the smaller index.
//  * ldmatrix.x4: lanes 8m..8m+7 give the addresses of rows 0..7 of matrix m (16 bytes
//    each); register m of a lane receives row g, columns 2q..2q+1 of matrix m (with .trans:
//    rows 2q..2q+1 of column g).
#if defined(__CUDACC__)
#define DTRAIN_HD __host__ __device__ __forceinline__
#else
#define DTRAIN_HD inline
#endif

namespace dtrain::cuda_kernels::frag {

// A operand (rows r0..r0+15, cols c0..c0+15 of a row-major tile) with one ldmatrix.x4:
// matrix 0 = rows 0-7 / cols 0-7, 1 = rows 8-15 / cols 0-7, 2 = rows 0-7 / cols 8-15,
// 3 = rows 8-15 / cols 8-15; registers 0..3 are then exactly A's regs 0..3.
DTRAIN_HD int a_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
DTRAIN_HD int a_col(int lane) { return (lane >> 4) * 8; }

// B operands of two n8 tiles (n0..n0+7 and n0+8..n0+15) over k0..k0+15, from a tile that
// stores B transposed (row = n, col = k; e.g. K [key][d] for S = Q K^T), no .trans:
// matrix 0 = n 0-7 / k 0-7, 1 = n 0-7 / k 8-15, 2 = n 8-15 / k 0-7, 3 = n 8-15 / k 8-15;
// registers {0,1} are B of the first n8 tile, {2,3} of the second.
DTRAIN_HD int bt_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }       // n
DTRAIN_HD int bt_col(int lane) { return ((lane >> 3) & 1) * 8; }              // k

// The same two B operands from a tile that stores B as is (row = k, col = n; e.g. V
// [key][d] for O = P V), with .trans: matrix 0 = k 0-7 / n 0-7, 1 = k 8-15 / n 0-7,
// 2 = k 0-7 / n 8-15, 3 = k 8-15 / n 8-15; registers {0,1} first n8 tile, {2,3} second.
DTRAIN_HD int b_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }  // k
DTRAIN_HD int b_col(int lane) { return (lane >> 4) * 8; }                     // n

// Accumulator element e (0..3) of a lane in a 16x8 tile.
DTRAIN_HD int c_row(int lane, int e) { return (lane >> 2) + (e >> 1) * 8; }
DTRAIN_HD int c_col(int lane, int e) { return (lane & 3) * 2 + (e & 1); }

// A 16x16 block of a 16xN accumulator (n8 tiles acc[2kk], acc[2kk+1]) as an A operand:
// register r packs elements (lo, hi) = acc[2kk + r/2][2*(r%2)], acc[..][2*(r%2) + 1].
DTRAIN_HD int a_from_c_tile(int r) { return r >> 1; }     // 0: acc[2kk], 1: acc[2kk+1]
DTRAIN_HD int a_from_c_elem(int r) { return (r & 1) * 2; }  // first of the pair (lo)

}  // namespace dtrain::cuda_kernels::frag

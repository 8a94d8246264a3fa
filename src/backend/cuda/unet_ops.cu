// U-Net kernels: bilinear x2 upsampling (align_corners=False; backward as a gather, no
// atomics), channel concat/split as strided row copies (16-byte units where the channel
// counts allow), softmax soft-Dice with fixed-order reductions (per-block partials in
// double, summed in a fixed order).
#include <type_traits>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/unet_kernels.h"
#include "backend/unet_geom.h"

namespace dtrain::cuda_kernels {
namespace {

// x [N,H,W,C] -> y [N,2H,2W,C]
template <typename T>
__global__ void up2x_fwd_k(const T* x, T* y, int N, int H, int W, int C) {
  const int OH = 2 * H, OW = 2 * W;
  int64_t total = int64_t(N) * OH * OW * C;
  DTRAIN_GRID_STRIDE(i, total) {
    const NhwcIdx o = nhwc_index(i, OH, OW, C);
    unet::Taps th = unet::up2x_taps(o.h, H), tw = unet::up2x_taps(o.w, W);
    auto at = [&](int h, int w) { return to_f(x[((int64_t(o.n) * H + h) * W + w) * C + o.c]); };
    float v = th.w0 * (tw.w0 * at(th.i0, tw.i0) + tw.w1 * at(th.i0, tw.i1)) +
              th.w1 * (tw.w0 * at(th.i1, tw.i0) + tw.w1 * at(th.i1, tw.i1));
    y[i] = from_f<T>(v);
  }
}

// dy [N,2H,2W,C] -> dx [N,H,W,C]
template <typename T>
__global__ void up2x_bwd_k(const T* dy, T* dx, int N, int H, int W, int C) {
  const int OH = 2 * H, OW = 2 * W;
  int64_t total = int64_t(N) * H * W * C;
  DTRAIN_GRID_STRIDE(i, total) {
    const auto [n, h, w, c] = nhwc_index(i, H, W, C);
    float acc = 0.f;
    for (int oh = unet::up2x_first(h); oh <= unet::up2x_last(h, H); ++oh) {
      float wh = unet::up2x_weight(oh, h, H);
      if (wh == 0.f) continue;
      for (int ow = unet::up2x_first(w); ow <= unet::up2x_last(w, W); ++ow) {
        float ww = unet::up2x_weight(ow, w, W);
        if (ww == 0.f) continue;
        acc += wh * ww * to_f(dy[((int64_t(n) * OH + oh) * OW + ow) * C + c]);
      }
    }
    dx[i] = from_f<T>(acc);
  }
}

// Strided copy of column ranges, in units U of 16, 8, 4, 2 or 1 bytes (the largest that
// divides every pointer, stride, column offset and width):
//   dst[r, dcol0 + j] = src[r, scol0 + j]   r < rows, j < width (all in units)
// One thread per unit; I is uint32_t when the larger tensor has < 2^31 units.
template <typename U, typename I>
__global__ void copy_cols_k(const U* src, int64_t sstride, int64_t scol0, U* dst, int64_t dstride,
                            int64_t dcol0, int64_t rows, int64_t width) {
  const I w = I(width), total = I(rows) * w;
  DTRAIN_GRID_STRIDE_T(I, i, total) {
    const I r = i / w, j = i - r * w;
    dst[int64_t(r) * dstride + dcol0 + int64_t(j)] = src[int64_t(r) * sstride + scol0 + int64_t(j)];
  }
}

// Byte-level arguments; picks the unit and the index type.
void copy_cols(const void* src, int64_t sstride, int64_t scol0, void* dst, int64_t dstride,
               int64_t dcol0, int64_t rows, int64_t width, cudaStream_t s) {
  if (rows <= 0 || width <= 0) return;
  const uint64_t bits = uint64_t(reinterpret_cast<uintptr_t>(src)) |
                        uint64_t(reinterpret_cast<uintptr_t>(dst)) | uint64_t(sstride) |
                        uint64_t(scol0) | uint64_t(dstride) | uint64_t(dcol0) | uint64_t(width);
  auto run = [&](auto unit) {
    using U = decltype(unit);
    const int64_t u = int64_t(sizeof(U));
    const int64_t big = rows * (sstride > dstride ? sstride : dstride) / u;
    const unsigned grid = grid_waves(rows * (width / u));
    const U* sp = static_cast<const U*>(src);
    U* dp = static_cast<U*>(dst);
    if (big < (int64_t(1) << 31))
      copy_cols_k<U, uint32_t><<<grid, kThreads, 0, s>>>(sp, sstride / u, scol0 / u, dp,
                                                         dstride / u, dcol0 / u, rows, width / u);
    else
      copy_cols_k<U, int64_t><<<grid, kThreads, 0, s>>>(sp, sstride / u, scol0 / u, dp,
                                                        dstride / u, dcol0 / u, rows, width / u);
  };
  if (bits % 16 == 0)
    run(uint4{});
  else if (bits % 8 == 0)
    run(uint2{});
  else if (bits % 4 == 0)
    run(uint32_t{});
  else if (bits % 2 == 0)
    run(uint16_t{});
  else
    run(uint8_t{});
}

// ---- softmax soft-Dice over P pixels of K classes ----
// Kernels templated on KMAX >= K (4, 16 or 64): per-pixel rows live in registers (loops
// unrolled to KMAX with k < K guards, no dynamic indexing) for the usual few classes.
constexpr int kDiceBlocksMax = 1024;

inline int dice_blocks(int64_t P) {
  int64_t b = (P + 4 * kThreads - 1) / (4 * kThreads);  // ~4 pixels per thread
  return int(b < 1 ? 1 : (b > kDiceBlocksMax ? kDiceBlocksMax : b));
}

// p = softmax(x[0..K)), max-subtracted: unet::softmax_row's operations in its order.
template <int KMAX>
__device__ __forceinline__ void softmax_regs(const float (&x)[KMAX], int K, float (&p)[KMAX]) {
  float m = x[0];
#pragma unroll
  for (int k = 1; k < KMAX; ++k)
    if (k < K) m = x[k] > m ? x[k] : m;
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < KMAX; ++k)
    if (k < K) {
      p[k] = expf(x[k] - m);
      s += p[k];
    }
  const float inv = 1.f / s;
#pragma unroll
  for (int k = 0; k < KMAX; ++k)
    if (k < K) p[k] *= inv;
}

// partials[block][3K]: sums of p_k, p_k*t_k, t_k over the block's pixels (grid-stride).
// logits [P,K], labels [P]. Per-thread f32 sums, then per warp a fixed xor butterfly in
// double, then warps summed in order by thread j < 3K.
template <typename T, int KMAX>
__global__ void dice_stats_k(const T* logits, int64_t P, int K, const int32_t* labels,
                             double* partials) {
  __shared__ double sh[kThreads / 32][3 * KMAX];
  float sp[KMAX], si[KMAX], st[KMAX], x[KMAX], p[KMAX];
#pragma unroll
  for (int k = 0; k < KMAX; ++k) sp[k] = si[k] = st[k] = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < P;
       i += int64_t(gridDim.x) * blockDim.x) {
#pragma unroll
    for (int k = 0; k < KMAX; ++k)
      if (k < K) x[k] = to_f(logits[i * K + k]);
    softmax_regs<KMAX>(x, K, p);
    const int y = labels[i];
#pragma unroll
    for (int k = 0; k < KMAX; ++k)
      if (k < K) {
        sp[k] += p[k];
        if (k == y) si[k] += p[k], st[k] += 1.f;
      }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < KMAX; ++k)
    if (k < K) {
      const double a = warp_sum(double(sp[k])), b = warp_sum(double(si[k])),
                   c = warp_sum(double(st[k]));
      if (lane == 0) sh[warp][k] = a, sh[warp][K + k] = b, sh[warp][2 * K + k] = c;
    }
  __syncthreads();
  for (int j = threadIdx.x; j < 3 * K; j += blockDim.x) {
    double s = 0.0;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) s += sh[w][j];
    partials[int64_t(blockIdx.x) * 3 * K + j] = s;
  }
}

// One block of kThreads: totals of the 3K columns of partials [nblocks][3K] (warp w takes
// columns w, w+8, ...; lanes stride the blocks, then a fixed butterfly), then
// coef = [A_k (K), B_k (K), loss].
__global__ void dice_coef_k(const double* partials, int nblocks, int K, float smooth,
                            float* coef) {
  __shared__ double tot[3 * kDiceMaxClasses];
  __shared__ double dice[kDiceMaxClasses];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int j = warp; j < 3 * K; j += warps) {
    double s = 0.0;
    for (int b = lane; b < nblocks; b += 32) s += partials[int64_t(b) * 3 * K + j];
    s = warp_sum(s);
    if (lane == 0) tot[j] = s;
  }
  __syncthreads();
  const int k = threadIdx.x;
  if (k < K) {
    const double sp = tot[k], I = tot[K + k], st = tot[2 * K + k];
    const double S = sp + st + smooth;
    dice[k] = (2 * I + smooth) / S;
    coef[k] = float(2.0 / S);
    coef[K + k] = float((2 * I + smooth) / (S * S));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int j = 0; j < K; ++j) s += dice[j];
    coef[2 * K] = float(1.0 - s / K);
  }
}

// dlogits [P,K] of the loss (scaled by grad_scale) from coef: one thread per pixel.
template <typename T, int KMAX>
__global__ void dice_grad_k(const T* logits, int64_t P, int K, const int32_t* labels,
                            const float* coef, float grad_scale, T* dlogits) {
  float x[KMAX], p[KMAX], A[KMAX], B[KMAX];
  const float gk = grad_scale / float(K);
#pragma unroll
  for (int k = 0; k < KMAX; ++k)
    if (k < K) A[k] = coef[k], B[k] = coef[K + k];
  DTRAIN_GRID_STRIDE(i, P) {
#pragma unroll
    for (int k = 0; k < KMAX; ++k)
      if (k < K) x[k] = to_f(logits[i * K + k]);
    softmax_regs<KMAX>(x, K, p);
    const int y = labels[i];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < KMAX; ++k)
      if (k < K) dot += p[k] * (-gk * ((k == y ? A[k] : 0.f) - B[k]));
#pragma unroll
    for (int k = 0; k < KMAX; ++k)
      if (k < K) {
        const float g = -gk * ((k == y ? A[k] : 0.f) - B[k]);
        dlogits[i * K + k] = from_f<T>(p[k] * (g - dot));
      }
  }
}

}  // namespace

void upsample2x_fwd(const void* x, void* y, DType t, int N, int H, int W, int C, cudaStream_t s) {
  int64_t total = int64_t(N) * 4 * H * W * C;
  if (total == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    up2x_fwd_k<T><<<grid_for(total), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y),
                                                       N, H, W, C);
  });
}

void upsample2x_bwd(const void* dy, void* dx, DType t, int N, int H, int W, int C, cudaStream_t s) {
  int64_t total = int64_t(N) * H * W * C;
  if (total == 0) return;
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    up2x_bwd_k<T><<<grid_for(total), kThreads, 0, s>>>(static_cast<const T*>(dy),
                                                       static_cast<T*>(dx), N, H, W, C);
  });
}

void concat_rows(const void* a, const void* b, void* y, int64_t rows, int64_t Ca, int64_t Cb,
                 size_t es, cudaStream_t s) {
  const int64_t e = int64_t(es), C = (Ca + Cb) * e;
  if (a) copy_cols(a, Ca * e, 0, y, C, 0, rows, Ca * e, s);
  if (b) copy_cols(b, Cb * e, 0, y, C, Ca * e, rows, Cb * e, s);
}

void split_rows(const void* y, void* a, void* b, int64_t rows, int64_t Ca, int64_t Cb, size_t es,
                cudaStream_t s) {
  const int64_t e = int64_t(es), C = (Ca + Cb) * e;
  if (a) copy_cols(y, C, 0, a, Ca * e, 0, rows, Ca * e, s);
  if (b) copy_cols(y, C, Ca * e, b, Cb * e, 0, rows, Cb * e, s);
}

int64_t dice_partial_count(int64_t P, int K) { return int64_t(dice_blocks(P)) * 3 * K; }

void softmax_dice(const void* logits, DType t, int64_t P, int K, const int32_t* labels,
                  float smooth, float grad_scale, double* partials, float* coef, void* dlogits,
                  cudaStream_t s) {
  const int nb = dice_blocks(P);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits);
    auto run = [&](auto kmax) {
      constexpr int KMAX = decltype(kmax)::value;
      dice_stats_k<T, KMAX><<<nb, kThreads, 0, s>>>(x, P, K, labels, partials);
      dice_coef_k<<<1, kThreads, 0, s>>>(partials, nb, K, smooth, coef);
      if (dlogits && P > 0)
        dice_grad_k<T, KMAX><<<grid_waves(P), kThreads, 0, s>>>(x, P, K, labels, coef, grad_scale,
                                                               static_cast<T*>(dlogits));
    };
    if (K <= 4)
      run(std::integral_constant<int, 4>{});
    else if (K <= 16)
      run(std::integral_constant<int, 16>{});
    else
      run(std::integral_constant<int, kDiceMaxClasses>{});
  });
}

}  // namespace dtrain::cuda_kernels

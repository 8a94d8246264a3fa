// U-Net kernels: bilinear x2 upsampling (align_corners=False; backward as a gather, no
// atomics), channel concat/split as strided row copies, softmax soft-Dice with
// fixed-order reductions (per-block partials in double, summed in block order).
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
    int c = int(i % C);
    int64_t r = i / C;
    int ow = int(r % OW);
    r /= OW;
    int oh = int(r % OH);
    int n = int(r / OH);
    unet::Taps th = unet::up2x_taps(oh, H), tw = unet::up2x_taps(ow, W);
    auto at = [&](int h, int w) { return to_f(x[((int64_t(n) * H + h) * W + w) * C + c]); };
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
    int c = int(i % C);
    int64_t r = i / C;
    int w = int(r % W);
    r /= W;
    int h = int(r % H);
    int n = int(r / H);
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

// Byte-wise strided copy of column ranges: dst[row, dcol0 + j] = src[row, scol0 + j].
__global__ void copy_cols_k(const char* src, int64_t sstride, int64_t scol0, char* dst,
                            int64_t dstride, int64_t dcol0, int64_t rows, int64_t width) {
  int64_t total = rows * width;
  DTRAIN_GRID_STRIDE(i, total) {
    int64_t r = i / width, j = i % width;
    dst[r * dstride + dcol0 + j] = src[r * sstride + scol0 + j];
  }
}

constexpr int kDiceBlocksMax = 256;

inline int dice_blocks(int64_t P) {
  int64_t b = (P + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : (b > kDiceBlocksMax ? kDiceBlocksMax : b));
}

// partials[block][3K]: sums of p_k, p_k*t_k, t_k over the block's pixels.
template <typename T>
__global__ void dice_stats_k(const T* logits, int64_t P, int K, const int32_t* labels,
                             double* partials) {
  __shared__ double sh[kThreads];
  float acc[3 * kDiceMaxClasses];
  float x[kDiceMaxClasses], p[kDiceMaxClasses];
  for (int j = 0; j < 3 * K; ++j) acc[j] = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < P;
       i += int64_t(gridDim.x) * blockDim.x) {
    for (int k = 0; k < K; ++k) x[k] = to_f(logits[i * K + k]);
    unet::softmax_row(x, K, p);
    int y = labels[i];
    for (int k = 0; k < K; ++k) acc[k] += p[k];
    if (y >= 0 && y < K) {
      acc[K + y] += p[y];
      acc[2 * K + y] += 1.f;
    }
  }
  for (int j = 0; j < 3 * K; ++j) {
    double s = block_sum<double>(double(acc[j]), sh);
    if (threadIdx.x == 0) partials[int64_t(blockIdx.x) * 3 * K + j] = s;
  }
}

// One block: totals in block order, then coef = [A_k (K), B_k (K), loss].
__global__ void dice_coef_k(const double* partials, int nblocks, int K, float smooth,
                            float* coef) {
  __shared__ double dice[kDiceMaxClasses];
  int k = threadIdx.x;
  if (k < K) {
    double sp = 0, I = 0, st = 0;
    for (int b = 0; b < nblocks; ++b) {
      const double* q = partials + int64_t(b) * 3 * K;
      sp += q[k], I += q[K + k], st += q[2 * K + k];
    }
    double S = sp + st + smooth;
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

template <typename T>
__global__ void dice_grad_k(const T* logits, int64_t P, int K, const int32_t* labels,
                            const float* coef, float grad_scale, T* dlogits) {
  float x[kDiceMaxClasses], p[kDiceMaxClasses];
  const float gk = grad_scale / float(K);
  DTRAIN_GRID_STRIDE(i, P) {
    for (int k = 0; k < K; ++k) x[k] = to_f(logits[i * K + k]);
    unet::softmax_row(x, K, p);
    int y = labels[i];
    float dot = 0.f;
    for (int k = 0; k < K; ++k) dot += p[k] * (-gk * ((k == y ? coef[k] : 0.f) - coef[K + k]));
    for (int k = 0; k < K; ++k) {
      float g = -gk * ((k == y ? coef[k] : 0.f) - coef[K + k]);
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
  const int64_t C = (Ca + Cb) * int64_t(es);
  if (a && rows * Ca > 0)
    copy_cols_k<<<grid_for(rows * Ca * int64_t(es)), kThreads, 0, s>>>(
        static_cast<const char*>(a), Ca * int64_t(es), 0, static_cast<char*>(y), C, 0, rows,
        Ca * int64_t(es));
  if (b && rows * Cb > 0)
    copy_cols_k<<<grid_for(rows * Cb * int64_t(es)), kThreads, 0, s>>>(
        static_cast<const char*>(b), Cb * int64_t(es), 0, static_cast<char*>(y), C,
        Ca * int64_t(es), rows, Cb * int64_t(es));
}

void split_rows(const void* y, void* a, void* b, int64_t rows, int64_t Ca, int64_t Cb, size_t es,
                cudaStream_t s) {
  const int64_t C = (Ca + Cb) * int64_t(es);
  if (a && rows * Ca > 0)
    copy_cols_k<<<grid_for(rows * Ca * int64_t(es)), kThreads, 0, s>>>(
        static_cast<const char*>(y), C, 0, static_cast<char*>(a), Ca * int64_t(es), 0, rows,
        Ca * int64_t(es));
  if (b && rows * Cb > 0)
    copy_cols_k<<<grid_for(rows * Cb * int64_t(es)), kThreads, 0, s>>>(
        static_cast<const char*>(y), C, Ca * int64_t(es), static_cast<char*>(b), Cb * int64_t(es),
        0, rows, Cb * int64_t(es));
}

int64_t dice_partial_count(int64_t P, int K) { return int64_t(dice_blocks(P)) * 3 * K; }

void softmax_dice(const void* logits, DType t, int64_t P, int K, const int32_t* labels,
                  float smooth, float grad_scale, double* partials, float* coef, void* dlogits,
                  cudaStream_t s) {
  const int nb = dice_blocks(P);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    dice_stats_k<T><<<nb, kThreads, 0, s>>>(static_cast<const T*>(logits), P, K, labels, partials);
    dice_coef_k<<<1, kDiceMaxClasses, 0, s>>>(partials, nb, K, smooth, coef);
    if (dlogits && P > 0)
      dice_grad_k<T><<<grid_for(P), kThreads, 0, s>>>(static_cast<const T*>(logits), P, K, labels,
                                                      coef, grad_scale, static_cast<T*>(dlogits));
  });
}

}  // namespace dtrain::cuda_kernels

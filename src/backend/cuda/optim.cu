// SGD and AdamW over flat f32 buffers in ONE launch: the device segment table maps each
// position of the virtual concatenation of segments to its buffer offset and decay flag.
// Formulas follow torch.optim.SGD and torch.optim.AdamW (single-tensor path).
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"

namespace dtrain::cuda_kernels {
namespace {

// Largest k with segs[k].start <= i (segments sorted by start, non-empty table).
__device__ inline int find_segment(const DevSegment* segs, int nseg, int64_t i) {
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (segs[mid].start <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void sgd_k(float* p, const float* gr, float* buf, const DevSegment* segs, int nseg,
                      int64_t total, SgdHyper h) {
  DTRAIN_GRID_STRIDE(i, total) {
    const DevSegment& sg = segs[find_segment(segs, nseg, i)];
    int64_t k = sg.offset + (i - sg.start);
    float g = gr[k] * h.grad_scale;
    if (h.weight_decay != 0.f && sg.decay) g += h.weight_decay * p[k];
    if (h.momentum != 0.f) {
      float b = h.first_step ? g : h.momentum * buf[k] + (1.f - h.dampening) * g;
      buf[k] = b;
      g = h.nesterov ? g + h.momentum * b : b;
    }
    p[k] -= h.lr * g;
  }
}

__global__ void adamw_k(float* p, const float* gr, float* m, float* v, const DevSegment* segs,
                        int nseg, int64_t total, AdamWHyper h) {
  DTRAIN_GRID_STRIDE(i, total) {
    const DevSegment& sg = segs[find_segment(segs, nseg, i)];
    int64_t k = sg.offset + (i - sg.start);
    float g = gr[k] * h.grad_scale;
    float w = p[k];
    if (sg.decay) w *= 1.f - h.lr * h.weight_decay;
    float mk = h.beta1 * m[k] + (1.f - h.beta1) * g;
    float vk = h.beta2 * v[k] + (1.f - h.beta2) * g * g;
    m[k] = mk;
    v[k] = vk;
    float denom = sqrtf(vk) / h.bc2_sqrt + h.eps;
    p[k] = w - h.step_size * (mk / denom);
  }
}

}  // namespace

void sgd_step(float* p, const float* g, float* buf, const DevSegment* segs, int nseg,
              int64_t total, const SgdHyper& h, cudaStream_t s) {
  if (total == 0 || nseg == 0) return;
  sgd_k<<<grid_for(total), kThreads, 0, s>>>(p, g, buf, segs, nseg, total, h);
}
void adamw_step(float* p, const float* g, float* m, float* v, const DevSegment* segs, int nseg,
                int64_t total, const AdamWHyper& h, cudaStream_t s) {
  if (total == 0 || nseg == 0) return;
  adamw_k<<<grid_for(total), kThreads, 0, s>>>(p, g, m, v, segs, nseg, total, h);
}

}  // namespace dtrain::cuda_kernels

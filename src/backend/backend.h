#pragma once
// The Backend interface: one virtual function per op family. CpuBackend (reference,
// backend/cpu) and CudaBackend (backend/cuda) implement it. Adding an op = declare it
// here once, implement it in both backends, add its rows to the parity table (tests/backend/parity/).
//
// Conventions (all ops):
//  * Every tensor lives on this backend's device and is contiguous row-major.
//  * Images are NHWC. Conv weights are OHWI ([out, kh, kw, in]); the checkpoint converts
//    to PyTorch's OIHW.
//  * Outputs are overwritten unless the op takes `accumulate`; parameter-gradient outputs
//    take `accumulate` so micro-batches (grad accumulation) add into the flat grad buffer.
//  * Float tensors may be f32, bf16 or f16 where `supports()` says so; statistics,
//    parameters' master copy, grads and optimizer state are always f32.
//  * Ops run in stream order; results read on the host need synchronize() (the d2h copy
//    does it).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/stream.h"
#include "core/allocator.h"
#include "core/targets.h"
#include "core/tensor.h"

namespace dtrain {

struct Conv2dParams {
  int stride_h = 1, stride_w = 1;
  int pad_h = 0, pad_w = 0;
  int dil_h = 1, dil_w = 1;
};

struct Pool2dParams {
  int kernel_h = 2, kernel_w = 2;
  int stride_h = 2, stride_w = 2;
  int pad_h = 0, pad_w = 0;
};

// A contiguous range of a flat parameter buffer that the optimizer updates with one
// weight-decay setting (decay=false for biases and norm weights when so configured).
struct ParamSegment {
  int64_t offset = 0;
  int64_t count = 0;
  bool decay = true;
};

struct SgdArgs {
  float lr = 0.1f, momentum = 0.f, dampening = 0.f, weight_decay = 0.f;
  bool nesterov = false;
  bool first_step = false;  // momentum buffer is initialised to the gradient (PyTorch)
  float grad_scale = 1.f;   // gradients are multiplied by this first (clipping, 1/loss_scale)
};

struct AdamWArgs {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
  int64_t step = 1;         // 1-based, for bias correction
  float grad_scale = 1.f;
};

// Memory operations of a backend since it was made (DESIGN: static memory; the
// steady-state step must move none of them: tests count them around training steps).
struct AllocCounts {
  int64_t allocs = 0;         // alloc() calls through the Backend interface (Buffer, Arena, ...)
  int64_t frees = 0;          // free() calls through the Backend interface
  int64_t internal = 0;       // (re)allocations of the backend's own workspaces and scratch
  int64_t system_allocs = 0;  // memory taken from the system: CUDA cudaMalloc/cudaMallocHost;
                              // CPU aligned_alloc and scratch growth
  int64_t system_frees = 0;   // memory given back: CUDA cudaFree/cudaFreeHost; CPU free
  // bytes held by alloc() (Buffer, Arena, ...: parameters, gradients, optimizer state,
  // activations), now and the high-water mark since the backend was made
  int64_t bytes_in_use = 0, peak_bytes = 0;
  bool operator==(const AllocCounts&) const = default;
};

// What attention_fwd saves for attention_bwd (Backend::attention_saved): dtype and shape.
struct AttentionSaved {
  DType dtype = DType::F32;
  Shape shape;
};

class EventTimer;  // backend/event_timer.h

// Ops whose dtype support differs between backends; see Backend::supports().
// A batch norm forward's fused epilogue: y = relu?(bn(x) + residual?) (ResNet's bn+relu and
// bn+add+relu, U-Net's bn+relu).
struct BnEpilogue {
  Tensor residual;  // undefined: none; else same shape and dtype as y
  bool relu = false;
};

// The backward of a batch norm whose forward ended in the fused ReLU: dy is masked by
// (y > 0) first. y: that forward's output (undefined: no ReLU). beta (optional, only
// without a residual): the forward's beta, from which a backend may recompute the mask
// out of x and the saved statistics instead of reading y (CUDA does: one tensor less to
// read in each pass); the mask is exactly y > 0 either way. dy_masked (optional): receives
// the masked gradient too (a residual block's shortcut needs it).
struct BnReluBwd {
  Tensor y;
  Tensor beta;
  Tensor dy_masked;
};

enum class Op {
  Fill, Copy, Cast, Add, Axpby, Scale, SumSquares, SumRows, AllFinite,
  Gemm, AddBias,
  Conv2dFwd, Conv2dBwdData, Conv2dBwdFilter, Conv2dCat,
  BatchNormFwdTrain, BatchNormFwdEval, BatchNormBwd,
  ReluFwd, ReluBwd,
  MaxPoolFwd, MaxPoolBwd, AvgPoolFwd, AvgPoolBwd, GlobalAvgPoolFwd, GlobalAvgPoolBwd,
  SoftmaxXent,
  SgdStep, AdamWStep,
  LayerNormFwd, LayerNormBwd, GeluFwd, GeluBwd, EmbeddingFwd, EmbeddingBwd, AttentionFwd, AttentionBwd, SoftmaxXentMasked, AttentionDecode,  // GPT
  VocabXent,  // tensor parallelism's cross-entropy
  RmsNormFwd, RmsNormBwd, RopeFwd, RopeBwd, SwigluFwd, SwigluBwd,  // the Llama family (models/llama.h)
  MoeRouteFwd, MoeRouteBwd, MoeGather, MoeCombine, MoeCombineBwd,  // mixture of experts (nn/moe.h)
  UpsampleBilinear2xFwd, UpsampleBilinear2xBwd, ConcatChannels, SplitChannels, SoftmaxDice,  // U-Net
  Count_  // not an op: the number of ops (Op(0) .. Op(kOpCount - 1) are every op, for tests)
};
inline constexpr int kOpCount = int(Op::Count_);

// Device work recorded once (a CUDA graph) and launched again and again: every launch reads
// and writes the addresses the recording used (Backend::capture_begin / capture_end).
class DeviceGraph {
 public:
  virtual ~DeviceGraph() = default;
  virtual void launch() = 0;  // in stream order, like an op
};

class Backend : public Allocator {
 public:
  ~Backend() override = default;
  Device device() const override = 0;
  virtual std::string name() const = 0;
  // True when `op` accepts float tensors of dtype `t` (f32 always).
  virtual bool supports(Op op, DType t) const = 0;

  // ---- memory ----
  void* alloc(size_t bytes) override = 0;  // aligned to 256 bytes; throws on OOM
  void free(void* p) override = 0;
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;  // synchronises
  virtual void copy_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void synchronize() = 0;
  virtual AllocCounts alloc_counts() const = 0;

  // ---- host staging and asynchronous copies (parallel.offload) ----
  // alloc_host: host memory the host computes on between copies, aligned to 256 bytes:
  // page-locked (cudaHostAlloc) on CUDA so that the asynchronous copies below overlap host
  // work; ordinary memory elsewhere. Not in alloc_counts() (host memory). Throws on failure.
  virtual void* alloc_host(size_t bytes);
  virtual void free_host(void* p);
  // Copies on the backend's copy streams (CUDA: one per direction), each ordered after the
  // compute work issued so far; the returned ticket's copy_wait() blocks the host until that
  // copy is done (only the latest 64 tickets can be waited on); copy_join() makes compute
  // work issued later wait for every copy issued so far. Default (CPU): the copy is done in
  // the call and every ticket is done.
  virtual uint64_t copy_to_host_async(void* dst, const void* src, size_t bytes);
  virtual uint64_t copy_from_host_async(void* dst, const void* src, size_t bytes);
  virtual void copy_wait(uint64_t ticket);
  virtual void copy_join() {}

  // ---- streams (the ordering contract: backend/stream.h, docs/distributed.md) ----
  // The stream the ops run on. Default (the CPU): a logical stream, the host running each op
  // to its end before it returns.
  virtual Stream& compute_stream();
  // A new stream for other work (a communicator's): CUDA: a non-blocking stream of this
  // device; default: a logical one.
  virtual std::unique_ptr<Stream> make_stream(const std::string& name);
  // The stream-order checker every stream of this backend reports to (make_backend turns it
  // on under DTRAIN_STREAM_CHECK=1; then the ops are declared through checked_backend.h);
  // null when off.
  StreamChecker* stream_checker() const { return checker_.get(); }
  // Before the first compute_stream() or make_stream().
  virtual void set_stream_checker(std::shared_ptr<StreamChecker> c) { checker_ = std::move(c); }
  // Declares work the host does itself, now, on memory that streams may touch (the host
  // update of parallel.offload on its staging buffers): checked as an op of the host.
  void host_access(const std::string& op, const std::vector<MemAccess>& acc) {
    if (checker_) checker_->issue(StreamChecker::kHost, op, acc);
  }

  // ---- timing ----
  // Marks in this backend's stream order for timing step phases (backend/event_timer.h):
  // the CPU reads a steady clock; CUDA records events on the compute stream (no
  // synchronisation when marking). The default is the host clock.
  virtual std::unique_ptr<EventTimer> make_event_timer();
  // Waits for the device, then opens (true) or closes (false) a profiler range: cudaProfilerStart/
  // Stop on CUDA (what ncu --profile-from-start off, nsys --capture-range=cudaProfilerApi and
  // scripts/prof/ktrace.cpp key on); nothing elsewhere.
  virtual void profiler_range(bool) {}

  // ---- graphs (train.cuda_graph) ----
  // can_capture(): capture_begin/capture_end work here (CUDA). Between them the ops issued
  // on the compute stream are recorded, not run, and must not synchronise with the host;
  // capture_end returns them as a graph, capture_abort drops a capture an error cut short.
  // Elsewhere capture_begin throws RuntimeFault (check can_capture() first).
  virtual bool can_capture() const { return false; }
  virtual void capture_begin();
  virtual std::unique_ptr<DeviceGraph> capture_end();
  virtual void capture_abort() {}

  // ---- elementwise, reductions ----
  virtual void fill(Tensor& y, float value) = 0;
  virtual void copy(const Tensor& x, Tensor& y) = 0;             // same dtype and numel
  virtual void cast(const Tensor& x, Tensor& y) = 0;             // any float <-> float
  virtual void add(const Tensor& a, const Tensor& b, Tensor& y) = 0;  // y = a + b (y may alias)
  virtual void axpby(float alpha, const Tensor& x, float beta, Tensor& y) = 0;  // y = a*x + b*y
  virtual void scale(Tensor& y, float s) = 0;
  virtual double sum_squares(const Tensor& x) = 0;               // to host, deterministic
  virtual double sum(const Tensor& x) = 0;                       // to host, deterministic
  // acc (f64 [1] on this device) = (accumulate ? acc : 0) + scale * sum(x) for a float x:
  // deterministic and without synchronising (a step's loss stays on the device until the
  // step ends; a CUDA graph can capture it).
  virtual void sum_into(const Tensor& x, double scale, Tensor& acc, bool accumulate) = 0;
  virtual void sum_rows(const Tensor& x, Tensor& y, bool accumulate) = 0;  // x [M,N] -> y [N]
  virtual bool all_finite(const Tensor& x) = 0;                  // to host

  // ---- matrix multiply (2-D views, row-major) ----
  // c = alpha * op(a) @ op(b) + beta * c; op(a) is [M,K] (a is [K,M] when trans_a),
  // op(b) is [K,N] (b is [N,K] when trans_b), c is [M,N].
  virtual void gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b,
                    float beta, Tensor& c) = 0;
  virtual void add_bias(Tensor& y, const Tensor& bias) = 0;     // y [M,N] += bias [N]
  // c [M,N] = op(a) op(b) + bias [N] (a Linear layer's forward). The default is gemm then
  // add_bias; CUDA adds the bias in cuBLASLt's epilogue (one pass, rounded once).
  virtual void gemm_bias(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                         const Tensor& bias, Tensor& c) {
    gemm(trans_a, trans_b, 1.f, a, b, 0.f, c);
    add_bias(c, bias);
  }
  // GPT's MLP around its GELU (tanh GELU, as gelu_fwd/gelu_bwd):
  //   gemm_bias_gelu: pre [M,N] = op(a) op(b) + bias [N], c [M,N] = gelu(pre) (pre is what
  //     the backward needs). Default: gemm_bias into pre, then gelu_fwd.
  //   gemm_dgelu: c [M,N] = gelu'(pre) * (op(a) op(b)), the gradient at the GELU's input when
  //     op(a) op(b) is the gradient at its output. Default: gemm into c, then gelu_bwd in place.
  // CUDA fuses each into one cuBLASLt GEMM (GELU_AUX_BIAS / DGELU epilogues), which saves the
  // separate GELU passes; there gelu is applied to the unrounded product.
  virtual void gemm_bias_gelu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                              const Tensor& bias, Tensor& pre, Tensor& c) {
    gemm_bias(trans_a, trans_b, a, b, bias, pre);
    gelu_fwd(pre, c);
  }
  virtual void gemm_dgelu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                          const Tensor& pre, Tensor& c) {
    gemm(trans_a, trans_b, 1.f, a, b, 0.f, c);
    gelu_bwd(pre, c, c);
  }
  // A Linear layer's parameter gradients from its output gradient dy [M,out] and input
  // x [M,in]: dw += dy^T x (dw [out,in]) or, with in_out, dw += x^T dy (dw [in,out]); and
  // dbias [out] += the column sums of dy when dbias is defined (dw, dbias: f32 master
  // gradients). Default: the GEMM with beta = 1, then sum_rows; CUDA computes the bias
  // gradient in the same cuBLASLt GEMM (BGRADA/BGRADB epilogue) where it can.
  virtual void linear_wgrad(const Tensor& dy, const Tensor& x, bool in_out, Tensor& dw, Tensor& dbias) {
    if (in_out)
      gemm(true, false, 1.f, x, dy, 1.f, dw);
    else
      gemm(true, false, 1.f, dy, x, 1.f, dw);
    if (dbias.defined()) sum_rows(dy, dbias, /*accumulate=*/true);
  }

  // ---- convolution (NHWC, weight OHWI, groups = 1) ----
  // x [N,H,W,C], w [O,KH,KW,C], bias [O] or undefined, y [N,OH,OW,O]
  virtual void conv2d_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                          const Conv2dParams& p) = 0;
  // accumulate: dx += the input gradient (a residual or skip connection's sum, without a
  // separate add). The gradient is rounded to dx's dtype before the add on the CPU, as the
  // two ops would be; CUDA may round once (cuDNN/cuBLASLt beta = 1).
  virtual void conv2d_bwd_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                               const Conv2dParams& p, bool accumulate) = 0;
  // dw [O,KH,KW,C]; dbias [O] or undefined
  virtual void conv2d_bwd_filter(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& dbias,
                                 const Conv2dParams& p, bool accumulate) = 0;
  // A convolution (no bias) of x = cat(a, b) along channels, without materialising x (the
  // U-Net decoder's first convolution over [skip, upsampled]): a [N,H,W,Ca], b [N,H,W,Cb],
  // w [O,KH,KW,Ca+Cb]. Forward y = conv(x, w); backward data da, db = the two channel
  // slices of dx (overwritten); backward filter dw (+)= the filter gradient. Only where
  // supports(Op::Conv2dCat, dtype) (CUDA: the filter split in two, two convolutions summed
  // with beta = 1); callers concatenate elsewhere (Module::forward_cat). Default: fault.
  virtual void conv2d_fwd_cat(const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y,
                              const Conv2dParams& p);
  virtual void conv2d_bwd_data_cat(const Tensor& dy, const Tensor& w, Tensor& da, Tensor& db,
                                   const Conv2dParams& p);
  virtual void conv2d_bwd_filter_cat(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& dw,
                                     const Conv2dParams& p, bool accumulate);

  // ---- batch norm over all axes but the last (C); stats f32 [C] ----
  // running_var is updated with the unbiased variance (PyTorch). save_invstd = 1/sqrt(var+eps)
  // with the biased batch variance. The forwards take a fused epilogue (BnEpilogue):
  // y = relu?(bn(x) + residual?), where bn(x) is rounded to y's dtype before the add (as the
  // separate ops would). The backward takes the fused ReLU's mask as BnReluBwd.
  virtual void batchnorm_fwd_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                   Tensor& y, Tensor& running_mean, Tensor& running_var,
                                   Tensor& save_mean, Tensor& save_invstd, float momentum,
                                   float eps, const BnEpilogue& ep = {}) = 0;
  virtual void batchnorm_fwd_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                  const Tensor& running_mean, const Tensor& running_var,
                                  Tensor& y, float eps, const BnEpilogue& ep = {}) = 0;
  virtual void batchnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                             const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx,
                             Tensor& dgamma, Tensor& dbeta, bool accumulate,
                             const BnReluBwd& relu = {}) = 0;

  // ---- activations ----
  virtual void relu_fwd(const Tensor& x, Tensor& y) = 0;
  virtual void relu_bwd(const Tensor& y, const Tensor& dy, Tensor& dx) = 0;  // dx may alias dy

  // ---- pooling (NHWC) ----
  // Max pooling follows PyTorch: padding is never the max; a cell wins when greater, or
  // when NaN (so the last NaN of a window wins); ties go to the first cell in row-major scan
  // order. argmax (u8, y's shape; undefined when no backward follows) receives the winner's
  // offset in its window, (ih - oh*stride_h + pad_h) * kernel_w + (iw - ow*stride_w + pad_w),
  // so kernel_h * kernel_w must be <= 256. The backward reads only argmax and dy: dx (+)=
  // the sum of dy over the windows whose max a cell was, in (oh, ow) order.
  virtual void maxpool2d_fwd(const Tensor& x, Tensor& y, Tensor& argmax,
                             const Pool2dParams& p) = 0;
  virtual void maxpool2d_bwd(const Tensor& argmax, const Tensor& dy, Tensor& dx,
                             const Pool2dParams& p, bool accumulate) = 0;
  // count_include_pad = true (PyTorch's default)
  virtual void avgpool2d_fwd(const Tensor& x, Tensor& y, const Pool2dParams& p) = 0;
  virtual void avgpool2d_bwd(const Tensor& dy, Tensor& dx, const Pool2dParams& p) = 0;
  virtual void global_avgpool_fwd(const Tensor& x, Tensor& y) = 0;   // [N,H,W,C] -> [N,C]
  virtual void global_avgpool_bwd(const Tensor& dy, Tensor& dx) = 0;  // [N,C] -> [N,H,W,C]

  // ---- U-Net ops ----
  // Bilinear x2 upsampling, align_corners=False (PyTorch nn.Upsample(scale_factor=2,
  // mode='bilinear')): x [N,H,W,C] -> y [N,2H,2W,C]. The backward is a gather (each input
  // pixel sums the taps that read it, in a fixed order): deterministic, no atomics.
  virtual void upsample_bilinear2x_fwd(const Tensor& x, Tensor& y) = 0;
  virtual void upsample_bilinear2x_bwd(const Tensor& dy, Tensor& dx) = 0;  // dy [N,2H,2W,C]
  // y [N,H,W,Ca+Cb] = cat(a [N,H,W,Ca], b [N,H,W,Cb]) along channels (NHWC: strided copies).
  virtual void concat_channels(const Tensor& a, const Tensor& b, Tensor& y) = 0;
  // The inverse: da = dy[..., :Ca], db = dy[..., Ca:]; an undefined da or db is skipped
  // (then the other one's channel count fixes the split).
  virtual void split_channels(const Tensor& dy, Tensor& da, Tensor& db) = 0;
  // Soft Dice loss over a batch: p = softmax(logits) per pixel, t = onehot(labels),
  // dice_k = (2 sum p_k t_k + smooth) / (sum p_k + sum t_k + smooth) with sums over every
  // pixel of the batch, loss = 1 - mean_k dice_k. logits [N,H,W,K] (any 2+-D [..., K]),
  // labels i32 [N,H,W] in [0,K). The loss goes to `loss` (f32 [1] on this device, when
  // defined; no synchronisation); dlogits (same shape/dtype as logits, when defined) =
  // grad_scale * dL/dlogits. Deterministic (fixed-order reductions).
  virtual void softmax_dice(const Tensor& logits, const Tensor& labels, float smooth,
                            float grad_scale, Tensor& loss, Tensor& dlogits) = 0;

  // ---- loss ----
  // logits [N,C], labels i32 [N] in [0,C), losses f32 [N] (per-sample CE with label
  // smoothing as PyTorch). If dlogits is defined: dlogits = grad_scale*(softmax - target).
  virtual void softmax_xent(const Tensor& logits, const Tensor& labels, float label_smoothing,
                            float grad_scale, Tensor& losses, Tensor& dlogits) = 0;

  // ---- GPT ops ----
  // Layer norm over the last axis (PyTorch nn.LayerNorm): x [M,C], gamma/beta [C] (f32 or
  // x's dtype), y [M,C] (x's dtype); mean and rstd = 1/sqrt(biased var + eps) f32 [M].
  virtual void layernorm_fwd(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                             Tensor& mean, Tensor& rstd, float eps) = 0;
  // The residual stream's add fused into the layer norm that reads it: h = a + b (rounded
  // to the dtype, as add stores it), then y = layernorm(h). Default: add, then layernorm_fwd.
  virtual void add_layernorm_fwd(const Tensor& a, const Tensor& b, Tensor& h, const Tensor& gamma,
                                 const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd, float eps) {
    add(a, b, h);
    layernorm_fwd(h, gamma, beta, y, mean, rstd, eps);
  }
  // dgamma/dbeta [C] (f32 or dy's dtype) are accumulated when `accumulate`. With
  // accumulate_dx, dx += the input gradient (rounded to dx's dtype, then added: what
  // layernorm_bwd then add give; a residual connection's sum without its own pass).
  virtual void layernorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                             const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dgamma,
                             Tensor& dbeta, bool accumulate, bool accumulate_dx) = 0;
  // GELU, tanh approximation (GPT-2; PyTorch approximate='tanh'). gelu_bwd: dx = dy*gelu'(x);
  // dx may alias dy.
  virtual void gelu_fwd(const Tensor& x, Tensor& y) = 0;
  virtual void gelu_bwd(const Tensor& x, const Tensor& dy, Tensor& dx) = 0;
  // y[b,t,:] = wte[ids[b,t],:] + wpe[t,:]. ids i32 [B,T] in [0,V), wte [V,C], wpe [Tmax,C]
  // with T <= Tmax, y [B,T,C] (any float dtype; wte/wpe f32 or y's dtype). wpe undefined: no
  // position embedding, y = wte[ids] (the Llama family).
  virtual void embedding_fwd(const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                             Tensor& y) = 0;
  // dwte [V,C] / dwpe [Tmax,C] (f32 or dy's dtype; either may be undefined) get
  // (accumulate ? old : 0) + the scattered dy, summed in a fixed order (deterministic).
  virtual void embedding_bwd(const Tensor& dy, const Tensor& ids, Tensor& dwte, Tensor& dwpe,
                             bool accumulate) = 0;
  // Causal self-attention without projections, multi-head or grouped-query (GQA; MQA with
  // one key/value head): n_head query heads share n_kv_head key/value heads (0: n_head, plain
  // multi-head; n_kv_head divides n_head), query head h reading key/value head h / (n_head /
  // n_kv_head). qkv [B,T,(H + 2 Hkv) hs] is q | k | v per position (H = n_head query heads,
  // then Hkv key heads, then Hkv value heads, head i at columns i*hs of its part: GPT-2's
  // c_attn output split, or Llama's stacked q_proj | k_proj | v_proj), out [B,T,H hs] (heads
  // concatenated) = softmax(q k^T / sqrt(hs), causal mask) v per query head. `saved` is what
  // the forward keeps for the backward; the backend decides what that is, and
  // attention_saved() gives its dtype and shape (the caller allocates it):
  //  * CPU: the probabilities [B,H,T,T] in qkv's dtype (zeros above the diagonal).
  //  * CUDA, bf16/f16 qkv with hs in {16, 32, 64, 128} on sm_80+: flash attention; saved
  //    is the log-sum-exp of each row of scaled scores, logsumexp_s(q_t k_s / sqrt(hs))
  //    over s <= t, [B,H,T] f32 (the backward recomputes the probabilities from it).
  //  * CUDA otherwise (f32, other head sizes): the probabilities, as on the CPU.
  virtual AttentionSaved attention_saved(int64_t B, int64_t H, int64_t T, int64_t hs,
                                         DType qkv_dtype) const = 0;
  // doc_pos (i32 [B,T], or undefined: every row one causal sequence) packs documents into a row:
  // it is each token's position in its document (0 at a document's first token), and query t
  // of row b sees only its document so far, keys t - doc_pos[b,t] .. t (a block-diagonal causal
  // mask; variable-length flash attention on CUDA).
  virtual void attention_fwd(const Tensor& qkv, Tensor& out, Tensor& saved, int n_head, int n_kv_head = 0,
                             const Tensor& doc_pos = Tensor()) = 0;
  // dout [B,T,H hs]; out [B,T,H hs] is the forward's output (flash attention's backward needs
  // rowsum(dout * out); backends saving probabilities may ignore it). dqkv (qkv's shape) is
  // overwritten; a key/value head's gradient sums over the query heads that read it.
  virtual void attention_bwd(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                             const Tensor& saved, Tensor& dqkv, int n_head, int n_kv_head = 0,
                             const Tensor& doc_pos = Tensor()) = 0;
  // One incremental-decoding step of causal attention against a K/V cache (sampling).
  // qkv [B,(H + 2 Hkv) hs] (or [B,1,...]) is the new position's q | k | v; its k and v are
  // first stored at row `pos` of kcache/vcache [B,Hkv,Tmax,hs] (qkv's dtype, pos < Tmax), then
  // out [B,H hs] = softmax(q K[0..pos]^T / sqrt(hs)) V[0..pos] per query head (heads
  // concatenated; query head h reads cache head h / (H / Hkv)).
  virtual void attention_decode(const Tensor& qkv, Tensor& kcache, Tensor& vcache, int64_t pos,
                                Tensor& out, int n_head, int n_kv_head = 0) = 0;
  // softmax_xent without label smoothing over the first `valid_classes` columns of
  // logits [N,Cp] (padded vocabulary): columns >= valid_classes are never predicted
  // and get dlogits = 0. labels i32 [N] in [0, valid_classes), or kIgnoreTarget: a row that is
  // not a target (completion-only loss, padding) has loss 0 and dlogits 0.
  virtual void softmax_xent_masked(const Tensor& logits, const Tensor& labels,
                                   int64_t valid_classes, float grad_scale, Tensor& losses,
                                   Tensor& dlogits) = 0;

  // ---- the Llama family's ops (models/llama.h) ----
  // RMS norm over the last axis (Hugging Face's LlamaRMSNorm): x [M,C], weight [C] (f32 or x's
  // dtype), y [M,C] (x's dtype) = x * rstd * weight, rstd f32 [M] = 1 / sqrt(mean(x^2) + eps);
  // the statistics in f32 (sums in double on the CPU), y rounded once to its dtype.
  virtual void rmsnorm_fwd(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) = 0;
  // The residual stream's add fused into the norm that reads it: h = a + b (rounded to the
  // dtype, as add stores it), then y = rmsnorm(h). Default: add, then rmsnorm_fwd.
  virtual void add_rmsnorm_fwd(const Tensor& a, const Tensor& b, Tensor& h, const Tensor& weight, Tensor& y,
                               Tensor& rstd, float eps) {
    add(a, b, h);
    rmsnorm_fwd(h, weight, y, rstd, eps);
  }
  // dx = rstd * (dy * w - xhat * mean(dy * w * xhat)) with xhat = x * rstd; dweight [C] (f32 or
  // dy's dtype; undefined: skipped) gets (accumulate ? old : 0) + the column sums of dy * xhat.
  // With accumulate_dx, dx += the input gradient (rounded to dx's dtype, then added: a residual
  // connection's sum, as layernorm_bwd).
  virtual void rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                           Tensor& dx, Tensor& dweight, bool accumulate, bool accumulate_dx) = 0;
  // Rotary position embedding (RoPE, Hugging Face's rotate_half form) of the first `rot_heads`
  // heads of each row of x [B,T,W] (head i at columns i*hs; a fused q | k | v row rotates its
  // H + Hkv query and key heads): with c = cos[p,j], s = sin[p,j] for j < hs/2 and the
  // position p = positions[b,t] (positions i32 [B,T]; undefined: p = t),
  //   y[j] = x[j] c - x[j + hs/2] s,   y[j + hs/2] = x[j + hs/2] c + x[j] s   (per head);
  // the columns after the rotated heads (the values) are copied. cos/sin f32 [P, hs/2] are the
  // model's table of angles (positions >= P: a fault on the CPU; CUDA writes NaN for the row).
  // y has x's shape and dtype and may alias x.
  virtual void rope_fwd(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                        int rot_heads, Tensor& y) = 0;
  // The backward: dx = the rotation by minus the angle of dy (the values' columns copied);
  // same arguments as rope_fwd; dx may alias dy.
  virtual void rope_bwd(const Tensor& dy, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                        int rot_heads, Tensor& dx) = 0;
  // SwiGLU (Llama's MLP): gu [M, 2I] is gate | up per row (one GEMM over the stacked gate_proj
  // and up_proj), y [M, I] = silu(gate) * up with silu(g) = g / (1 + exp(-g)).
  virtual void swiglu_fwd(const Tensor& gu, Tensor& y) = 0;
  // dgu [M, 2I] = (dy * up * silu'(gate) | dy * silu(gate)), silu'(g) = sig(g) (1 + g (1 - sig(g))).
  virtual void swiglu_bwd(const Tensor& gu, const Tensor& dy, Tensor& dgu) = 0;

  // ---- mixture of experts (nn/moe.h: Mixtral's / Qwen2-MoE's sparse MLP) ----
  // N tokens, E experts, k = top_k experts per token; a slot s = n k + j is token n's j-th choice.
  // moe_route_fwd: from the router's logits [N,E] (any float dtype, read as f32):
  //   probs f32 [N,E] = softmax(logits) (f32), lse f32 [N] = logsumexp of the row;
  //   sel i32 [N,k] = the k largest probabilities' experts, largest first (equal values: the lower
  //   expert first); weights f32 [N,k] = their probabilities, divided by their sum when norm_topk;
  //   counts i32 [E] = the slots routed to each expert;
  //   order i32 [N k] = the slots grouped by expert (expert 0's first), each group in slot order;
  //   pos i32 [N k] = where slot s is in order, or -(that + 1) when the slot is dropped: a group
  //   keeps its first `capacity` slots (capacity 0: every slot, dropless);
  //   stats f32 [E+1] = the column sums of probs (in double), then the sum of lse^2.
  // Deterministic (fixed-order sums).
  virtual void moe_route_fwd(const Tensor& logits, int top_k, bool norm_topk, int64_t capacity, Tensor& probs,
                             Tensor& lse, Tensor& sel, Tensor& weights, Tensor& counts, Tensor& order, Tensor& pos,
                             Tensor& stats) = 0;
  // The router's backward: dlogits [N,E] (the logits' dtype) = softmax'(probs) applied to dp,
  // dp[n,e] = paux[e] + (the gradient of weights [N,k] dweights through the top-k selection and,
  // when norm_topk, the renormalisation), plus zscale * 2 lse[n] probs[n,e] (the z-loss).
  // paux f32 [E] (undefined: 0) is the gradient of a loss linear in the column sums of probs
  // (the load-balancing loss).
  virtual void moe_route_bwd(const Tensor& probs, const Tensor& lse, const Tensor& sel, const Tensor& weights,
                             const Tensor& dweights, const Tensor& paux, float zscale, bool norm_topk,
                             Tensor& dlogits) = 0;
  // y [M,C] row i = x [N,C] row order[i] / top_k (order i32 [M]: the routed slots, grouped).
  virtual void moe_gather(const Tensor& x, const Tensor& order, int top_k, Tensor& y) = 0;
  // y [N,C] (+)= for each token n the sum over j < k, in order, of weights[n,j] * ye[pos[n k + j]]
  // over its kept slots (pos >= 0); weights f32 [N,k] (undefined: 1), ye [M,C], pos i32 [N k].
  // With weights it combines the experts' outputs; without, it is moe_gather's backward.
  // accumulate: the sum is rounded to y's dtype, then added (as an add after the op).
  virtual void moe_combine(const Tensor& ye, const Tensor& pos, const Tensor& weights, int top_k, Tensor& y,
                           bool accumulate) = 0;
  // The backward of the weighted moe_combine: dye [M,C] row pos[s] = weights[s] * dy [N,C] row
  // s / k for kept slots, and 0 in the rows of dropped ones; dweights f32 [N,k] = the dot product
  // of dy's row and the kept slot's ye row (0 when dropped).
  virtual void moe_combine_bwd(const Tensor& dy, const Tensor& ye, const Tensor& pos, const Tensor& weights,
                               int top_k, Tensor& dye, Tensor& dweights) = 0;

  // ---- vocabulary-parallel cross-entropy (nn/vocab_parallel.h), in three passes around two
  // all-reduces, all on the device ----
  // A rank's logits [N,Vl] (f32, bf16 or f16, read as f32) hold global classes
  // [offset, offset + Vl), the first `valid` columns real (the rest padding, never predicted);
  // labels i32 [N] are global class ids in [0, classes) or kIgnoreTarget (loss 0, dlogits 0; CPU:
  // UserError naming the position otherwise; CUDA: the row's loss and gradient become NaN). Sums are in double, rounded to f32.
  // vocab_xent_max: mx f32 [N] = the max over the real columns (-inf when valid = 0).
  virtual void vocab_xent_max(const Tensor& logits, int64_t valid, Tensor& mx) = 0;
  // vocab_xent_parts: parts f32 [N,2] = (sum over the real columns of exp(z - gmax), the
  // label's logit when the label is a real column of this rank else 0); gmax f32 [N] is mx's
  // max over the ranks.
  virtual void vocab_xent_parts(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                int64_t classes, const Tensor& gmax, Tensor& parts) = 0;
  // vocab_xent_finish: sums f32 [N,2] = parts summed over the ranks; losses f32 [N] (when
  // defined) = gmax + log(sums[,0]) - sums[,1]; dlogits (when defined; logits' shape and dtype)
  // = grad_scale * (exp(z - gmax) / sums[,0] - [column is the label]) on the real columns, 0 on
  // the padding.
  virtual void vocab_xent_finish(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                 const Tensor& gmax, const Tensor& sums, float grad_scale, Tensor& losses,
                                 Tensor& dlogits) = 0;

  // ---- optimizers over flat f32 buffers (params, grads, state have equal length) ----
  virtual void sgd_step(Tensor& params, const Tensor& grads, Tensor& momentum_buf,
                        const std::vector<ParamSegment>& segments, const SgdArgs& a) = 0;
  virtual void adamw_step(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                          const std::vector<ParamSegment>& segments, const AdamWArgs& a) = 0;

 protected:
  std::shared_ptr<StreamChecker> checker_;

 private:
  std::unique_ptr<Stream> compute_;
};

// Device selection. "auto" picks CUDA when compiled in and a device is present.
// Returns the CPU backend with a one-line notice when CUDA is asked for by "auto" but
// unavailable; throws UserError when "cuda" is asked for and unavailable.
// `cpu_threads`: the CPU backend's OpenMP team (oneDNN, cpu::sgemm, dtrain's loops); a
// trainer, eval, bench or sample process passes comm::cpu_threads' count (run.threads, else
// OMP_NUM_THREADS, else its share of the CPUs: the one place that decides). 0, the default
// of tests and tools, takes every CPU of the process (omp_get_num_procs).
// Device options a recipe sets (ignored by backends they do not apply to: the CPU has no
// TF32 or cuDNN).
// Under DTRAIN_STREAM_CHECK=1 (backend/stream_check.h) the backend comes wrapped in a
// CheckedBackend, whose streams report to one StreamChecker.
struct BackendOptions {
  bool allow_tf32 = false;       // precision.tf32: f32 GEMMs/convolutions may use TF32
  bool cudnn_benchmark = false;  // run.cudnn_benchmark: time convolution algorithms per shape
};
std::unique_ptr<Backend> make_backend(const std::string& device, int local_rank = 0,
                                      int cpu_threads = 0, const BackendOptions& opts = {});
int cuda_device_count();  // 0 when not compiled with CUDA or no device/driver
// What `dtrain info` prints of the backends this build has: the CPU's libraries and threads,
// CUDA's runtime, driver, libraries and devices (or that it was not built). One line each.
std::vector<std::string> describe_backends();

// Called first in main: when OpenBLAS fell back to its generic Prescott kernels on a CPU with
// AVX2+FMA (or AVX-512), re-executes this process with OPENBLAS_CORETYPE naming the kernels it
// can run (Haswell, SkylakeX); returns otherwise. A user's OPENBLAS_CORETYPE is kept.
void select_blas_kernels(char** argv);
// The OpenBLAS kernels in use and who chose them, for `dtrain info`.
std::string blas_kernels_note();

class Arena;
// The values of a float tensor of any dtype as f32 on the host: 16-bit tensors are widened
// on the device first (into `scratch`, an arena the caller resets).
void copy_to_host_f32(Backend& be, Arena& scratch, const Tensor& t, std::vector<float>& out);

}  // namespace dtrain

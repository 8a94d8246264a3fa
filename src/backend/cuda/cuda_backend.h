#pragma once
// CudaBackend: the Backend interface on one NVIDIA GPU. Everything runs on one
// non-blocking stream owned by the backend; copy_to_host synchronises.
//   memory.cpp       caching allocator (RuntimeFault on OOM with sizes and knobs)
//   elementwise.cu   fill/cast/add/axpby/scale/relu/bias, reductions (kernels.h)
//   gemm.cpp         cuBLASLt matmul, plans cached per shape
//   conv.cpp         cuDNN convolution (NHWC, filter KRSC = OHWI), plans cached per shape
//   norm.cu pool.cu loss.cu optim.cu   own kernels
//   event_timer.cpp  EventTimer over cudaEvents on the compute stream (step phase timing)
//   cuda_backend.cpp the class: handles, validation, dispatch to kernels
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/unfused.h"
#include "backend/backend.h"
#include "backend/cuda/kernels.h"

namespace dtrain {

// ---- caching device allocator (memory.cpp) ----
// Blocks freed by dtrain are kept and reused in stream order (one stream, so a block is
// never handed out while a pending kernel could still use it under a different owner).
class CudaAllocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {}
  ~CudaAllocator();
  CudaAllocator(const CudaAllocator&) = delete;
  CudaAllocator& operator=(const CudaAllocator&) = delete;
  void* alloc(size_t bytes);
  void free(void* p);
  void release_cached();  // cudaFree every cached block
  size_t in_use() const { return in_use_; }
  size_t cached() const { return cached_; }
  size_t peak() const { return peak_; }
  int64_t cuda_mallocs() const { return cuda_mallocs_; }  // cudaMalloc calls that succeeded
  int64_t cuda_frees() const { return cuda_frees_; }      // cudaFree calls

 private:
  int device_;
  int64_t cuda_mallocs_ = 0, cuda_frees_ = 0;
  std::unordered_map<void*, size_t> live_;   // pointer -> rounded size
  std::multimap<size_t, void*> free_;        // rounded size -> cached block
  size_t in_use_ = 0, cached_ = 0, peak_ = 0;
};

// RAII owner of a device allocation from a CudaAllocator (workspaces, scratch).
class DeviceScratch {
 public:
  explicit DeviceScratch(CudaAllocator& a) : a_(a) {}
  ~DeviceScratch() { reset(); }
  void* get(size_t bytes);  // grows (never shrinks); contents not preserved on growth
  void* data() const { return p_; }
  size_t size() const { return bytes_; }
  int64_t allocations() const { return allocations_; }  // times get() had to (re)allocate
  void reset();

 private:
  CudaAllocator& a_;
  int64_t allocations_ = 0;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

struct GemmPlan;   // gemm.cpp
struct ConvPlan;   // conv.cpp

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device_index);
  ~CudaBackend() override;

  // TF32 tensor cores for f32 GEMM and convolution (off by default: exact-ish parity).
  void set_allow_tf32(bool on);
  bool allow_tf32() const { return allow_tf32_; }
  // run.cudnn_benchmark: convolution plans time cuDNN's algorithms (cudnnFind*AlgorithmEx on
  // scratch outputs) and keep the fastest, instead of the heuristic's first usable choice
  void set_cudnn_benchmark(bool on) { cudnn_benchmark_ = on; }
  cudaStream_t stream() const { return stream_; }
  const CudaAllocator& allocator() const { return alloc_; }
  std::string describe() const;  // "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB, CUDA 13.0, cuDNN 9.19.0)"

  Device device() const override { return Device::cuda(dev_); }
  std::string name() const override { return "cuda"; }
  bool supports(Op op, DType t) const override;

  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void copy_from_host(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void copy_device(void* dst, const void* src, size_t bytes) override;
  void synchronize() override;
  // cuda_stream.h: the compute stream wrapped (not owned); new non-blocking streams
  Stream& compute_stream() override;
  std::unique_ptr<Stream> make_stream(const std::string& name) override;
  // host_copy.cpp: pinned host staging and the copy streams (parallel.offload)
  void* alloc_host(size_t bytes) override;
  void free_host(void* p) override;
  uint64_t copy_to_host_async(void* dst, const void* src, size_t bytes) override;
  uint64_t copy_from_host_async(void* dst, const void* src, size_t bytes) override;
  void copy_wait(uint64_t ticket) override;
  void copy_join() override;
  void profiler_range(bool start) override;
  bool can_capture() const override { return true; }
  void capture_begin() override;
  std::unique_ptr<DeviceGraph> capture_end() override;
  void capture_abort() override;
  const void* bn_residual(const char* op, const BnEpilogue& ep, const Tensor& y);
  double reduce_to_host(const Tensor& x, bool square, const char* op);
  // allocs/frees: this interface; internal: workspace/scratch (re)allocations and GEMM/conv
  // plans created; system: cudaMalloc/cudaMallocHost and cudaFree through this backend.
  AllocCounts alloc_counts() const override;
  // CudaEventTimer (event_timer.cpp): events recorded on stream().
  std::unique_ptr<EventTimer> make_event_timer() override;

  void fill(Tensor& y, float value) override;
  void copy(const Tensor& x, Tensor& y) override;
  void cast(const Tensor& x, Tensor& y) override;
  void add(const Tensor& a, const Tensor& b, Tensor& y) override;
  void axpby(float alpha, const Tensor& x, float beta, Tensor& y) override;
  void scale(Tensor& y, float s) override;
  double sum_squares(const Tensor& x) override;
  double sum(const Tensor& x) override;
  void sum_into(const Tensor& x, double scale, Tensor& acc, bool accumulate) override;
  void sum_rows(const Tensor& x, Tensor& y, bool accumulate) override;
  bool all_finite(const Tensor& x) override;

  void gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b, float beta,
            Tensor& c) override;
  void gemm_bias(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& bias,
                 Tensor& c) override;
  void gemm_bias_gelu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& bias,
                      Tensor& pre, Tensor& c) override;
  void gemm_dgelu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& pre,
                  Tensor& c) override;
  void linear_wgrad(const Tensor& dy, const Tensor& x, bool in_out, Tensor& dw, Tensor& dbias) override;
  void add_bias(Tensor& y, const Tensor& bias) override;

  void conv2d_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                  const Conv2dParams& p) override;
  void conv2d_fwd_cat(const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y, const Conv2dParams& p) override;
  void conv2d_bwd_data_cat(const Tensor& dy, const Tensor& w, Tensor& da, Tensor& db,
                           const Conv2dParams& p) override;
  void conv2d_bwd_filter_cat(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& dw, const Conv2dParams& p,
                             bool accumulate) override;
  void conv2d_bwd_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                       const Conv2dParams& p, bool accumulate) override;
  void conv2d_bwd_filter(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& dbias,
                         const Conv2dParams& p, bool accumulate) override;

  void batchnorm_fwd_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                           Tensor& running_mean, Tensor& running_var, Tensor& save_mean,
                           Tensor& save_invstd, float momentum, float eps,
                           const BnEpilogue& ep = {}) override;
  void batchnorm_fwd_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                          const Tensor& running_mean, const Tensor& running_var, Tensor& y,
                          float eps,
                          const BnEpilogue& ep = {}) override;
  void batchnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                     const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx,
                     Tensor& dgamma, Tensor& dbeta, bool accumulate,
                     const BnReluBwd& relu = {}) override;

  void relu_fwd(const Tensor& x, Tensor& y) override;
  void relu_bwd(const Tensor& y, const Tensor& dy, Tensor& dx) override;

  void maxpool2d_fwd(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p) override;
  void maxpool2d_bwd(const Tensor& argmax, const Tensor& dy, Tensor& dx, const Pool2dParams& p,
                     bool accumulate) override;
  void avgpool2d_fwd(const Tensor& x, Tensor& y, const Pool2dParams& p) override;
  void avgpool2d_bwd(const Tensor& dy, Tensor& dx, const Pool2dParams& p) override;
  void global_avgpool_fwd(const Tensor& x, Tensor& y) override;
  void global_avgpool_bwd(const Tensor& dy, Tensor& dx) override;

  // ---- U-Net ops ----
  void upsample_bilinear2x_fwd(const Tensor& x, Tensor& y) override;
  void upsample_bilinear2x_bwd(const Tensor& dy, Tensor& dx) override;
  void concat_channels(const Tensor& a, const Tensor& b, Tensor& y) override;
  void split_channels(const Tensor& dy, Tensor& da, Tensor& db) override;
  void softmax_dice(const Tensor& logits, const Tensor& labels, float smooth, float grad_scale,
                    Tensor& loss, Tensor& dlogits) override;

  void softmax_xent(const Tensor& logits, const Tensor& labels, float label_smoothing,
                    float grad_scale, Tensor& losses, Tensor& dlogits) override;

  // ---- GPT ops ----
  void layernorm_fwd(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                     Tensor& mean, Tensor& rstd, float eps) override;
  void add_layernorm_fwd(const Tensor& a, const Tensor& b, Tensor& h, const Tensor& gamma, const Tensor& beta,
                         Tensor& y, Tensor& mean, Tensor& rstd, float eps) override;
  void layernorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                     const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta,
                     bool accumulate,
                     bool accumulate_dx) override;
  void gelu_fwd(const Tensor& x, Tensor& y) override;
  void gelu_bwd(const Tensor& x, const Tensor& dy, Tensor& dx) override;
  void embedding_fwd(const Tensor& ids, const Tensor& wte, const Tensor& wpe, Tensor& y) override;
  void embedding_bwd(const Tensor& dy, const Tensor& ids, Tensor& dwte, Tensor& dwpe,
                     bool accumulate) override;
  // bf16/f16 with a head size flash_attn.cu handles, on sm_80+: flash attention saving the
  // LSE [B,H,T] f32; otherwise cuBLASLt batched GEMMs around the causal softmax saving the
  // probabilities [B,H,T,T] (as the CPU).
  AttentionSaved attention_saved(int64_t B, int64_t H, int64_t T, int64_t hs,
                                 DType qkv_dtype) const override;
  void attention_fwd(const Tensor& qkv, Tensor& out, Tensor& saved, int n_head, int n_kv_head,
                     const Tensor& doc_pos) override;
  void attention_decode(const Tensor& qkv, Tensor& kcache, Tensor& vcache, int64_t pos,
                        Tensor& out, int n_head, int n_kv_head) override;
  void attention_bwd(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                     const Tensor& saved, Tensor& dqkv, int n_head, int n_kv_head,
                     const Tensor& doc_pos) override;
  void softmax_xent_masked(const Tensor& logits, const Tensor& labels, int64_t valid_classes,
                           float grad_scale, Tensor& losses, Tensor& dlogits) override;
  // ---- the Llama family's ops (llama_ops.cpp / .cu) ----
  void rmsnorm_fwd(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) override;
  void add_rmsnorm_fwd(const Tensor& a, const Tensor& b, Tensor& h, const Tensor& weight, Tensor& y, Tensor& rstd,
                       float eps) override;
  void rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd, Tensor& dx,
                   Tensor& dweight, bool accumulate, bool accumulate_dx) override;
  void rope_fwd(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions, int rot_heads,
                Tensor& y) override;
  void rope_bwd(const Tensor& dy, const Tensor& cos, const Tensor& sin, const Tensor& positions, int rot_heads,
                Tensor& dx) override;
  void swiglu_fwd(const Tensor& gu, Tensor& y) override;
  void swiglu_bwd(const Tensor& gu, const Tensor& dy, Tensor& dgu) override;
  // ---- mixture of experts (moe moe_ops.cpp / .cu) ----
  void moe_route_fwd(const Tensor& logits, int top_k, bool norm_topk, int64_t capacity, Tensor& probs, Tensor& lse,
                     Tensor& sel, Tensor& weights, Tensor& counts, Tensor& order, Tensor& pos, Tensor& stats) override;
  void moe_route_bwd(const Tensor& probs, const Tensor& lse, const Tensor& sel, const Tensor& weights,
                     const Tensor& dweights, const Tensor& paux, float zscale, bool norm_topk,
                     Tensor& dlogits) override;
  void moe_gather(const Tensor& x, const Tensor& order, int top_k, Tensor& y) override;
  void moe_combine(const Tensor& ye, const Tensor& pos, const Tensor& weights, int top_k, Tensor& y,
                   bool accumulate) override;
  void moe_combine_bwd(const Tensor& dy, const Tensor& ye, const Tensor& pos, const Tensor& weights, int top_k,
                       Tensor& dye, Tensor& dweights) override;
  // vocabulary-parallel cross-entropy (vocab_xent.cpp / .cu)
  void vocab_xent_max(const Tensor& logits, int64_t valid, Tensor& mx) override;
  void vocab_xent_parts(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid, int64_t classes,
                        const Tensor& gmax, Tensor& parts) override;
  void vocab_xent_finish(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                         const Tensor& gmax, const Tensor& sums, float grad_scale, Tensor& losses,
                         Tensor& dlogits) override;

  void sgd_step(Tensor& params, const Tensor& grads, Tensor& momentum_buf,
                const std::vector<ParamSegment>& segments, const SgdArgs& a) override;
  void adamw_step(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                  const std::vector<ParamSegment>& segments, const AdamWArgs& a) override;

 private:
  // gemm.cpp / conv.cpp helpers
  // t: dtype of a and b; tc: dtype of c (t, or f32 for 16-bit inputs with f32 output)
  // epilogue: a cublasLtEpilogue_t; BIAS, GELU_AUX_BIAS and DGELU set their attributes (the
  // pointers are set per call). A plan whose fused epilogue has no algorithm comes back
  // with usable = false (the caller falls back); a plain GEMM without one is a fault.
  GemmPlan& gemm_plan(bool ta, bool tb, int64_t M, int64_t N, int64_t K, DType t, DType tc,
                      const void* a, const void* b, const void* c, int epilogue = 1 /* DEFAULT */);
  // layernorm_fwd, with h = x + res first when res is defined (add_layernorm_fwd)
  void layernorm_fwd_impl(const Tensor& x, const Tensor& res, Tensor& h, const Tensor& gamma, const Tensor& beta,
                          Tensor& y, Tensor& mean, Tensor& rstd, float eps);
  // rmsnorm_fwd, with h = x + res first when res is defined (add_rmsnorm_fwd)
  void rmsnorm_fwd_impl(const Tensor& x, const Tensor& res, Tensor& h, const Tensor& weight, Tensor& y, Tensor& rstd,
                        float eps);
  // rope_fwd (sign 1) and rope_bwd (sign -1)
  void rope_impl(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                 int rot_heads, Tensor& y, float sign);
  // runs a fused-epilogue plan; false (plan marked unusable) when cuBLASLt refuses it
  bool gemm_fused(GemmPlan& plan, float beta, const Tensor& a, const Tensor& b, Tensor& c, const char* op);
  void set_plan_pointer(GemmPlan& plan, int attr, const void* p, const char* op);  // a cuBLASLt pointer attribute
  // One cublasLtMatmul of a cached plan: d = alpha * op(a) op(b) + beta * c (+ its epilogue);
  // returns the status (the caller checks it, or falls back where a fused epilogue is refused).
  cublasStatus_t gemm_run(GemmPlan& plan, float alpha, const Tensor& a, const Tensor& b, float beta,
                          Tensor& c);
  ConvPlan& conv_plan(int kind, const Tensor& x, const Tensor& w, const Tensor& y,
                      const Conv2dParams& p);
  void* conv_workspace(size_t bytes);
  void conv_fwd_beta(const Tensor& x, const Tensor& w, Tensor& y, const Conv2dParams& p, float beta);
  // w [O,KH,KW,ca+cb] split along its input channels into cat_ws_
  std::pair<Tensor, Tensor> split_filter(const Tensor& w, int64_t ca, int64_t cb);
  // optim: upload the segment table when it changed; returns the virtual length
  int64_t upload_segments(const std::vector<ParamSegment>& segs, int64_t buffer_len,
                          const char* op);

  bool use_flash(DType t, int64_t hs) const;  // attention: flash kernels or probabilities

  int dev_;
  int cc_major_ = 0;  // compute capability (flash attention needs 8+)
  bool allow_tf32_ = false;
  CudaUnfused unfused_;  // DTRAIN_CUDA_UNFUSED (backend/unfused.h)
  bool cudnn_benchmark_ = false;
  bool capturing_ = false;  // between capture_begin and capture_end (event timers read it)
  bool find_failed_ = false;  // cudnnFind* failed once: heuristics from then on (warned once)
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Stream> compute_wrap_;  // compute_stream(): stream_ as a Stream
  cublasLtHandle_t lt_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  CudaAllocator alloc_;
  int64_t allocs_ = 0, frees_ = 0;  // calls to alloc()/free() through the Backend interface
  DeviceScratch gemm_ws_, conv_ws_, scratch_, segs_dev_;
  DeviceScratch cat_ws_;  // conv2d_*_cat: split filters and their gradients
  DeviceScratch mixed_ws_;  // 16-bit filter gradient + its f32 widening (mixed precision)
  double* reduce_dev_ = nullptr;   // kReduceBlocks partials + 1 result (+ flag)
  void* host_pinned_ = nullptr;    // 16 bytes pinned: results of reductions
  // host_copy.cpp: made at the first asynchronous copy, released by release_copy_streams()
  static constexpr int kCopyEvents = 64;
  uint64_t copy_async(void* dst, const void* src, size_t bytes, bool to_host);
  void release_copy_streams();
  cudaStream_t copy_streams_[2] = {nullptr, nullptr};  // device->host, host->device
  cudaEvent_t compute_ev_ = nullptr, join_ev_[2] = {nullptr, nullptr};
  std::vector<cudaEvent_t> copy_events_;  // ticket t is copy_events_[t % kCopyEvents]
  uint64_t copies_issued_ = 0;
  int64_t host_allocs_ = 0, host_frees_ = 0;  // cudaHostAlloc / cudaFreeHost of alloc_host
  std::vector<ParamSegment> segs_host_;
  int64_t segs_total_ = 0;
  int nsegs_dev_ = 0;
  bool segs_uploaded_ = false;
  std::unordered_map<std::string, std::unique_ptr<GemmPlan>> gemm_plans_;
  std::unordered_map<std::string, std::unique_ptr<ConvPlan>> conv_plans_;
  size_t gemm_ws_bytes_ = size_t(32) << 20;
};

}  // namespace dtrain

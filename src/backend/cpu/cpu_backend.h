#pragma once
// CpuBackend: the reference backend and the CPU fast path.
//  * memory: 256-byte aligned host allocations; copies are memcpy.
//  * GEMM through OpenBLAS (cblas_sgemm, row-major).
//  * convolution through oneDNN (nhwc data; weights reordered from OHWI to the blocked
//    layout the JIT kernel wants; primitives cached per shape) or im2col + sgemm when
//    DTRAIN_CPU_CONV=im2col.
//  * everything else: OpenMP loops with static schedules.
// Determinism: every reduction uses a fixed partition (fixed-size chunks, independent of
// the thread count) whose partials are combined serially in chunk order.
// 16-bit float tensors (bf16/f16) are emulated where supports() says so: they are
// converted to f32 scratch, computed in f32 and converted back.
#include <array>
#include <memory>
#include <vector>

#include "backend/backend.h"

namespace dtrain {

namespace cpu {
struct ConvCache;  // oneDNN engine, stream and per-shape primitives (cpu_conv_dnnl.cpp)
void conv_cache_delete(ConvCache* c);
int64_t conv_cache_plans(const ConvCache& c);  // primitives created (one per shape and kind)
struct ConvCacheDeleter {
  void operator()(ConvCache* c) const { conv_cache_delete(c); }
};

enum class ConvImpl { Dnnl, Im2col };

// Fixed partition for reductions: rows per chunk so that a chunk holds ~kChunkElems values.
constexpr int64_t kChunkElems = 1 << 14;
inline int64_t chunk_rows(int64_t row_len) {
  return row_len >= kChunkElems ? 1 : kChunkElems / (row_len > 0 ? row_len : 1);
}

// Row-major C = alpha*op(A)@op(B) + beta*C through single-threaded OpenBLAS calls on
// per-thread blocks of C (cpu_gemm.cpp).
void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Names for messages.
const char* op_name(Op op);

// y[N] (+)= sum over rows of x[M,N], with the fixed chunk partition, accumulated in double;
// `partials` holds sum_rows_partials(M, N) doubles (scratch64 slot 3 by convention).
int64_t sum_rows_partials(int64_t M, int64_t N);
void sum_rows_f32(const float* x, int64_t M, int64_t N, float* y, bool accumulate,
                  double* partials);
}  // namespace cpu

class CpuBackend : public Backend {  // not final: tests derive test doubles (tests/session/test_step_graph.cpp)
 public:
  explicit CpuBackend(int threads);
  ~CpuBackend() override;
  Device device() const override { return Device::cpu(); }
  std::string name() const override;
  bool supports(Op op, DType t) const override;
  int threads() const { return threads_; }
  cpu::ConvImpl conv_impl() const { return conv_impl_; }
  void set_conv_impl(cpu::ConvImpl c) { conv_impl_ = c; }  // tests and benchmarks
  // oneDNN implementation names of the last conv primitives created (fwd, bwd data, bwd
  // filter), for benchmarks; empty before the first.
  std::string dnnl_impl_info();

  // memory
  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void copy_from_host(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void copy_device(void* dst, const void* src, size_t bytes) override;
  void synchronize() override {}
  // allocs/frees: this interface (one aligned_alloc/free each); internal: scratch growth and
  // oneDNN convolution primitives created (one per shape and kind; they hold memory).
  AllocCounts alloc_counts() const override;

  // elementwise, reductions
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
  void add_bias(Tensor& y, const Tensor& bias) override;

  void conv2d_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                  const Conv2dParams& p) override;
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
  void layernorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                     const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta,
                     bool accumulate,
                     bool accumulate_dx) override;
  void gelu_fwd(const Tensor& x, Tensor& y) override;
  void gelu_bwd(const Tensor& x, const Tensor& dy, Tensor& dx) override;
  void embedding_fwd(const Tensor& ids, const Tensor& wte, const Tensor& wpe, Tensor& y) override;
  void embedding_bwd(const Tensor& dy, const Tensor& ids, Tensor& dwte, Tensor& dwpe,
                     bool accumulate) override;
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
  // ---- the Llama family's ops (cpu_llama.cpp) ----
  void rmsnorm_fwd(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) override;
  void rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd, Tensor& dx,
                   Tensor& dweight, bool accumulate, bool accumulate_dx) override;
  void rope_fwd(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions, int rot_heads,
                Tensor& y) override;
  void rope_bwd(const Tensor& dy, const Tensor& cos, const Tensor& sin, const Tensor& positions, int rot_heads,
                Tensor& dx) override;
  void swiglu_fwd(const Tensor& gu, Tensor& y) override;
  void swiglu_bwd(const Tensor& gu, const Tensor& dy, Tensor& dgu) override;
  // ---- mixture of experts (moe cpu_moe.cpp) ----
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

  // ---- helpers shared by the cpu_*.cpp files ----
  // Throws RuntimeFault naming the op and dtype unless supports(op, t.dtype).
  void require(Op op, const Tensor& t) const;
  template <typename... T>
  void require_all(Op op, const T&... ts) const {
    (require(op, ts), ...);
  }
  // Scratch f32 memory (grown on demand, kept: the steady state allocates nothing).
  // Slots 0..kScratchSlots-1 are independent; an op must not use one slot twice.
  static constexpr int kScratchSlots = 12;
  float* scratch(int slot, int64_t n);
  void apply_epilogue(const char* op, const BnEpilogue& ep, const Tensor& y, float* py);
  double* scratch64(int slot, int64_t n);  // slots 0..3, independent of scratch()
  // An f32 view of a float tensor: the tensor itself when f32, else converted into a
  // scratch slot. Output views: `store()` converts back when the tensor is 16-bit.
  const float* in_f32(const Tensor& t, int slot);
  float* out_f32(const Tensor& t, int slot, bool load_old);
  void store_f32(const float* src, const Tensor& t);
  // acc += v, v [acc.numel()] an op's f32 result: v is rounded to acc's dtype (as storing
  // the op's output would), then add() sums, so the result is bit-identical to the op into
  // a temporary followed by add(acc, tmp, acc). Uses scratch `slot` and add()'s slots 0..2.
  void add_rounded(const float* v, Tensor& acc, int slot);

 private:
  void conv_im2col_fwd(const float* x, const float* w, const float* b, float* y, const Tensor& xt,
                       const Tensor& wt, const Tensor& yt, const Conv2dParams& p);
  void conv_im2col_bwd_data(const float* dy, const float* w, float* dx, const Tensor& dyt,
                            const Tensor& wt, const Tensor& dxt, const Conv2dParams& p);
  void conv_im2col_bwd_filter(const float* x, const float* dy, float* dw, const Tensor& xt,
                              const Tensor& dyt, const Tensor& dwt, const Conv2dParams& p,
                              bool accumulate);
  cpu::ConvCache& dnnl_cache();

  int threads_ = 1;
  cpu::ConvImpl conv_impl_ = cpu::ConvImpl::Dnnl;
  std::array<std::vector<float>, kScratchSlots> scratch_;
  std::array<std::vector<double>, 4> scratch64_;
  AllocCounts counts_;
  std::unique_ptr<cpu::ConvCache, cpu::ConvCacheDeleter> conv_cache_;
};

std::unique_ptr<Backend> make_cpu_backend(int threads);

}  // namespace dtrain

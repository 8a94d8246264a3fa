#pragma once
// CheckedBackend: a backend that runs every op on another one and first declares, on that
// backend's compute stream, what the op reads and writes (backend/stream_check.h): what its
// signature says (`pass`: a const Tensor& is read, a Tensor& written), or, where the op touches
// more or other memory (the batch norms' epilogue tensors, raw pointers), the accesses its
// wrapper lists. make_backend wraps a backend in it under DTRAIN_STREAM_CHECK=1.
// Host-bound results (copy_to_host, sum, sum_squares, all_finite, synchronize) make the host
// wait for the compute stream; the asynchronous host copies run on two logical copy streams
// ordered after the compute work issued so far, and copy_wait / copy_join add their edges.
#include <array>
#include <memory>
#include <type_traits>

#include "backend/backend.h"

namespace dtrain {

class CheckedBackend final : public Backend {
 public:
  // `inner` gets `checker` too (its streams report to it).
  CheckedBackend(std::unique_ptr<Backend> inner, std::shared_ptr<StreamChecker> checker);
  ~CheckedBackend() override;
  Backend& inner() { return *inner_; }

  Device device() const override { return inner_->device(); }
  std::string name() const override { return inner_->name(); }
  bool supports(Op op, DType t) const override { return inner_->supports(op, t); }

  void* alloc(size_t bytes) override { return inner_->alloc(bytes); }
  void free(void* p) override { inner_->free(p); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void copy_device(void* dst, const void* src, size_t bytes) override;
  void synchronize() override;
  AllocCounts alloc_counts() const override { return inner_->alloc_counts(); }
  void* alloc_host(size_t bytes) override;
  void free_host(void* p) override { inner_->free_host(p); }
  uint64_t copy_to_host_async(void* dst, const void* src, size_t bytes) override;
  uint64_t copy_from_host_async(void* dst, const void* src, size_t bytes) override;
  void copy_wait(uint64_t ticket) override;
  void copy_join() override;

  Stream& compute_stream() override { return inner_->compute_stream(); }
  std::unique_ptr<Stream> make_stream(const std::string& name) override { return inner_->make_stream(name); }
  void set_stream_checker(std::shared_ptr<StreamChecker> c) override;

  std::unique_ptr<EventTimer> make_event_timer() override;
  void profiler_range(bool start) override { inner_->profiler_range(start); }
  bool can_capture() const override { return inner_->can_capture(); }
  void capture_begin() override { inner_->capture_begin(); }
  std::unique_ptr<DeviceGraph> capture_end() override { return inner_->capture_end(); }
  void capture_abort() override { inner_->capture_abort(); }

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
  void gemm_bias(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& bias,
                 Tensor& c) override;
  void gemm_bias_gelu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& bias,
                      Tensor& pre, Tensor& c) override;
  void gemm_dgelu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& pre,
                  Tensor& c) override;
  void linear_wgrad(const Tensor& dy, const Tensor& x, bool in_out, Tensor& dw, Tensor& dbias) override;

  void conv2d_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y, const Conv2dParams& p) override;
  void conv2d_bwd_data(const Tensor& dy, const Tensor& w, Tensor& dx, const Conv2dParams& p,
                       bool accumulate) override;
  void conv2d_bwd_filter(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& dbias, const Conv2dParams& p,
                         bool accumulate) override;
  void conv2d_fwd_cat(const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y, const Conv2dParams& p) override;
  void conv2d_bwd_data_cat(const Tensor& dy, const Tensor& w, Tensor& da, Tensor& db,
                           const Conv2dParams& p) override;
  void conv2d_bwd_filter_cat(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& dw,
                             const Conv2dParams& p, bool accumulate) override;

  void batchnorm_fwd_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                           Tensor& running_mean, Tensor& running_var, Tensor& save_mean, Tensor& save_invstd,
                           float momentum, float eps, const BnEpilogue& ep) override;
  void batchnorm_fwd_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                          const Tensor& running_var, Tensor& y, float eps, const BnEpilogue& ep) override;
  void batchnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                     const Tensor& save_invstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta, bool accumulate,
                     const BnReluBwd& relu) override;

  void relu_fwd(const Tensor& x, Tensor& y) override;
  void relu_bwd(const Tensor& y, const Tensor& dy, Tensor& dx) override;
  void maxpool2d_fwd(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p) override;
  void maxpool2d_bwd(const Tensor& argmax, const Tensor& dy, Tensor& dx, const Pool2dParams& p,
                     bool accumulate) override;
  void avgpool2d_fwd(const Tensor& x, Tensor& y, const Pool2dParams& p) override;
  void avgpool2d_bwd(const Tensor& dy, Tensor& dx, const Pool2dParams& p) override;
  void global_avgpool_fwd(const Tensor& x, Tensor& y) override;
  void global_avgpool_bwd(const Tensor& dy, Tensor& dx) override;

  void upsample_bilinear2x_fwd(const Tensor& x, Tensor& y) override;
  void upsample_bilinear2x_bwd(const Tensor& dy, Tensor& dx) override;
  void concat_channels(const Tensor& a, const Tensor& b, Tensor& y) override;
  void split_channels(const Tensor& dy, Tensor& da, Tensor& db) override;
  void softmax_dice(const Tensor& logits, const Tensor& labels, float smooth, float grad_scale, Tensor& loss,
                    Tensor& dlogits) override;
  void softmax_xent(const Tensor& logits, const Tensor& labels, float label_smoothing, float grad_scale,
                    Tensor& losses, Tensor& dlogits) override;

  void layernorm_fwd(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y, Tensor& mean,
                     Tensor& rstd, float eps) override;
  void add_layernorm_fwd(const Tensor& a, const Tensor& b, Tensor& h, const Tensor& gamma, const Tensor& beta,
                         Tensor& y, Tensor& mean, Tensor& rstd, float eps) override;
  void layernorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                     const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta, bool accumulate,
                     bool accumulate_dx) override;
  void gelu_fwd(const Tensor& x, Tensor& y) override;
  void gelu_bwd(const Tensor& x, const Tensor& dy, Tensor& dx) override;
  void embedding_fwd(const Tensor& ids, const Tensor& wte, const Tensor& wpe, Tensor& y) override;
  void embedding_bwd(const Tensor& dy, const Tensor& ids, Tensor& dwte, Tensor& dwpe, bool accumulate) override;
  AttentionSaved attention_saved(int64_t B, int64_t H, int64_t T, int64_t hs, DType qkv_dtype) const override {
    return inner_->attention_saved(B, H, T, hs, qkv_dtype);
  }
  void attention_fwd(const Tensor& qkv, Tensor& out, Tensor& saved, int n_head, int n_kv_head,
                     const Tensor& doc_pos) override;
  void attention_bwd(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& saved, Tensor& dqkv,
                     int n_head, int n_kv_head, const Tensor& doc_pos) override;
  void attention_decode(const Tensor& qkv, Tensor& kcache, Tensor& vcache, int64_t pos, Tensor& out,
                        int n_head, int n_kv_head) override;
  void softmax_xent_masked(const Tensor& logits, const Tensor& labels, int64_t valid_classes, float grad_scale,
                           Tensor& losses, Tensor& dlogits) override;

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
  // ---- mixture of experts (moe checked) ----
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

  void vocab_xent_max(const Tensor& logits, int64_t valid, Tensor& mx) override;
  void vocab_xent_parts(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid, int64_t classes,
                        const Tensor& gmax, Tensor& parts) override;
  void vocab_xent_finish(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                         const Tensor& gmax, const Tensor& sums, float grad_scale, Tensor& losses,
                         Tensor& dlogits) override;

  void sgd_step(Tensor& params, const Tensor& grads, Tensor& momentum_buf, const std::vector<ParamSegment>& segments,
                const SgdArgs& a) override;
  void adamw_step(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                  const std::vector<ParamSegment>& segments, const AdamWArgs& a) override;

 private:
  void on(const char* op, std::initializer_list<MemAccess> acc);  // declared on the compute stream
  // An op whose accesses follow from its signature (most of them): each const Tensor& argument is
  // read and each Tensor& argument written; declared, then run on the inner backend.
  template <typename... P>
  void pass(const char* op, void (Backend::*fn)(P...), std::type_identity_t<P>... args);
  void to_host();                                                  // the host waits for the compute stream
  uint64_t copy_async(bool to_host, void* dst, const void* src, size_t bytes);

  std::unique_ptr<Backend> inner_;
  std::unique_ptr<Stream> d2h_, h2d_;  // the copy streams (logical)
  // this backend's tickets (1, 2, ...): the inner backend's ticket and the mark after the copy
  // of each recent one, by ticket % kTickets
  static constexpr size_t kTickets = 64;
  struct Ticket {
    uint64_t inner = 0;
    StreamMark mark;
  };
  std::array<Ticket, kTickets> tickets_;
  uint64_t next_ticket_ = 1;
};

}  // namespace dtrain

#include "backend/checked_backend.h"

#include "backend/event_timer.h"
#include "core/error.h"

namespace dtrain {

CheckedBackend::CheckedBackend(std::unique_ptr<Backend> inner, std::shared_ptr<StreamChecker> checker)
    : inner_(std::move(inner)) {
  DTRAIN_CHECK(inner_ && checker, "CheckedBackend needs a backend and a checker");
  set_stream_checker(std::move(checker));
}

CheckedBackend::~CheckedBackend() = default;

void CheckedBackend::set_stream_checker(std::shared_ptr<StreamChecker> c) {
  inner_->set_stream_checker(c);
  Backend::set_stream_checker(c);
  d2h_ = std::make_unique<Stream>("copy device->host", c);
  h2d_ = std::make_unique<Stream>("copy host->device", c);
}

std::unique_ptr<EventTimer> CheckedBackend::make_event_timer() { return inner_->make_event_timer(); }

void CheckedBackend::on(const char* op, std::initializer_list<MemAccess> acc) {
  compute_stream().issue(op, std::vector<MemAccess>(acc));
}

namespace {
// Argument `arg` of parameter type P: a const Tensor& is read, a Tensor& written.
template <typename P, typename A>
void add_access(std::vector<MemAccess>& acc, const A& arg, bool writing) {
  if constexpr (std::is_same_v<P, const Tensor&>) {
    if (!writing) acc.push_back(reads(arg));
  } else if constexpr (std::is_same_v<P, Tensor&>) {
    if (writing) acc.push_back(writes(arg));
  }
}
}  // namespace

template <typename... P>
void CheckedBackend::pass(const char* op, void (Backend::*fn)(P...), std::type_identity_t<P>... args) {
  std::vector<MemAccess> acc;
  (add_access<P>(acc, args, false), ...);  // the reads, then the writes, each in argument order
  (add_access<P>(acc, args, true), ...);
  compute_stream().issue(op, std::move(acc));
  (inner_.get()->*fn)(std::forward<P>(args)...);
}

void CheckedBackend::to_host() { compute_stream().synchronize(); }

// ---- memory ----
void CheckedBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  on("copy_from_host", {writes(dst, bytes)});
  inner_->copy_from_host(dst, src, bytes);
}
void CheckedBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  on("copy_to_host", {reads(src, bytes), writes(dst, bytes)});
  inner_->copy_to_host(dst, src, bytes);
  to_host();
}
void CheckedBackend::copy_device(void* dst, const void* src, size_t bytes) {
  if (dst != src) on("copy_device", {reads(src, bytes), writes(dst, bytes)});
  inner_->copy_device(dst, src, bytes);
}
void CheckedBackend::synchronize() {
  inner_->synchronize();
  to_host();
}
void* CheckedBackend::alloc_host(size_t bytes) {
  void* p = inner_->alloc_host(bytes);
  if (checker_) checker_->forget(p, bytes);  // fresh host memory has no history
  return p;
}

uint64_t CheckedBackend::copy_async(bool to_host, void* dst, const void* src, size_t bytes) {
  Stream& s = to_host ? *d2h_ : *h2d_;
  s.wait_for(compute_stream());  // each copy is ordered after the compute work issued so far
  Ticket t;
  t.mark = s.issue(to_host ? "copy_to_host_async" : "copy_from_host_async", {reads(src, bytes), writes(dst, bytes)});
  t.inner = to_host ? inner_->copy_to_host_async(dst, src, bytes) : inner_->copy_from_host_async(dst, src, bytes);
  const uint64_t id = next_ticket_++;
  tickets_[id % kTickets] = std::move(t);
  return id;
}
uint64_t CheckedBackend::copy_to_host_async(void* dst, const void* src, size_t bytes) {
  return copy_async(true, dst, src, bytes);
}
uint64_t CheckedBackend::copy_from_host_async(void* dst, const void* src, size_t bytes) {
  return copy_async(false, dst, src, bytes);
}
void CheckedBackend::copy_wait(uint64_t ticket) {
  DTRAIN_CHECK(ticket > 0 && ticket < next_ticket_ && next_ticket_ - ticket <= kTickets,
               "copy_wait: ticket {} is not one of the latest {} (next {})", ticket, kTickets, next_ticket_);
  const Ticket& t = tickets_[ticket % kTickets];
  inner_->copy_wait(t.inner);
  t.mark.host_wait();
}
void CheckedBackend::copy_join() {
  inner_->copy_join();
  compute_stream().wait_for(*d2h_);
  compute_stream().wait_for(*h2d_);
}

// ---- elementwise, reductions ----
void CheckedBackend::fill(Tensor& y, float value) { pass("fill", &Backend::fill, y, value); }
void CheckedBackend::copy(const Tensor& x, Tensor& y) { pass("copy", &Backend::copy, x, y); }
void CheckedBackend::cast(const Tensor& x, Tensor& y) { pass("cast", &Backend::cast, x, y); }
void CheckedBackend::add(const Tensor& a, const Tensor& b, Tensor& y) { pass("add", &Backend::add, a, b, y); }
void CheckedBackend::axpby(float alpha, const Tensor& x, float beta, Tensor& y) {
  pass("axpby", &Backend::axpby, alpha, x, beta, y);
}
void CheckedBackend::scale(Tensor& y, float s) { pass("scale", &Backend::scale, y, s); }
double CheckedBackend::sum_squares(const Tensor& x) {
  on("sum_squares", {reads(x)});
  const double v = inner_->sum_squares(x);
  to_host();
  return v;
}
double CheckedBackend::sum(const Tensor& x) {
  on("sum", {reads(x)});
  const double v = inner_->sum(x);
  to_host();
  return v;
}
void CheckedBackend::sum_into(const Tensor& x, double scale, Tensor& acc, bool accumulate) {
  pass("sum_into", &Backend::sum_into, x, scale, acc, accumulate);
}
void CheckedBackend::sum_rows(const Tensor& x, Tensor& y, bool accumulate) {
  pass("sum_rows", &Backend::sum_rows, x, y, accumulate);
}
bool CheckedBackend::all_finite(const Tensor& x) {
  on("all_finite", {reads(x)});
  const bool v = inner_->all_finite(x);
  to_host();
  return v;
}

// ---- matrix multiply ----
void CheckedBackend::gemm(bool ta, bool tb, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  pass("gemm", &Backend::gemm, ta, tb, alpha, a, b, beta, c);
}
void CheckedBackend::add_bias(Tensor& y, const Tensor& bias) { pass("add_bias", &Backend::add_bias, y, bias); }
void CheckedBackend::gemm_bias(bool ta, bool tb, const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& c) {
  pass("gemm_bias", &Backend::gemm_bias, ta, tb, a, b, bias, c);
}
void CheckedBackend::gemm_bias_gelu(bool ta, bool tb, const Tensor& a, const Tensor& b, const Tensor& bias,
                                    Tensor& pre, Tensor& c) {
  pass("gemm_bias_gelu", &Backend::gemm_bias_gelu, ta, tb, a, b, bias, pre, c);
}
void CheckedBackend::gemm_dgelu(bool ta, bool tb, const Tensor& a, const Tensor& b, const Tensor& pre, Tensor& c) {
  pass("gemm_dgelu", &Backend::gemm_dgelu, ta, tb, a, b, pre, c);
}
void CheckedBackend::linear_wgrad(const Tensor& dy, const Tensor& x, bool in_out, Tensor& dw, Tensor& dbias) {
  pass("linear_wgrad", &Backend::linear_wgrad, dy, x, in_out, dw, dbias);
}

// ---- convolution ----
void CheckedBackend::conv2d_fwd(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                                const Conv2dParams& p) {
  pass("conv2d_fwd", &Backend::conv2d_fwd, x, w, bias, y, p);
}
void CheckedBackend::conv2d_bwd_data(const Tensor& dy, const Tensor& w, Tensor& dx, const Conv2dParams& p,
                                     bool accumulate) {
  pass("conv2d_bwd_data", &Backend::conv2d_bwd_data, dy, w, dx, p, accumulate);
}
void CheckedBackend::conv2d_bwd_filter(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& dbias,
                                       const Conv2dParams& p, bool accumulate) {
  pass("conv2d_bwd_filter", &Backend::conv2d_bwd_filter, x, dy, dw, dbias, p, accumulate);
}
void CheckedBackend::conv2d_fwd_cat(const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y,
                                    const Conv2dParams& p) {
  pass("conv2d_fwd_cat", &Backend::conv2d_fwd_cat, a, b, w, y, p);
}
void CheckedBackend::conv2d_bwd_data_cat(const Tensor& dy, const Tensor& w, Tensor& da, Tensor& db,
                                         const Conv2dParams& p) {
  pass("conv2d_bwd_data_cat", &Backend::conv2d_bwd_data_cat, dy, w, da, db, p);
}
void CheckedBackend::conv2d_bwd_filter_cat(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& dw,
                                           const Conv2dParams& p, bool accumulate) {
  pass("conv2d_bwd_filter_cat", &Backend::conv2d_bwd_filter_cat, a, b, dy, dw, p, accumulate);
}

// ---- batch norm ----
void CheckedBackend::batchnorm_fwd_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                                         Tensor& running_mean, Tensor& running_var, Tensor& save_mean,
                                         Tensor& save_invstd, float momentum, float eps, const BnEpilogue& ep) {
  on("batchnorm_fwd_train", {reads(x), reads(gamma), reads(beta), reads(ep.residual), writes(y),
                             writes(running_mean), writes(running_var), writes(save_mean), writes(save_invstd)});
  inner_->batchnorm_fwd_train(x, gamma, beta, y, running_mean, running_var, save_mean, save_invstd, momentum, eps,
                              ep);
}
void CheckedBackend::batchnorm_fwd_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                        const Tensor& running_mean, const Tensor& running_var, Tensor& y, float eps,
                                        const BnEpilogue& ep) {
  on("batchnorm_fwd_eval", {reads(x), reads(gamma), reads(beta), reads(running_mean), reads(running_var),
                            reads(ep.residual), writes(y)});
  inner_->batchnorm_fwd_eval(x, gamma, beta, running_mean, running_var, y, eps, ep);
}
void CheckedBackend::batchnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                                   const Tensor& save_invstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta,
                                   bool accumulate, const BnReluBwd& relu) {
  on("batchnorm_bwd", {reads(dy), reads(x), reads(gamma), reads(save_mean), reads(save_invstd), reads(relu.y),
                       reads(relu.beta), writes(dx), writes(dgamma), writes(dbeta), writes(relu.dy_masked)});
  inner_->batchnorm_bwd(dy, x, gamma, save_mean, save_invstd, dx, dgamma, dbeta, accumulate, relu);
}

// ---- activations, pooling, U-Net ----
void CheckedBackend::relu_fwd(const Tensor& x, Tensor& y) { pass("relu_fwd", &Backend::relu_fwd, x, y); }
void CheckedBackend::relu_bwd(const Tensor& y, const Tensor& dy, Tensor& dx) {
  pass("relu_bwd", &Backend::relu_bwd, y, dy, dx);
}
void CheckedBackend::maxpool2d_fwd(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p) {
  pass("maxpool2d_fwd", &Backend::maxpool2d_fwd, x, y, argmax, p);
}
void CheckedBackend::maxpool2d_bwd(const Tensor& argmax, const Tensor& dy, Tensor& dx, const Pool2dParams& p,
                                   bool accumulate) {
  pass("maxpool2d_bwd", &Backend::maxpool2d_bwd, argmax, dy, dx, p, accumulate);
}
void CheckedBackend::avgpool2d_fwd(const Tensor& x, Tensor& y, const Pool2dParams& p) {
  pass("avgpool2d_fwd", &Backend::avgpool2d_fwd, x, y, p);
}
void CheckedBackend::avgpool2d_bwd(const Tensor& dy, Tensor& dx, const Pool2dParams& p) {
  pass("avgpool2d_bwd", &Backend::avgpool2d_bwd, dy, dx, p);
}
void CheckedBackend::global_avgpool_fwd(const Tensor& x, Tensor& y) {
  pass("global_avgpool_fwd", &Backend::global_avgpool_fwd, x, y);
}
void CheckedBackend::global_avgpool_bwd(const Tensor& dy, Tensor& dx) {
  pass("global_avgpool_bwd", &Backend::global_avgpool_bwd, dy, dx);
}
void CheckedBackend::upsample_bilinear2x_fwd(const Tensor& x, Tensor& y) {
  pass("upsample_bilinear2x_fwd", &Backend::upsample_bilinear2x_fwd, x, y);
}
void CheckedBackend::upsample_bilinear2x_bwd(const Tensor& dy, Tensor& dx) {
  pass("upsample_bilinear2x_bwd", &Backend::upsample_bilinear2x_bwd, dy, dx);
}
void CheckedBackend::concat_channels(const Tensor& a, const Tensor& b, Tensor& y) {
  pass("concat_channels", &Backend::concat_channels, a, b, y);
}
void CheckedBackend::split_channels(const Tensor& dy, Tensor& da, Tensor& db) {
  pass("split_channels", &Backend::split_channels, dy, da, db);
}
void CheckedBackend::softmax_dice(const Tensor& logits, const Tensor& labels, float smooth, float grad_scale,
                                  Tensor& loss, Tensor& dlogits) {
  pass("softmax_dice", &Backend::softmax_dice, logits, labels, smooth, grad_scale, loss, dlogits);
}
void CheckedBackend::softmax_xent(const Tensor& logits, const Tensor& labels, float label_smoothing,
                                  float grad_scale, Tensor& losses, Tensor& dlogits) {
  pass("softmax_xent", &Backend::softmax_xent, logits, labels, label_smoothing, grad_scale, losses, dlogits);
}

// ---- GPT ----
void CheckedBackend::layernorm_fwd(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                                   Tensor& mean, Tensor& rstd, float eps) {
  pass("layernorm_fwd", &Backend::layernorm_fwd, x, gamma, beta, y, mean, rstd, eps);
}
void CheckedBackend::add_layernorm_fwd(const Tensor& a, const Tensor& b, Tensor& h, const Tensor& gamma,
                                       const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd, float eps) {
  pass("add_layernorm_fwd", &Backend::add_layernorm_fwd, a, b, h, gamma, beta, y, mean, rstd, eps);
}
void CheckedBackend::layernorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                   const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta, bool accumulate,
                                   bool accumulate_dx) {
  pass("layernorm_bwd", &Backend::layernorm_bwd,
       dy, x, gamma, mean, rstd, dx, dgamma, dbeta, accumulate, accumulate_dx);
}
void CheckedBackend::gelu_fwd(const Tensor& x, Tensor& y) { pass("gelu_fwd", &Backend::gelu_fwd, x, y); }
void CheckedBackend::gelu_bwd(const Tensor& x, const Tensor& dy, Tensor& dx) {
  pass("gelu_bwd", &Backend::gelu_bwd, x, dy, dx);
}
void CheckedBackend::embedding_fwd(const Tensor& ids, const Tensor& wte, const Tensor& wpe, Tensor& y) {
  pass("embedding_fwd", &Backend::embedding_fwd, ids, wte, wpe, y);
}
void CheckedBackend::embedding_bwd(const Tensor& dy, const Tensor& ids, Tensor& dwte, Tensor& dwpe,
                                   bool accumulate) {
  pass("embedding_bwd", &Backend::embedding_bwd, dy, ids, dwte, dwpe, accumulate);
}
void CheckedBackend::attention_fwd(const Tensor& qkv, Tensor& out, Tensor& saved, int n_head, int n_kv_head,
                                   const Tensor& doc_pos) {
  pass("attention_fwd", &Backend::attention_fwd, qkv, out, saved, n_head, n_kv_head, doc_pos);
}
void CheckedBackend::attention_bwd(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& saved,
                                   Tensor& dqkv, int n_head, int n_kv_head, const Tensor& doc_pos) {
  pass("attention_bwd", &Backend::attention_bwd, dout, qkv, out, saved, dqkv, n_head, n_kv_head, doc_pos);
}
void CheckedBackend::attention_decode(const Tensor& qkv, Tensor& kcache, Tensor& vcache, int64_t pos, Tensor& out,
                                      int n_head, int n_kv_head) {
  pass("attention_decode", &Backend::attention_decode, qkv, kcache, vcache, pos, out, n_head, n_kv_head);
}
void CheckedBackend::softmax_xent_masked(const Tensor& logits, const Tensor& labels, int64_t valid_classes,
                                         float grad_scale, Tensor& losses, Tensor& dlogits) {
  pass("softmax_xent_masked", &Backend::softmax_xent_masked,
       logits, labels, valid_classes, grad_scale, losses, dlogits);
}

// ---- the Llama family ----
void CheckedBackend::rmsnorm_fwd(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) {
  pass("rmsnorm_fwd", &Backend::rmsnorm_fwd, x, weight, y, rstd, eps);
}
void CheckedBackend::add_rmsnorm_fwd(const Tensor& a, const Tensor& b, Tensor& h, const Tensor& weight, Tensor& y,
                                     Tensor& rstd, float eps) {
  pass("add_rmsnorm_fwd", &Backend::add_rmsnorm_fwd, a, b, h, weight, y, rstd, eps);
}
void CheckedBackend::rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                 Tensor& dx, Tensor& dweight, bool accumulate, bool accumulate_dx) {
  pass("rmsnorm_bwd", &Backend::rmsnorm_bwd, dy, x, weight, rstd, dx, dweight, accumulate, accumulate_dx);
}
void CheckedBackend::rope_fwd(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                              int rot_heads, Tensor& y) {
  pass("rope_fwd", &Backend::rope_fwd, x, cos, sin, positions, rot_heads, y);
}
void CheckedBackend::rope_bwd(const Tensor& dy, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                              int rot_heads, Tensor& dx) {
  pass("rope_bwd", &Backend::rope_bwd, dy, cos, sin, positions, rot_heads, dx);
}
void CheckedBackend::swiglu_fwd(const Tensor& gu, Tensor& y) { pass("swiglu_fwd", &Backend::swiglu_fwd, gu, y); }
void CheckedBackend::swiglu_bwd(const Tensor& gu, const Tensor& dy, Tensor& dgu) {
  pass("swiglu_bwd", &Backend::swiglu_bwd, gu, dy, dgu);
}
void CheckedBackend::moe_route_fwd(const Tensor& logits, int top_k, bool norm_topk, int64_t capacity, Tensor& probs,
                                   Tensor& lse, Tensor& sel, Tensor& weights, Tensor& counts, Tensor& order,
                                   Tensor& pos, Tensor& stats) {
  pass("moe_route_fwd", &Backend::moe_route_fwd, logits, top_k, norm_topk, capacity, probs, lse, sel, weights, counts,
       order, pos, stats);
}
void CheckedBackend::moe_route_bwd(const Tensor& probs, const Tensor& lse, const Tensor& sel, const Tensor& weights,
                                   const Tensor& dweights, const Tensor& paux, float zscale, bool norm_topk,
                                   Tensor& dlogits) {
  pass("moe_route_bwd", &Backend::moe_route_bwd, probs, lse, sel, weights, dweights, paux, zscale, norm_topk, dlogits);
}
void CheckedBackend::moe_gather(const Tensor& x, const Tensor& order, int top_k, Tensor& y) {
  pass("moe_gather", &Backend::moe_gather, x, order, top_k, y);
}
void CheckedBackend::moe_combine(const Tensor& ye, const Tensor& pos, const Tensor& weights, int top_k, Tensor& y,
                                 bool accumulate) {
  pass("moe_combine", &Backend::moe_combine, ye, pos, weights, top_k, y, accumulate);
}
void CheckedBackend::moe_combine_bwd(const Tensor& dy, const Tensor& ye, const Tensor& pos, const Tensor& weights,
                                     int top_k, Tensor& dye, Tensor& dweights) {
  pass("moe_combine_bwd", &Backend::moe_combine_bwd, dy, ye, pos, weights, top_k, dye, dweights);
}

void CheckedBackend::vocab_xent_max(const Tensor& logits, int64_t valid, Tensor& mx) {
  pass("vocab_xent_max", &Backend::vocab_xent_max, logits, valid, mx);
}
void CheckedBackend::vocab_xent_parts(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                      int64_t classes, const Tensor& gmax, Tensor& parts) {
  pass("vocab_xent_parts", &Backend::vocab_xent_parts, logits, labels, offset, valid, classes, gmax, parts);
}
void CheckedBackend::vocab_xent_finish(const Tensor& logits, const Tensor& labels, int64_t offset, int64_t valid,
                                       const Tensor& gmax, const Tensor& sums, float grad_scale, Tensor& losses,
                                       Tensor& dlogits) {
  pass("vocab_xent_finish", &Backend::vocab_xent_finish,
       logits, labels, offset, valid, gmax, sums, grad_scale, losses, dlogits);
}

// ---- optimizers ----
void CheckedBackend::sgd_step(Tensor& params, const Tensor& grads, Tensor& momentum_buf,
                              const std::vector<ParamSegment>& segments, const SgdArgs& a) {
  pass("sgd_step", &Backend::sgd_step, params, grads, momentum_buf, segments, a);
}
void CheckedBackend::adamw_step(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                                const std::vector<ParamSegment>& segments, const AdamWArgs& a) {
  pass("adamw_step", &Backend::adamw_step, params, grads, m, v, segments, a);
}

}  // namespace dtrain

#include "optim/optimizer.h"

#include "optim/offload.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace dtrain {

Optimizer::Optimizer(ParamStore& ps, bool decay_bias_and_norm, FlatRange r, const OffloadOptions& off)
    : ps_(ps), be_(ps.backend()) {
  begin_ = r.begin;
  end_ = r.end < 0 ? ps.num_params() : r.end;
  DTRAIN_CHECK(0 <= begin_ && begin_ <= end_ && end_ <= ps.num_params(),
               "optimizer range [{}, {}) of {} params", begin_, end_, ps.num_params());
  if (ps.sharded()) {
    DTRAIN_CHECK(begin_ == 0 && end_ == ps.num_params(), "optimizer range with sharded parameters");
    pieces_ = ps.shard_pieces();
    local_ = ps.shard_params().numel();
  } else {
    if (end_ > begin_) pieces_.push_back({begin_, 0, end_ - begin_});
    local_ = end_ - begin_;
  }
  for (const FlatPiece& pc : pieces_)
    for (const ParamSegment& s : ps.segments(decay_bias_and_norm)) {
      const int64_t b = std::max(s.offset, pc.global), e = std::min(s.offset + s.count, pc.global + pc.count);
      if (b < e) segs_.push_back({b - pc.global + pc.local, e - b, s.decay});
    }
  if (off.enabled) enable_offload(off);
}

int64_t Optimizer::owned() const {
  int64_t n = 0;
  for (const FlatPiece& p : pieces_) n += p.count;
  return n;
}

void Optimizer::add_state(const std::string& name) {
  State s{name, Buffer(off_ ? host_allocator() : static_cast<Allocator&>(be_), size_t(local_) * 4)};
  states_.push_back(std::move(s));
  Tensor t = state(states_.size() - 1);
  if (!t.numel()) return;
  if (off_)
    std::memset(t.data, 0, t.nbytes());
  else
    be_.fill(t, 0.f);
}

Tensor Optimizer::state(size_t i) const {
  return states_.at(i).buf.tensor(DType::F32, Shape{local_});
}

void Optimizer::run_update(const Update& u) {
  if (off_) return run_offloaded(u);
  Tensor p = params(), g = grads();
  std::vector<Tensor> st;
  for (size_t i = 0; i < states_.size(); ++i) st.push_back(state(i));
  if (p.numel()) u(be_, p, g, st, segs_);
}

void Optimizer::state_to_host(void* dst, const void* src, size_t bytes) const {
  if (off_)
    std::memcpy(dst, src, bytes);
  else
    be_.copy_to_host(dst, src, bytes);
}

void Optimizer::state_from_host(void* dst, const void* src, size_t bytes) {
  if (off_)
    std::memcpy(dst, src, bytes);
  else
    be_.copy_from_host(dst, src, bytes);
}

Tensor Optimizer::params() const {
  return ps_.sharded() ? ps_.shard_params() : ps_.flat_params().slice0(begin_, end_);
}

Tensor Optimizer::grads() const {
  return ps_.sharded() ? ps_.shard_grads() : ps_.flat_grads().slice0(begin_, end_);
}

std::vector<ParamStore::Exported> Optimizer::export_state() const {
  std::vector<ParamStore::Exported> out;
  const int64_t n = owned();
  for (size_t i = 0; i < states_.size(); ++i) {
    ParamStore::Exported x{states_[i].name, "F32", {n}, {}};
    x.bytes.resize(size_t(n) * 4);
    size_t at = 0;
    for (const FlatPiece& p : pieces_) {
      state_to_host(x.bytes.data() + at, static_cast<const float*>(states_[i].buf.data()) + p.local,
                    size_t(p.count) * 4);
      at += size_t(p.count) * 4;
    }
    out.push_back(std::move(x));
  }
  ParamStore::Exported st{"step", "I64", {}, std::vector<uint8_t>(8)};
  std::memcpy(st.bytes.data(), &steps_, 8);
  out.push_back(std::move(st));
  return out;
}

void Optimizer::import_state(const TensorLookup& lookup, const std::string& origin) {
  const int64_t n = owned();
  std::vector<ImportTensor> got;
  for (const State& s : states_) {
    auto t = lookup(s.name);
    if (!t) user_error("{}: optimizer state '{}' is missing (expected F32 [{}])", origin, s.name, n);
    if (t->dtype != "F32" || t->shape != std::vector<int64_t>{n} || t->nbytes != size_t(n) * 4)
      user_error("{}: optimizer state '{}': expected F32 [{}], got {} with {} dims", origin, s.name, n,
                 t->dtype, t->shape.size());
    got.push_back(*t);
  }
  auto st = lookup("step");
  if (!st) user_error("{}: optimizer state 'step' is missing (expected I64 scalar)", origin);
  if (st->dtype != "I64" || !st->shape.empty() || st->nbytes != 8)
    user_error("{}: optimizer state 'step': expected an I64 scalar, got {} with {} dims", origin,
               st->dtype, st->shape.size());
  int64_t steps;
  std::memcpy(&steps, st->data, 8);
  if (steps < 0) user_error("{}: optimizer state 'step': expected >= 0, got {}", origin, steps);
  for (size_t i = 0; i < states_.size(); ++i) {
    size_t at = 0;
    for (const FlatPiece& p : pieces_) {
      state_from_host(static_cast<float*>(states_[i].buf.data()) + p.local, got[i].data + at,
                      size_t(p.count) * 4);
      at += size_t(p.count) * 4;
    }
  }
  steps_ = steps;
}

Sgd::Sgd(ParamStore& ps, const SgdConfig& c, FlatRange range, const OffloadOptions& off)
    : ConfiguredOptimizer(ps, c, range, off) {
  if (c.momentum < 0) user_error("optim.momentum: expected >= 0, got {}", c.momentum);
  if (c.weight_decay < 0) user_error("optim.weight_decay: expected >= 0, got {}", c.weight_decay);
  if (c.nesterov && (c.momentum <= 0 || c.dampening != 0))
    user_error("optim.nesterov: requires momentum > 0 and dampening = 0 (momentum {}, dampening {})",
               c.momentum, c.dampening);
  if (c.momentum > 0) add_state("momentum");
}

void Sgd::step(float lr, float grad_scale) {
  const SgdArgs a{.lr = lr,
                  .momentum = c_.momentum,
                  .dampening = c_.dampening,
                  .weight_decay = c_.weight_decay,
                  .nesterov = c_.nesterov,
                  .first_step = steps_ == 0,
                  .grad_scale = grad_scale};
  run_update([&a](Backend& be, Tensor& p, const Tensor& g, std::vector<Tensor>& st,
                   const std::vector<ParamSegment>& segs) {
    Tensor none;
    be.sgd_step(p, g, st.empty() ? none : st[0], segs, a);
  });
  steps_++;
}

AdamW::AdamW(ParamStore& ps, const AdamWConfig& c, FlatRange range, const OffloadOptions& off)
    : ConfiguredOptimizer(ps, c, range, off) {
  if (!(c.beta1 >= 0 && c.beta1 < 1) || !(c.beta2 >= 0 && c.beta2 < 1))
    user_error("optim.betas: expected values in [0, 1), got [{}, {}]", c.beta1, c.beta2);
  if (!(c.eps > 0)) user_error("optim.eps: expected > 0, got {}", c.eps);
  if (c.weight_decay < 0) user_error("optim.weight_decay: expected >= 0, got {}", c.weight_decay);
  add_state("exp_avg");
  add_state("exp_avg_sq");
}

void AdamW::step(float lr, float grad_scale) {
  const AdamWArgs a{.lr = lr,
                    .beta1 = c_.beta1,
                    .beta2 = c_.beta2,
                    .eps = c_.eps,
                    .weight_decay = c_.weight_decay,
                    .step = steps_ + 1,
                    .grad_scale = grad_scale};
  run_update([&a](Backend& be, Tensor& p, const Tensor& g, std::vector<Tensor>& st,
                   const std::vector<ParamSegment>& segs) { be.adamw_step(p, g, st[0], st[1], segs, a); });
  steps_++;
}

float clip_coef_from_norm(double total_norm, float max_norm) {
  if (max_norm <= 0) return 1.f;
  const double coef = double(max_norm) / (total_norm + 1e-6);
  return (coef < 1.0 || std::isnan(coef)) ? float(coef) : 1.f;  // NaN propagates, as torch.clamp
}

float clip_coef(Backend& be, const Tensor& flat_grads, float max_norm, float* total_norm,
                float grad_scale) {
  const double norm = std::sqrt(be.sum_squares(flat_grads)) * std::fabs(double(grad_scale));
  if (total_norm) *total_norm = float(norm);
  return clip_coef_from_norm(norm, max_norm);
}

}  // namespace dtrain

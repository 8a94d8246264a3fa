#include "nn/moe.h"

#include <cmath>

#include "core/error.h"

namespace dtrain {

int MoeConfig::moe_layers(int n_layer) const {
  int n = 0;
  for (int i = 0; i < n_layer; ++i) n += layer_is_moe(i);
  return n;
}

// ---------------------------------------------------------------- MoeStats
MoeStats::MoeStats(const MoeConfig& c, int moe_layers)
    : e_(c.num_experts),
      layers_(moe_layers),
      aux_coef_(c.aux_loss_coef),
      z_coef_(c.z_loss_coef),
      count_(size_t(c.num_experts), 0.0),
      psum_(size_t(c.num_experts), 0.0),
      paux_(size_t(c.num_experts), 0.f) {
  step_.tokens_per_expert.assign(size_t(e_), 0);
}

void MoeStats::begin_micro() {
  std::fill(count_.begin(), count_.end(), 0.0);
  std::fill(psum_.begin(), psum_.end(), 0.0);
  zsum_ = 0;
  tokens_ = 0;
}

void MoeStats::add_layer(const int32_t* counts, const float* stats, int64_t tokens, int64_t dropped) {
  for (int e = 0; e < e_; ++e) {
    count_[size_t(e)] += counts[e];
    psum_[size_t(e)] += stats[e];
    step_.tokens_per_expert[size_t(e)] += counts[e];
  }
  zsum_ += stats[e_];
  tokens_ += tokens;
  step_.dropped += dropped;
}

// transformers' load_balancing_loss_func over the layers' concatenated router outputs (L N rows):
// aux = E sum_e f_e P_e with f_e = (slots routed to e) / (L N) (its tokens_per_expert summed over
// the k choices) and P_e = (sum of probs[:, e]) / (L N); d aux / d probs[l, n, e] = E f_e / (L N).
// z = mean over the L N rows of lse^2; d z / d logits = 2 lse probs / (L N).
double MoeStats::finish_micro(float grad_scale) {
  if (tokens_ == 0) {  // no MoE layer ran (an evaluation, or a stage without one)
    std::fill(paux_.begin(), paux_.end(), 0.f);
    zscale_ = 0;
    return 0;
  }
  const double ln = double(tokens_);
  double aux = 0;
  for (int e = 0; e < e_; ++e) {
    const double f = count_[size_t(e)] / ln;
    aux += f * (psum_[size_t(e)] / ln);
    paux_[size_t(e)] = float(double(grad_scale) * aux_coef_ * double(e_) * f / ln);
  }
  aux *= double(e_);
  const double z = zsum_ / ln;
  zscale_ = float(double(grad_scale) * z_coef_ / ln);
  step_.aux_loss += aux;
  step_.z_loss += z;
  ++step_.micro_batches;
  return aux_coef_ * aux + z_coef_ * z;
}

MoeStats::Step MoeStats::take_step() {
  Step s = step_;
  if (s.micro_batches > 0) {
    s.aux_loss /= double(s.micro_batches);
    s.z_loss /= double(s.micro_batches);
  }
  step_ = Step{};
  step_.tokens_per_expert.assign(size_t(e_), 0);
  return s;
}

// ---------------------------------------------------------------- MoeMlp
namespace {
LinearOptions router_options(float std) {
  LinearOptions o;
  o.bias = false;
  o.weight_init = Init::Normal;
  o.weight_init_arg = std;
  return o;
}
}  // namespace

MoeMlp::MoeMlp(ParamStore& ps, const std::string& name, int hidden, const MoeConfig& c, float init_std,
               MoeStats* stats, const MakeExpert& make_expert, const MakeExpert& make_shared)
    : ps_(ps),
      name_(name),
      c_(hidden),
      e_(c.num_experts),
      k_(c.top_k),
      cfg_(c),
      stats_(stats),
      gate_(ps, join_name(name, "gate"), hidden, c.num_experts, router_options(init_std)) {
  DTRAIN_CHECK(e_ > 0 && k_ >= 1 && k_ <= e_ && make_expert, "{}: {} experts, top {}", name, e_, k_);
  for (int e = 0; e < e_; ++e) {
    const int first = int(ps.params().size());
    experts_.push_back(make_expert(ps, join_name(join_name(name, "experts"), std::to_string(e))));
    expert_params_.emplace_back(first, int(ps.params().size()));
  }
  if (c.shared_intermediate > 0) {
    DTRAIN_CHECK(bool(make_shared), "{}: a shared expert without its maker", name);
    shared_ = make_shared(ps, join_name(name, "shared_expert"));
    shared_gate_ = std::make_unique<Linear>(ps, join_name(name, "shared_expert_gate"), hidden, 1,
                                            router_options(init_std));
  }
}

Tensor MoeMlp::forward(Ctx& ctx, const Tensor& x) {
  DTRAIN_CHECK(x.ndim() >= 2 && x.dim(-1) == c_, "{}: input {} does not end in {} channels", name_, x.str(), c_);
  Backend& be = ctx.be;
  in_shape_ = x.shape;
  const int64_t N = x.numel() / c_, E = e_, K = k_;
  const Tensor x2 = x.view(Shape{N, c_});
  const Tensor logits = gate_.forward(ctx, x2);
  probs_ = ctx.arena.alloc(DType::F32, Shape{N, E});
  lse_ = ctx.arena.alloc(DType::F32, Shape{N});
  sel_ = ctx.arena.alloc(DType::I32, Shape{N, K});
  weights_ = ctx.arena.alloc(DType::F32, Shape{N, K});
  pos_ = ctx.arena.alloc(DType::I32, Shape{N * K});
  Tensor counts = ctx.arena.alloc(DType::I32, Shape{E});
  Tensor order = ctx.arena.alloc(DType::I32, Shape{N * K});
  Tensor stats = ctx.arena.alloc(DType::F32, Shape{E + 1});
  const int64_t cap =
      cfg_.capacity_factor > 0 ? int64_t(std::ceil(cfg_.capacity_factor * double(N * K) / double(E))) : 0;
  be.moe_route_fwd(logits, k_, cfg_.norm_topk, cap, probs_, lse_, sel_, weights_, counts, order, pos_, stats);
  // the experts' row counts decide the GEMMs' shapes: read on the host (a synchronisation)
  std::vector<int32_t> hc(static_cast<size_t>(E));
  std::vector<float> hs(static_cast<size_t>(E + 1));
  be.copy_to_host(hc.data(), counts.data, hc.size() * sizeof(int32_t));
  be.copy_to_host(hs.data(), stats.data, hs.size() * sizeof(float));
  offset_.assign(size_t(E), 0);
  kept_.assign(size_t(E), 0);
  int64_t dropped = 0;
  for (int64_t e = 0, at = 0; e < E; ++e) {
    offset_[size_t(e)] = at;
    kept_[size_t(e)] = cap > 0 ? std::min<int64_t>(hc[size_t(e)], cap) : hc[size_t(e)];
    dropped += hc[size_t(e)] - kept_[size_t(e)];
    at += hc[size_t(e)];
  }
  if (stats_ && ctx.training && !ctx.replaying) stats_->add_layer(hc.data(), hs.data(), N, dropped);
  // tokens grouped by expert, each expert over its rows, the outputs weighted back per token
  Tensor xe = ctx.arena.alloc(x.dtype, Shape{N * K, c_});
  be.moe_gather(x2, order, k_, xe);
  ye_ = ctx.arena.alloc(x.dtype, Shape{N * K, c_});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = offset_[size_t(e)], n = kept_[size_t(e)];
    if (n == 0) continue;
    Tensor out = ye_.slice0(b, b + n);
    be.copy(experts_[size_t(e)]->forward(ctx, xe.slice0(b, b + n)), out);
  }
  Tensor y = ctx.arena.alloc(x.dtype, Shape{N, c_});
  be.moe_combine(ye_, pos_, weights_, k_, y, false);
  if (shared_) {  // y += sigmoid(shared_expert_gate(x)) * shared_expert(x), the gate on the host
    shared_y_ = shared_->forward(ctx, x2);
    const Tensor g = shared_gate_->forward(ctx, x2);
    std::vector<float> hg;
    copy_to_host_f32(be, ctx.arena, g, hg);
    std::vector<int32_t> ident(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) {
      hg[size_t(n)] = 1.f / (1.f + std::exp(-hg[size_t(n)]));
      ident[size_t(n)] = int32_t(n);
    }
    shared_g_ = ctx.arena.alloc(DType::F32, Shape{N});
    be.copy_from_host(shared_g_.data, hg.data(), hg.size() * sizeof(float));
    Tensor id = ctx.arena.alloc(DType::I32, Shape{N});
    be.copy_from_host(id.data, ident.data(), ident.size() * sizeof(int32_t));
    be.moe_combine(shared_y_, id, shared_g_, 1, y, true);
  }
  return y.view(in_shape_);
}

Tensor MoeMlp::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(probs_.defined(), "{}: backward without forward", name_);
  Backend& be = ctx.be;
  const int64_t N = probs_.dim(0), E = e_, K = k_;
  const Tensor dy2 = dy.view(Shape{N, c_});
  Tensor dye = ctx.arena.alloc(dy.dtype, Shape{N * K, c_});
  Tensor dw = ctx.arena.alloc(DType::F32, Shape{N, K});
  be.moe_combine_bwd(dy2, ye_, pos_, weights_, k_, dye, dw);
  Tensor dxe = ctx.arena.alloc(dy.dtype, Shape{N * K, c_});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = offset_[size_t(e)], n = kept_[size_t(e)];
    if (n == 0) {  // no rows: nothing added to its gradients, which are complete all the same
      for (int id = expert_params_[size_t(e)].first; id < expert_params_[size_t(e)].second; ++id)
        ctx.notify_grad(id);
      continue;
    }
    Tensor out = dxe.slice0(b, b + n);
    be.copy(experts_[size_t(e)]->backward(ctx, dye.slice0(b, b + n)), out);
  }
  Tensor dx = ctx.arena.alloc(dy.dtype, Shape{N, c_});
  be.moe_combine(dxe, pos_, Tensor(), k_, dx, false);  // each token's slots summed back (the gather's backward)
  if (shared_) {
    std::vector<int32_t> ident(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) ident[size_t(n)] = int32_t(n);
    Tensor id = ctx.arena.alloc(DType::I32, Shape{N});
    be.copy_from_host(id.data, ident.data(), ident.size() * sizeof(int32_t));
    Tensor dsy = ctx.arena.alloc(dy.dtype, Shape{N, c_});
    Tensor ds = ctx.arena.alloc(DType::F32, Shape{N});
    be.moe_combine_bwd(dy2, shared_y_, id, shared_g_, 1, dsy, ds);  // dsy = s dy; ds = dot(dy, shared_y)
    // d gate logit = ds * s (1 - s), on the host as the forward's sigmoid
    std::vector<float> hds(static_cast<size_t>(N)), hs(static_cast<size_t>(N));
    be.copy_to_host(hds.data(), ds.data, hds.size() * sizeof(float));
    be.copy_to_host(hs.data(), shared_g_.data, hs.size() * sizeof(float));
    for (int64_t n = 0; n < N; ++n) hds[size_t(n)] *= hs[size_t(n)] * (1.f - hs[size_t(n)]);
    Tensor dg32 = ctx.arena.alloc(DType::F32, Shape{N, 1});
    be.copy_from_host(dg32.data, hds.data(), hds.size() * sizeof(float));
    Tensor dg = dg32;
    if (dy.dtype != DType::F32) {
      dg = ctx.arena.alloc(dy.dtype, Shape{N, 1});
      be.cast(dg32, dg);
    }
    be.add(dx, shared_->backward(ctx, dsy), dx);
    be.add(dx, shared_gate_->backward(ctx, dg), dx);
    shared_y_ = shared_g_ = Tensor();
  }
  // the router: through the gate values (dw), the load-balancing loss and the z-loss
  Tensor paux;
  float zscale = 0;
  if (stats_) {
    paux = ctx.arena.alloc(DType::F32, Shape{E});
    be.copy_from_host(paux.data, stats_->paux().data(), size_t(E) * sizeof(float));
    zscale = stats_->zscale();
  }
  Tensor dlogits = ctx.arena.alloc(dy.dtype, Shape{N, E});
  be.moe_route_bwd(probs_, lse_, sel_, weights_, dw, paux, zscale, cfg_.norm_topk, dlogits);
  be.add(dx, gate_.backward(ctx, dlogits), dx);
  probs_ = lse_ = sel_ = weights_ = pos_ = ye_ = Tensor();
  return dx.view(in_shape_);
}

}  // namespace dtrain

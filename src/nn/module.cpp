#include "nn/module.h"

namespace dtrain {

Tensor Sequential::forward(Ctx& ctx, const Tensor& x) {
  Tensor h = x;
  for (auto& m : mods_) h = m->forward(ctx, h);
  return h;
}

Tensor Module::backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc) {
  Tensor dx = backward(ctx, dy);
  DTRAIN_CHECK(dx.shape == acc.shape && dx.dtype == acc.dtype,
               "backward_into: input gradient {} does not match the sum {}", dx.str(), acc.str());
  ctx.be.add(acc, dx, acc);
  return acc;
}

Tensor Sequential::backward(Ctx& ctx, const Tensor& dy) {
  Tensor g = dy;
  for (auto it = mods_.rbegin(); it != mods_.rend(); ++it) g = (*it)->backward(ctx, g);
  return g;
}

Tensor Sequential::backward_into(Ctx& ctx, const Tensor& dy, Tensor& acc) {
  if (mods_.empty()) return Module::backward_into(ctx, dy, acc);
  Tensor g = dy;
  for (size_t i = mods_.size(); i-- > 1;) g = mods_[i]->backward(ctx, g);
  return mods_[0]->backward_into(ctx, g, acc);
}

Tensor Module::forward_cat(Ctx& ctx, const Tensor& a, const Tensor& b) {
  DTRAIN_CHECK(a.ndim() >= 1 && b.ndim() == a.ndim() && a.dtype == b.dtype, "forward_cat: a {} b {}", a.str(),
               b.str());
  Shape s = a.shape;
  s[-1] = a.dim(-1) + b.dim(-1);
  Tensor x = ctx.arena.alloc(a.dtype, s);
  ctx.be.concat_channels(a, b, x);
  return forward(ctx, x);
}

void Module::backward_cat(Ctx& ctx, const Tensor& dy, Tensor& da, Tensor& db) {
  Tensor dx = backward(ctx, dy);
  ctx.be.split_channels(dx, da, db);
}

Tensor Sequential::forward_cat(Ctx& ctx, const Tensor& a, const Tensor& b) {
  if (mods_.empty()) return Module::forward_cat(ctx, a, b);
  Tensor h = mods_[0]->forward_cat(ctx, a, b);
  for (size_t i = 1; i < mods_.size(); ++i) h = mods_[i]->forward(ctx, h);
  return h;
}

void Sequential::backward_cat(Ctx& ctx, const Tensor& dy, Tensor& da, Tensor& db) {
  if (mods_.empty()) return Module::backward_cat(ctx, dy, da, db);
  Tensor g = dy;
  for (size_t i = mods_.size(); i-- > 1;) g = mods_[i]->backward(ctx, g);
  mods_[0]->backward_cat(ctx, g, da, db);
}

Tensor NhwcOpModule::forward(Ctx& ctx, const Tensor& x) {
  DTRAIN_CHECK(x.ndim() == 4, "{}: input {} is not NHWC", name_, x.shape.str());
  Tensor y = ctx.arena.alloc(x.dtype, out_shape(x.shape));
  (ctx.be.*fwd_)(x, y);
  in_shape_ = x.shape;
  return y;
}

Tensor NhwcOpModule::backward(Ctx& ctx, const Tensor& dy) {
  DTRAIN_CHECK(in_shape_.ndim() == 4, "{}: backward without forward", name_);
  Tensor dx = ctx.arena.alloc(dy.dtype, in_shape_);
  (ctx.be.*bwd_)(dy, dx);
  return dx;
}

// ---- units and recomputation ----

namespace {
// A copy of `t` in `arena` (undefined stays undefined): what leaves a unit whose own
// activations live in the scratch arena.
Tensor keep_copy(Backend& be, Arena& arena, const Tensor& t) {
  if (!t.defined()) return t;
  Tensor c = arena.alloc(t.dtype, t.shape);
  if (t.nbytes()) be.copy_device(c.data, t.data, t.nbytes());
  return c;
}
}  // namespace

static bool recomputes(const Ctx& c) { return c.training && c.recompute != Recompute::None && c.scratch; }

static Ctx sub_ctx(Ctx& c) {
  Ctx s{c.be, *c.scratch, c.training, c.grad_ready, c.sync_sum};
  s.units = c.units;
  s.tp = c.tp;
  s.keep = c.recompute == Recompute::Selective ? &c.arena : nullptr;
  return s;
}

// Runs `body` between the unit's hooks: on c, or, when the policy recomputes, on a context over
// the scratch arena (body's second argument true) whose result is copied into c's arena.
static Tensor in_unit(Ctx& c, int unit, bool backward, const std::function<Tensor(Ctx&, bool)>& body) {
  c.unit_begin(unit, backward);
  Tensor y;
  if (!recomputes(c)) {
    y = body(c, false);
  } else {
    c.scratch->reset();
    Ctx sub = sub_ctx(c);
    y = keep_copy(c.be, c.arena, body(sub, true));
  }
  c.unit_end(unit, backward);
  return y;
}

Tensor Ctx::unit_forward(int unit, const std::function<Tensor(Ctx&)>& fwd) {
  return in_unit(*this, unit, false, [&](Ctx& c, bool) { return fwd(c); });
}

Tensor Ctx::unit_backward(int unit, const std::function<Tensor(Ctx&)>& fwd,
                          const std::function<Tensor(Ctx&)>& bwd) {
  return in_unit(*this, unit, true, [&](Ctx& c, bool recomputing) {
    if (recomputing) {  // the dropped activations again: the forward, replaying
      c.replaying = true;
      fwd(c);
      c.replaying = false;
    }
    return bwd(c);
  });
}

}  // namespace dtrain

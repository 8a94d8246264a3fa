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

}  // namespace dtrain

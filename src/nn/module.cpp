#include "nn/module.h"

namespace dtrain {

Tensor Sequential::forward(Ctx& ctx, const Tensor& x) {
  Tensor h = x;
  for (auto& m : mods_) h = m->forward(ctx, h);
  return h;
}

Tensor Sequential::backward(Ctx& ctx, const Tensor& dy) {
  Tensor g = dy;
  for (auto it = mods_.rbegin(); it != mods_.rend(); ++it) g = (*it)->backward(ctx, g);
  return g;
}

}  // namespace dtrain

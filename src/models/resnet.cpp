#include "models/resnet.h"

#include <vector>

#include "nn/layers.h"

namespace dtrain {
namespace {

// out = relu(bn(main(x)) + shortcut(x)); shortcut = downsample (conv1x1 + BN) or identity.
// The last batch norm of the main path does the add and the ReLU in its epilogue
// (BatchNorm2d::forward_residual); its backward masks the gradient once for both paths, and
// the two input gradients are summed by the last op of one path (backward_into), not by a
// separate add.
class ResidualBlock : public Module {
 public:
  ResidualBlock(std::unique_ptr<Sequential> main, std::unique_ptr<BatchNorm2d> last,
                std::unique_ptr<Sequential> downsample)
      : main_(std::move(main)), last_(std::move(last)), down_(std::move(downsample)) {}

  Tensor forward(Ctx& ctx, const Tensor& x) override {
    Tensor h = main_->forward(ctx, x);
    Tensor s = down_ ? down_->forward(ctx, x) : x;
    return last_->forward_residual(ctx, h, s);
  }

  Tensor backward(Ctx& ctx, const Tensor& dy) override {
    auto [dh, g] = last_->backward_residual(ctx, dy);  // g: the masked gradient of the sum
    if (!down_) return main_->backward_into(ctx, dh, g);  // dx = g + main's input gradient
    Tensor dx = main_->backward(ctx, dh);
    return down_->backward_into(ctx, g, dx);
  }

 private:
  std::unique_ptr<Sequential> main_;
  std::unique_ptr<BatchNorm2d> last_;
  std::unique_ptr<Sequential> down_;
};

Conv2dOptions conv_opts(int stride, int padding) {
  Conv2dOptions o;
  o.stride = stride;
  o.padding = padding;
  o.bias = false;
  o.weight_init = Init::KaimingNormalFanOut;
  return o;
}

BatchNormOptions bn_opts(bool zero_init, bool relu) {
  BatchNormOptions o;
  o.zero_init = zero_init;
  o.relu = relu;
  return o;
}
BatchNormOptions bn_relu() { return bn_opts(false, true); }

std::unique_ptr<Sequential> make_downsample(ParamStore& ps, const std::string& p, int in, int out,
                                            int stride) {
  auto d = std::make_unique<Sequential>();
  d->add<Conv2d>(ps, p + ".downsample.0", in, out, 1, conv_opts(stride, 0));
  d->add<BatchNorm2d>(ps, p + ".downsample.1", out);
  return d;
}

// One residual block's geometry: `in` channels in, `out` out (BasicBlock: planes;
// Bottleneck: 4 * planes), the stride of its first stage-changing conv.
struct BlockGeom {
  int in = 0, planes = 0, out = 0, stride = 1;
  bool bottleneck = false;
  bool projection() const { return stride != 1 || in != out; }  // a downsample shortcut
};

// The block of main path m then `last`, with a downsample (declared after them) when the
// stride or the channel count changes.
std::unique_ptr<Module> residual_block(ParamStore& ps, const std::string& p, const BlockGeom& g,
                                       std::unique_ptr<Sequential> m, std::unique_ptr<BatchNorm2d> last) {
  std::unique_ptr<Sequential> d;
  if (g.projection()) d = make_downsample(ps, p, g.in, g.out, g.stride);
  return std::make_unique<ResidualBlock>(std::move(m), std::move(last), std::move(d));
}

// torchvision BasicBlock (expansion 1).
std::unique_ptr<Module> basic_block(ParamStore& ps, const std::string& p, const BlockGeom& g, bool zero_init) {
  auto m = std::make_unique<Sequential>();
  m->add<Conv2d>(ps, p + ".conv1", g.in, g.planes, 3, conv_opts(g.stride, 1));
  m->add<BatchNorm2d>(ps, p + ".bn1", g.planes, bn_relu());
  m->add<Conv2d>(ps, p + ".conv2", g.planes, g.planes, 3, conv_opts(1, 1));
  // declared in the same order as before the fusion: the flat parameter layout is unchanged
  auto last = std::make_unique<BatchNorm2d>(ps, p + ".bn2", g.planes, bn_opts(zero_init, true));
  return residual_block(ps, p, g, std::move(m), std::move(last));
}

// torchvision Bottleneck (expansion 4, stride on conv2 = ResNet v1.5).
std::unique_ptr<Module> bottleneck(ParamStore& ps, const std::string& p, const BlockGeom& g, bool zero_init) {
  auto m = std::make_unique<Sequential>();
  m->add<Conv2d>(ps, p + ".conv1", g.in, g.planes, 1, conv_opts(1, 0));
  m->add<BatchNorm2d>(ps, p + ".bn1", g.planes, bn_relu());
  m->add<Conv2d>(ps, p + ".conv2", g.planes, g.planes, 3, conv_opts(g.stride, 1));
  m->add<BatchNorm2d>(ps, p + ".bn2", g.planes, bn_relu());
  m->add<Conv2d>(ps, p + ".conv3", g.planes, g.out, 1, conv_opts(1, 0));
  auto last = std::make_unique<BatchNorm2d>(ps, p + ".bn3", g.out, bn_opts(zero_init, true));
  return residual_block(ps, p, g, std::move(m), std::move(last));
}

class ResNet : public Model {
 public:
  ResNet(const ResNetSpec& s, ParamStore& ps) {
    const bool imagenet = s.stem == "imagenet";
    std::vector<int> blocks;
    bool bottle = false;
    if (imagenet) {
      switch (s.depth) {
        case 18: blocks = {2, 2, 2, 2}; break;
        case 34: blocks = {3, 4, 6, 3}; break;
        case 50: blocks = {3, 4, 6, 3}; bottle = true; break;
        case 101: blocks = {3, 4, 23, 3}; bottle = true; break;
        case 152: blocks = {3, 8, 36, 3}; bottle = true; break;
        default:
          user_error("model.depth: expected one of 18, 34, 50, 101, 152 for stem = imagenet, got {}",
                     s.depth);
      }
    } else {
      if (s.depth < 8 || (s.depth - 2) % 6 != 0)
        user_error("model.depth: expected 6n+2 (8, 14, 20, 32, 44, 56, 110, ...) for stem = cifar, got {}",
                   s.depth);
      const int n = (s.depth - 2) / 6;
      blocks = {n, n, n};
    }
    const int w = s.width ? s.width : (imagenet ? 64 : 16);
    imagenet_ = imagenet;
    in_channels_ = s.in_channels;
    width_ = w;
    num_classes_ = s.num_classes;

    // stem: conv + BN + ReLU (+ maxpool 3x3 s2 p1 for ImageNet)
    Conv2dOptions c1 = imagenet ? conv_opts(2, 3) : conv_opts(1, 1);
    c1.input_grad = false;  // nobody needs the gradient of the input images
    stem_.add<Conv2d>(ps, "conv1", s.in_channels, w, imagenet ? 7 : 3, c1);
    stem_.add<BatchNorm2d>(ps, "bn1", w, bn_relu());
    if (imagenet) stem_.add<MaxPool2d>(3, 2, 1);

    int in = w;
    for (size_t stage = 0; stage < blocks.size(); ++stage) {
      const int planes = w << stage;
      if (blocks[stage] == 0) continue;
      // one unit per stage (ZeRO-3, recompute)
      units_.push_back(ps.begin_unit("layer" + std::to_string(stage + 1)));
      stages_.push_back(std::make_unique<Sequential>());
      for (int b = 0; b < blocks[stage]; ++b) {
        const std::string p = "layer" + std::to_string(stage + 1) + "." + std::to_string(b);
        BlockGeom g;
        g.in = in;
        g.planes = planes;
        g.out = bottle ? planes * 4 : planes;
        g.stride = (stage > 0 && b == 0) ? 2 : 1;
        g.bottleneck = bottle;
        stages_.back()->push(bottle ? bottleneck(ps, p, g, s.zero_init_residual)
                                    : basic_block(ps, p, g, s.zero_init_residual));
        geom_.push_back(g);
        in = g.out;
      }
      ps.end_unit();
    }
    fc_ = std::make_unique<Linear>(ps, "fc", in, s.num_classes);
  }

  Tensor forward(Ctx& ctx, const Tensor& x) override {
    Tensor h = stem_.forward(ctx, x);
    stage_in_.resize(stages_.size());
    for (size_t i = 0; i < stages_.size(); ++i) {
      stage_in_[i] = h;  // what a recomputing stage runs on again
      h = ctx.unit_forward(units_[i], [&, i](Ctx& c) { return stages_[i]->forward(c, stage_in_[i]); });
    }
    h = pool_.forward(ctx, h);
    return fc_->forward(ctx, h);
  }

  void backward(Ctx& ctx, const Tensor& dlogits) override {
    Tensor g = fc_->backward(ctx, dlogits);
    g = pool_.backward(ctx, g);
    for (size_t i = stages_.size(); i-- > 0;)
      g = ctx.unit_backward(
          units_[i], [&, i](Ctx& c) { return stages_[i]->forward(c, stage_in_[i]); },
          [&, i](Ctx& c) { return stages_[i]->backward(c, g); });
    stage_in_.clear();
    stem_.backward(ctx, g);
  }

  // Every conv at its output positions (a Bottleneck's first 1x1 conv runs before the
  // block's stride), the fc once; the stem halves an ImageNet input twice (conv, max-pool).
  double forward_flops(int64_t h, int64_t w) const override {
    if (h <= 0 || w <= 0) return 0;  // the size is unknown
    auto at = [&](int halvings) { return halved(h, halvings) * halved(w, halvings); };
    double total = layer_flops(in_channels_, width_, imagenet_ ? 7 : 3, at(imagenet_ ? 1 : 0));
    int res = imagenet_ ? 2 : 0;  // halvings of the block's input
    for (const BlockGeom& g : geom_) {
      const int after = res + (g.stride == 2 ? 1 : 0);  // halvings of its output
      if (g.bottleneck) {
        total += layer_flops(g.in, g.planes, 1, at(res));
        total += layer_flops(g.planes, g.planes, 3, at(after));
        total += layer_flops(g.planes, g.out, 1, at(after));
      } else {
        total += layer_flops(g.in, g.planes, 3, at(after));
        total += layer_flops(g.planes, g.planes, 3, at(after));
      }
      if (g.projection()) total += layer_flops(g.in, g.out, 1, at(after));
      res = after;
    }
    return total + layer_flops(geom_.empty() ? width_ : geom_.back().out, num_classes_, 1, 1);
  }

 private:
  bool imagenet_ = false;
  int in_channels_ = 0, width_ = 0, num_classes_ = 0;
  std::vector<BlockGeom> geom_;  // the body's blocks in order
  Sequential stem_;
  std::vector<std::unique_ptr<Sequential>> stages_;  // layer1, layer2, ...
  std::vector<int> units_;                           // ParamStore unit of each stage
  std::vector<Tensor> stage_in_;                     // each stage's input in the training forward
  GlobalAvgPool pool_;
  std::unique_ptr<Linear> fc_;
};

}  // namespace

std::unique_ptr<Model> build_resnet(const ResNetSpec& spec, ParamStore& ps) {
  if (spec.stem != "imagenet" && spec.stem != "cifar")
    user_error("model.stem: expected one of imagenet, cifar, got '{}'", spec.stem);
  if (spec.num_classes < 1)
    user_error("model.num_classes: expected a positive integer, got {}", spec.num_classes);
  if (spec.in_channels < 1)
    user_error("model.in_channels: expected a positive integer, got {}", spec.in_channels);
  if (spec.width < 0)
    user_error("model.width: expected 0 (default) or a positive integer, got {}", spec.width);
  return std::make_unique<ResNet>(spec, ps);
}

}  // namespace dtrain

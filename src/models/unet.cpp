#include "models/unet.h"

#include <vector>

#include "nn/layers.h"
#include "nn/unet_layers.h"

namespace dtrain {
namespace {

// [3x3 conv (no bias), BN, ReLU] x 2 under "<p>.conv.{0,1,3,4}".
std::unique_ptr<Sequential> double_conv(ParamStore& ps, const std::string& p, int in, int out,
                                        bool input_grad = true) {
  auto s = std::make_unique<Sequential>();
  Conv2dOptions o;
  o.padding = 1;
  o.bias = false;
  o.weight_init = Init::KaimingNormalFanOut;
  o.input_grad = input_grad;
  s->add<Conv2d>(ps, p + ".conv.0", in, out, 3, o);
  BatchNormOptions bn;
  bn.relu = true;  // BatchNorm2d + ReLU, fused (the ReLU's index 2/5 in PyTorch's Sequential has no parameters)
  s->add<BatchNorm2d>(ps, p + ".conv.1", out, bn);
  o.input_grad = true;
  s->add<Conv2d>(ps, p + ".conv.3", out, out, 3, o);
  s->add<BatchNorm2d>(ps, p + ".conv.4", out, bn);
  return s;
}

class UNet : public Model {
 public:
  UNet(const UNetSpec& s, ParamStore& ps)
      : depth_(s.depth), base_(s.base_channels), in_channels_(s.in_channels), num_classes_(s.num_classes),
        transpose_(s.upsample == "transpose") {
    auto c = [&](int i) { return s.base_channels << i; };
    // units (ZeRO-3, recompute): each encoder level, the bottleneck, each decoder level
    for (int i = 0; i < depth_; ++i) {
      down_units_.push_back(ps.begin_unit("down." + std::to_string(i)));
      down_.push_back(double_conv(ps, "down." + std::to_string(i), i == 0 ? s.in_channels : c(i - 1),
                                  c(i), /*input_grad=*/i != 0));
      ps.end_unit();
    }
    bottleneck_unit_ = ps.begin_unit("bottleneck");
    bottleneck_ = double_conv(ps, "bottleneck", c(depth_ - 1), c(depth_));
    ps.end_unit();
    pools_.resize(size_t(depth_));
    for (auto& p : pools_) p = std::make_unique<MaxPool2d>(2, 2, 0);
    for (int j = 0; j < depth_; ++j) {
      const int i = depth_ - 1 - j;
      const std::string p = "up." + std::to_string(j);
      up_units_.push_back(ps.begin_unit(p));
      auto u = std::make_unique<Sequential>();
      if (transpose_) {
        u->add<ConvTranspose2d>(ps, p + ".up", c(i + 1), c(i), 2, 2, true);
      } else {
        u->add<UpsampleBilinear2x>();
        Conv2dOptions o;
        o.padding = 1;
        o.bias = true;
        o.weight_init = Init::KaimingNormalFanOut;
        u->add<Conv2d>(ps, p + ".up.1", c(i + 1), c(i), 3, o);
      }
      ups_.push_back(std::move(u));
      upconvs_.push_back(double_conv(ps, p + ".conv", 2 * c(i), c(i)));
      ps.end_unit();
    }
    Conv2dOptions h;
    h.bias = true;
    h.weight_init = Init::KaimingNormalFanOut;
    head_ = std::make_unique<Conv2d>(ps, "head", c(0), s.num_classes, 1, h);
    skips_.resize(size_t(depth_));
    ups_out_.resize(size_t(depth_));
  }

  Tensor forward(Ctx& ctx, const Tensor& x) override {
    const int64_t m = int64_t(1) << depth_;
    if (x.ndim() != 4 || x.dim(1) % m != 0 || x.dim(2) % m != 0)
      user_error("unet: input {} must be NHWC with height and width divisible by 2^depth = {}",
                 x.shape.str(), m);
    Tensor h = x;
    // each unit's input is kept: a recomputing unit runs on it again before its backward
    level_in_.assign(size_t(2 * depth_ + 1), Tensor());
    for (int i = 0; i < depth_; ++i) {
      level_in_[size_t(i)] = h;
      skips_[size_t(i)] = ctx.unit_forward(down_units_[size_t(i)], [&, i](Ctx& c) { return down_fwd(c, i); });
      h = pools_[size_t(i)]->forward(ctx, skips_[size_t(i)]);
    }
    level_in_[size_t(depth_)] = h;
    h = ctx.unit_forward(bottleneck_unit_, [&](Ctx& c) { return bottleneck_->forward(c, level_in_[size_t(depth_)]); });
    for (int j = 0; j < depth_; ++j) {
      level_in_[size_t(depth_ + 1 + j)] = h;
      h = ctx.unit_forward(up_units_[size_t(j)], [&, j](Ctx& c) { return up_fwd(c, j); });
    }
    return head_->forward(ctx, h);
  }

  void backward(Ctx& ctx, const Tensor& dlogits) override {
    Tensor g = head_->backward(ctx, dlogits);
    std::vector<Tensor> dskip(static_cast<size_t>(depth_));
    for (int j = depth_ - 1; j >= 0; --j) {
      const int i = depth_ - 1 - j;
      dskip[size_t(i)] = ctx.arena.alloc(g.dtype, skips_[size_t(i)].shape);
      g = ctx.unit_backward(
          up_units_[size_t(j)], [&, j](Ctx& c) { return up_fwd(c, j); },
          [&, i, j](Ctx& c) {
            Tensor du = c.arena.alloc(g.dtype, ups_out_[size_t(j)]);
            upconvs_[size_t(j)]->backward_cat(c, g, dskip[size_t(i)], du);
            return ups_[size_t(j)]->backward(c, du);
          });
    }
    g = ctx.unit_backward(
        bottleneck_unit_, [&](Ctx& c) { return bottleneck_->forward(c, level_in_[size_t(depth_)]); },
        [&](Ctx& c) { return bottleneck_->backward(c, g); });
    for (int i = depth_ - 1; i >= 0; --i) {
      Tensor d = pools_[size_t(i)]->backward_into(ctx, g, dskip[size_t(i)]);  // + the skip's
      g = ctx.unit_backward(
          down_units_[size_t(i)], [&, i](Ctx& c) { return down_fwd(c, i); },
          [&, i](Ctx& c) { return down_[size_t(i)]->backward(c, d); });
    }
    for (auto& t : skips_) t = Tensor();
    level_in_.clear();
  }

  // Every conv at the positions of its level (level i: the input halved i times; the
  // bottleneck: depth times), a transposed conv over its input (the coarser level), the
  // 1x1 head at every pixel.
  double forward_flops(int64_t h, int64_t w) const override {
    if (h <= 0 || w <= 0) return 0;  // the size is unknown
    auto at = [&](int level) { return halved(h, level) * halved(w, level); };
    auto c = [&](int i) { return int64_t(base_) << i; };
    double total = 0;
    for (int i = 0; i < depth_; ++i) {
      total += layer_flops(i == 0 ? in_channels_ : c(i - 1), c(i), 3, at(i));
      total += layer_flops(c(i), c(i), 3, at(i));
    }
    total += layer_flops(c(depth_ - 1), c(depth_), 3, at(depth_));
    total += layer_flops(c(depth_), c(depth_), 3, at(depth_));
    for (int j = 0; j < depth_; ++j) {
      const int i = depth_ - 1 - j;
      total += transpose_ ? layer_flops(c(i + 1), c(i), 2, at(i + 1)) : layer_flops(c(i + 1), c(i), 3, at(i));
      total += layer_flops(2 * c(i), c(i), 3, at(i));
      total += layer_flops(c(i), c(i), 3, at(i));
    }
    return total + layer_flops(c(0), num_classes_, 1, h * w);
  }

 private:
  int depth_, base_, in_channels_, num_classes_;
  bool transpose_;  // upsample = "transpose" (else bilinear + 3x3 conv)
  std::vector<std::unique_ptr<Sequential>> down_, ups_, upconvs_;
  std::vector<std::unique_ptr<MaxPool2d>> pools_;
  std::unique_ptr<Sequential> bottleneck_;
  std::vector<int> down_units_, up_units_;  // ParamStore units
  std::vector<Tensor> level_in_;            // each unit's input: down 0..d-1, bottleneck, up 0..d-1

  Tensor down_fwd(Ctx& c, int i) { return down_[size_t(i)]->forward(c, level_in_[size_t(i)]); }
  // up level j: the upsampling, then the decoder block over cat(skip, up) (its first
  // convolution may never build the concatenation)
  Tensor up_fwd(Ctx& c, int j) {
    Tensor u = ups_[size_t(j)]->forward(c, level_in_[size_t(depth_ + 1 + j)]);
    ups_out_[size_t(j)] = u.shape;
    return upconvs_[size_t(j)]->forward_cat(c, skips_[size_t(depth_ - 1 - j)], u);
  }
  int bottleneck_unit_ = -1;
  std::unique_ptr<Conv2d> head_;
  std::vector<Tensor> skips_;
  std::vector<Shape> ups_out_;  // each upsampling's output shape (the decoder's second input)
};

}  // namespace

std::unique_ptr<Model> build_unet(const UNetSpec& s, ParamStore& ps) {
  if (s.depth < 1 || s.depth > 8)
    user_error("model.depth: expected an integer in 1..8 for a U-Net, got {}", s.depth);
  if (s.base_channels < 1 || s.base_channels > 4096)
    user_error("model.base_channels: expected an integer in 1..4096, got {}", s.base_channels);
  if ((int64_t(s.base_channels) << s.depth) > (int64_t(1) << 16))
    user_error("model.base_channels: {} << depth {} gives too many channels", s.base_channels,
               s.depth);
  if (s.in_channels < 1)
    user_error("model.in_channels: expected a positive integer, got {}", s.in_channels);
  if (s.num_classes < 1)
    user_error("model.num_classes: expected a positive integer, got {}", s.num_classes);
  if (s.upsample != "transpose" && s.upsample != "bilinear")
    user_error("model.upsample: expected one of transpose, bilinear, got '{}'", s.upsample);
  return std::make_unique<UNet>(s, ps);
}

}  // namespace dtrain

#pragma once
// U-Net (Ronneberger et al. 2015) with same-padding convolutions and batch norm:
//   down.i      DoubleConv(c_{i-1} -> c_i), then max-pool 2x2        (i = 0..depth-1)
//   bottleneck  DoubleConv(c_{depth-1} -> c_depth)
//   up.j        upsample c_{i+1} -> c_i, cat([skip_i, up], channels), DoubleConv(2c_i -> c_i)
//               (j = 0..depth-1, i = depth-1-j: up.0 is the deepest)
//   head        1x1 conv c_0 -> num_classes, with bias
// where c_i = base_channels * 2^i and c_{-1} = in_channels. DoubleConv = two of
// [3x3 conv (pad 1, no bias), BatchNorm2d, ReLU].
//
// Parameter names (those of the equivalent plain PyTorch module, see tests/model/test_unet.cpp):
//   down.{i}.conv.{0,3}.weight            conv weights (PyTorch OIHW in checkpoints)
//   down.{i}.conv.{1,4}.{weight,bias,running_mean,running_var,num_batches_tracked}
//   bottleneck.conv.{0,1,3,4}.*           as down
//   up.{j}.up.weight, up.{j}.up.bias      upsample = "transpose": ConvTranspose2d(c_{i+1}, c_i, 2, 2)
//                                         (PyTorch layout [in, out, 2, 2])
//   up.{j}.up.1.weight, up.{j}.up.1.bias  upsample = "bilinear": Sequential(Upsample(x2,
//                                         bilinear, align_corners=False), Conv2d(c_{i+1}, c_i, 3, pad 1))
//   up.{j}.conv.conv.{0,1,3,4}.*          DoubleConv(2 c_i -> c_i)
//   head.weight, head.bias
// Input: NHWC [N,H,W,in_channels] with H and W divisible by 2^depth (UserError otherwise).
// Output: logits NHWC [N,H,W,num_classes].
#include <memory>
#include <string>

#include "models/model.h"

namespace dtrain {

struct UNetSpec {
  int depth = 4;
  int base_channels = 64;
  int in_channels = 3;
  int num_classes = 2;
  std::string upsample = "transpose";  // "transpose" | "bilinear"
};

// Declares the parameters into `ps` (call ps.finalize() and ps.initialize() afterwards).
// Invalid specs throw UserError naming the model.* key.
std::unique_ptr<Model> build_unet(const UNetSpec& spec, ParamStore& ps);

}  // namespace dtrain

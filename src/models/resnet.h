#pragma once
// ResNet family: torchvision ResNet-18/34/50/101/152 (v1.5: stride on the Bottleneck's
// 3x3 conv) and CIFAR ResNet-6n+2 (He et al. 2016, 3 stages of BasicBlocks, projection
// shortcuts = "option B"), with torchvision's parameter names, shapes and init.
#include <memory>
#include <string>

#include "models/model.h"

namespace dtrain {

struct ResNetSpec {
  int depth = 18;
  int width = 0;                  // first stage width; 0 = default (64 imagenet, 16 cifar)
  std::string stem = "imagenet";  // "imagenet" | "cifar"
  int num_classes = 1000;
  int in_channels = 3;
  bool zero_init_residual = false;  // last BN weight of every block starts at 0
};

// Declares the parameters into `ps` (nothing is allocated: call ps.finalize() and
// ps.initialize() afterwards). Invalid specs throw UserError naming the model.* key.
std::unique_ptr<Model> build_resnet(const ResNetSpec& spec, ParamStore& ps);

}  // namespace dtrain

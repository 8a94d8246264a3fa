#pragma once
// The target of a token that is not trained on (PyTorch's ignore_index): masked prompt tokens,
// document ends and padding. The losses (Backend::softmax_xent_masked, vocab_xent_*) give such a
// row loss 0 and gradient 0. Shared by host code and the CUDA kernels.
#include <cstdint>

namespace dtrain {

constexpr int32_t kIgnoreTarget = -100;

}  // namespace dtrain

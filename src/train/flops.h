#pragma once
// Model FLOPs of one training step, for MFU. Counted from the model's parameters (names and
// shapes in the ParamStore) and the input geometry, never measured:
//   GPT:          per token 6*N + 12*L*d*T (PaLM, appendix B; N = trainable parameters,
//                 L layers, d = n_embd, T = block_size: attention scores and values).
//   ResNet/U-Net: 3 x forward, forward = sum over conv/linear weights of
//                 2 * numel(weight) * output positions (a transposed conv: input positions).
//                 Normalisation, activations, pooling and the loss are not counted.
#include <cstdint>
#include <string>

namespace dtrain {

struct Session;
class ParamStore;

// Training FLOPs per loss unit (per image, or per token for GPT); 0 when unknown.
double train_flops_per_unit(const Session& s);

// Forward FLOPs of one image of a CIFAR/ImageNet-stem ResNet or a U-Net, from the parameter
// names the builders declare; `kind` "resnet" | "unet", `stem` "cifar" | "imagenet".
double conv_forward_flops(const ParamStore& ps, const std::string& kind, const std::string& stem, int unet_depth,
                          int64_t height, int64_t width);

class Nvml;
// The peak FLOP/s of the session's device for MFU (observability.peak_tflops wins; a CPU
// without it, or a GPU missing from the table: 0 = unknown). `device_index`: the CUDA
// device's index; `name` (optional) receives the GPU's name from NVML.
double session_peak_flops(const Session& s, Nvml& nvml, int device_index, std::string* name = nullptr);

// The precision name peak_flops() expects for precision.dtype / precision.tf32.
std::string peak_precision(const std::string& dtype, bool tf32);

}  // namespace dtrain

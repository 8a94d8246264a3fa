#pragma once
// Model FLOPs of one training step, for MFU. Each model counts its own forward FLOPs from
// its layer geometry and the input size (Model::forward_flops), never measured, by these rules:
//   GPT:          per token 6*N + 12*L*d*T (PaLM, appendix B; N = trainable parameters,
//                 padded vocabulary included, L layers, d = n_embd, T = block_size:
//                 attention scores and values); forward = a third of it.
//   ResNet/U-Net: 3 x forward, forward = sum over conv/linear weights of
//                 2 * numel(weight) * output positions (a transposed conv: input positions;
//                 a stride-2 conv or pool halves a side, rounding up).
//                 Normalisation, activations, pooling and the loss are not counted.
#include <cstdint>
#include <string>

namespace dtrain {

struct Session;

// Training FLOPs per loss unit (per image, or per token for GPT): 3 x the model's forward
// FLOPs at the session's input size; 0 when unknown.
double train_flops_per_unit(const Session& s);

class Nvml;
// The peak FLOP/s of the session's device for MFU (observability.peak_tflops wins; a CPU
// without it, or a GPU missing from the table: 0 = unknown). `device_index`: the CUDA
// device's index; `name` (optional) receives the GPU's name from NVML.
double session_peak_flops(const Session& s, Nvml& nvml, int device_index, std::string* name = nullptr);

// The precision name peak_flops() expects for precision.dtype / precision.tf32.
std::string peak_precision(const std::string& dtype, bool tf32);

}  // namespace dtrain

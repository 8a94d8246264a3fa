#pragma once
// DTRAIN_CUDA_UNFUSED: switches the CUDA backend's fused fast paths back to the separate
// passes they replaced (each of which the CPU reference defines), to tell a wrong fusion
// from a wrong op on a GPU without rebuilding. A comma-separated list of
//   gelu_epilogue   GPT's MLP: the cuBLASLt GELU_AUX_BIAS / DGELU epilogues -> GEMM + GELU
//   bgrad_epilogue  Linear bias gradients from the BGRADA/BGRADB epilogues -> sum_rows
//   conv_cat        U-Net decoder: the split-filter convolution over (skip, up) -> concat
//   all             every one of them
// Unset or empty: everything fused. Anything else is a UserError naming the variable.
#include <string>

namespace dtrain {

struct CudaUnfused {
  bool gelu_epilogue = false, bgrad_epilogue = false, conv_cat = false;
  bool any() const { return gelu_epilogue || bgrad_epilogue || conv_cat; }
};

CudaUnfused parse_cuda_unfused(const std::string& value);
// parse_cuda_unfused(getenv("DTRAIN_CUDA_UNFUSED")), "" when unset.
CudaUnfused cuda_unfused_from_env();

}  // namespace dtrain

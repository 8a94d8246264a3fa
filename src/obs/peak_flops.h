#pragma once
// Peak dense (no structured sparsity) FLOP/s of a GPU, from its marketing name as
// CUDA/NVML report it, for MFU = achieved model FLOP/s / peak. Unknown device or
// precision -> 0, meaning "unknown": MFU is then left out, never made up.
#include <string>

namespace dtrain {

// precision: "fp32" | "tf32" | "bf16" | "fp16" (case-insensitive). The name is matched
// case-insensitively against an ordered table of substrings ("H100 PCIe" before "H100";
// a match must end at a word boundary, so "A10" does not match "A100" or "A10G").
double peak_flops(const std::string& device_name, const std::string& precision);

// observability.peak_tflops > 0 overrides the table (in TFLOP/s, i.e. 1e12).
double resolve_peak_flops(const std::string& device_name, const std::string& precision, double override_tflops);

// achieved / peak, or NaN when the peak is unknown (<= 0) or nothing was measured.
double mfu_ratio(double achieved_flops_per_s, double peak);

}  // namespace dtrain

#pragma once
// Rotary position embedding tables (RoPE; Su et al. 2021) of the Llama family, computed on the
// host exactly as Hugging Face transformers 4.46.3 computes them (modeling_rope_utils.py and
// LlamaRotaryEmbedding.forward), in f32 operation by operation:
//   inv_freq[i] = 1 / theta^(2i / d)                              ("default", i < d/2)
//   llama3 (Llama 3.1): wavelen = 2 pi / inv_freq; wavelengths above original / low_freq_factor
//     are divided by `factor`, those below original / high_freq_factor kept, the ones between
//     interpolated with smooth = (original / wavelen - low) / (high - low):
//     (1 - smooth) * inv / factor + smooth * inv
//   angle[p][i] = inv_freq[i] * p (f32), cos/sin of it (rounded to f32 from double).
// transformers' powf and cosf may differ from the C library's by an ulp; the tests compare the
// tables with transformers'.
#include <string>
#include <vector>

namespace dtrain {

// config.json's rope_scaling (Hugging Face names). rope_type "default" is no scaling.
struct RopeScaling {
  std::string rope_type = "default";  // "default" | "llama3"
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int original_max_position_embeddings = 8192;
};

// inv_freq [head_dim / 2] (f32). UserError naming model.rope_scaling.* for a scaling dtrain does
// not compute or values it cannot use.
std::vector<float> rope_inv_freq(double rope_theta, const RopeScaling& scaling, int head_dim);

// cos/sin [positions, head_dim / 2] row-major: the tables Backend::rope_fwd reads.
void rope_tables(const std::vector<float>& inv_freq, int positions, std::vector<float>& cos,
                 std::vector<float>& sin);

}  // namespace dtrain

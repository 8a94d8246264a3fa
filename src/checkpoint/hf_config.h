#pragma once
// A Hugging Face GPT-2 model directory's config.json (GPT2Config), checked to describe the
// architecture dtrain builds: model_type gpt2, the tanh GELU (gelu_new), LayerNorm eps 1e-5,
// the LM head tied to wte, scores scaled by 1/sqrt(head size) alone (scale_attn_weights true,
// scale_attn_by_inverse_layer_idx false). UserError naming the file otherwise.
#include <cstdint>
#include <optional>
#include <string>

namespace dtrain {

struct HfGpt2Config {
  int64_t n_layer = 0, n_head = 0, n_embd = 0, n_positions = 0, vocab_size = 0;
};

// std::nullopt when `dir` holds no config.json.
std::optional<HfGpt2Config> read_hf_gpt2_config(const std::string& dir);

// GPT-2's causal-mask buffers (h.N.attn.bias, h.N.attn.masked_bias) that some of its
// safetensors files hold: not weights.
bool is_gpt2_mask_buffer(const std::string& name);

}  // namespace dtrain

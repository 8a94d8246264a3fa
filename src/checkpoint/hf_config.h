#pragma once
// A Hugging Face GPT-2 model directory's config.json (GPT2Config), checked to describe the
// architecture dtrain builds: model_type gpt2, the tanh GELU (gelu_new), LayerNorm eps 1e-5,
// the LM head tied to wte, scores scaled by 1/sqrt(head size) alone (scale_attn_weights true,
// scale_attn_by_inverse_layer_idx false). UserError naming the file otherwise.
#include <cstdint>
#include <optional>
#include <string>

#include "models/llama_config.h"
#include "nn/moe.h"

namespace dtrain {

struct GptSpec;

struct HfGpt2Config {
  int64_t n_layer = 0, n_head = 0, n_embd = 0, n_positions = 0, vocab_size = 0;
};

// std::nullopt when `dir` holds no config.json.
std::optional<HfGpt2Config> read_hf_gpt2_config(const std::string& dir);

// GPT-2's causal-mask buffers (h.N.attn.bias, h.N.attn.masked_bias) that some of its
// safetensors files hold: not weights.
bool is_gpt2_mask_buffer(const std::string& name);

// The config.json of a Llama-family spec (GptSpec::family "llama", validated), as
// transformers 4.46.3's LlamaConfig / Qwen2Config write it: architectures LlamaForCausalLM or
// Qwen2ForCausalLM, every field the model's math reads (hidden_act silu, rope_scaling null or
// llama3's, no dropout, no sliding window), torch_dtype float32.
std::string hf_llama_config(const GptSpec& spec);

// A Hugging Face Llama / Qwen2 directory's config.json (LlamaConfig / Qwen2Config of
// transformers 4.46.3) as the LlamaConfig dtrain builds: std::nullopt when `dir` holds no
// config.json. Whatever dtrain does not build is a UserError naming the file and the field: a
// model_type other than llama / qwen2, hidden_act other than silu, attention_dropout != 0,
// use_sliding_window true, a rope_scaling type other than default / llama3, any field it
// neither reads nor knows to be harmless (docs/llama.md lists them).
// Mixture of experts (docs/moe.md): model_type "mixtral" (MixtralConfig) reads as llama,
// "qwen2_moe" (Qwen2MoeConfig) as qwen2, their expert fields into *moe (when given; else the
// experts are refused); a dense model leaves *moe without experts.
std::optional<LlamaConfig> read_hf_llama_config(const std::string& dir, MoeConfig* moe = nullptr);
// config.json's model_type ("gpt2" when it names none, as GPT2Config's files may); "" when
// `dir` holds no config.json.
std::string hf_model_type(const std::string& dir);
// The [model] section of a recipe that builds the model `c` describes (model.arch llama / qwen2).
std::string hf_llama_model_toml(const LlamaConfig& c, const MoeConfig& moe = {});
// model_type names a directory the Llama family reads (llama, qwen2, mixtral, qwen2_moe)
bool is_hf_llama_type(const std::string& model_type);

}  // namespace dtrain

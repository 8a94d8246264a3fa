#pragma once
// The Llama family's switches, named as Hugging Face's config.json names them (LlamaConfig,
// Qwen2Config in transformers 4.46.3), so a config.json maps onto it key by key. GptSpec holds
// one (GptSpec::family = "llama"); models/llama.h builds the model.
#include <string>

#include "models/rope.h"

namespace dtrain {

struct LlamaConfig {
  // "llama" (LlamaForCausalLM: biases as attention_bias / mlp_bias say) or "qwen2"
  // (Qwen2ForCausalLM: q_proj, k_proj and v_proj always have biases, nothing else has)
  std::string model_type = "llama";
  int vocab_size = 256;
  int hidden_size = 64;
  int intermediate_size = 172;
  int num_hidden_layers = 2;
  int num_attention_heads = 4;
  int num_key_value_heads = 0;  // 0: num_attention_heads (multi-head); 1: multi-query
  int head_dim = 0;             // 0: hidden_size / num_attention_heads
  int max_position_embeddings = 64;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;     // rope_type "default": none
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // llama: q_proj, k_proj, v_proj and o_proj biases
  bool mlp_bias = false;        // llama: gate_proj, up_proj and down_proj biases
  double initializer_range = 0.02;

  // What the switches mean for the layers (after validation fills the zeros).
  int kv_heads() const { return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads; }
  int head_size() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  bool qkv_bias() const { return model_type == "qwen2" || attention_bias; }
  bool o_bias() const { return model_type != "qwen2" && attention_bias; }
  bool ffn_bias() const { return model_type != "qwen2" && mlp_bias; }
};

}  // namespace dtrain

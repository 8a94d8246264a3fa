#pragma once
// The Llama family as Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM (transformers 4.46.3):
// model.embed_tokens (no position embedding), model.layers.{i} (nn/llama_layers.h: RMSNorm,
// rotary positions with Llama 3.1's frequency scaling, grouped-query attention, SwiGLU),
// model.norm, and lm_head.weight [vocab, hidden] unless tie_word_embeddings (then the head is
// embed_tokens, as GPT-2's). Every Linear is [out, in] as nn.Linear. The vocabulary is padded
// inside as GPT-2's (Layout::PadRows; checkpoints hold vocab_size rows).
// Init as transformers' LlamaPreTrainedModel._init_weights: Normal(0, initializer_range) for
// every Linear and the embedding, biases 0, RMSNorm weights 1.
// A spec is a GptSpec with family "llama" (models/gpt.h); build_gpt builds this model for it,
// so the LM task, pipeline stages (GptSpec::pp_*) and tensor parallelism take it as they take
// GPT-2.
#include <initializer_list>
#include <memory>
#include <utility>

#include "models/gpt.h"

namespace dtrain {

// A GptSpec of family "llama" for `c` (not yet validated).
GptSpec llama_spec(const LlamaConfig& c);

// gpt_validate's part for family "llama": checks the switches (UserError naming model.<key>),
// fills num_key_value_heads and head_dim when 0 and the GPT-2-named shape fields.
void llama_validate(GptSpec& spec);
// For both validations: UserError "model.<key>: expected a positive integer" for the first of
// `keys` below 1.
void require_positive(std::initializer_list<std::pair<const char*, int>> keys);
// Trainable parameters; padded=false counts the checkpoint (HF) tensors, true the flat buffer.
int64_t llama_param_count(const GptSpec& spec, bool padded);

class LlamaModel : public GptModel {};

std::unique_ptr<LlamaModel> build_llama(const GptSpec& spec, ParamStore& ps);

}  // namespace dtrain

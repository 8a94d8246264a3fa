// `dtrain import gpt2`: a Hugging Face GPT-2 model.safetensors (GPT2Model / GPT2LMHeadModel
// names with or without "transformer.", Conv1D weights [in, out], tied or absent lm_head,
// attn.bias / attn.masked_bias buffers ignored) becomes the step-0 checkpoint of a run
// directory (checkpoints/step_00000000 with model.safetensors, optimizer state of zeros,
// state.json, config.toml, SHA256SUMS), ready for `dtrain sample` or `dtrain train --resume`.
// The shapes give n_layer, n_embd, vocab_size and block_size (the position table's rows);
// n_head, which the weights do not fix, is the recipe's, else that of the config.json beside
// model.safetensors (whose activation, layer norm epsilon and tied head are checked); with
// neither the import is refused. The tokenizer files beside it (vocab.json + merges.txt, or
// encoder.json + vocab.bpe; tokenizer.json, tokenizer_config.json) go into the checkpoint. A
// recipe's model keys must agree with the file; its block_size may be smaller than the
// position table (the leading rows are kept).
// A dtrain GPT checkpoint directory imports too (a ZeRO-3 one's model shards put together:
// checkpoint/model_tensors.h).
#include <string>

namespace dtrain {

// `path`: model.safetensors or the model directory holding it; `out`: the run directory to
// create; `recipe`: "" or a recipe whose [model] must fit. Returns the checkpoint directory.
std::string import_gpt2(const std::string& path, const std::string& out, const std::string& recipe);

// `dtrain import llama`: a Hugging Face LlamaForCausalLM / Qwen2ForCausalLM directory
// (config.json, and model.safetensors or model.safetensors.index.json with its shards) becomes
// the step-0 checkpoint of a run directory, its recipe's model keys from config.json
// (checkpoint/hf_config.h refuses what dtrain does not build), the weights read strictly
// (model.init_from's reader), the tokenizer files beside them copied. Returns the checkpoint
// directory.
std::string import_llama(const std::string& dir, const std::string& out);

}  // namespace dtrain

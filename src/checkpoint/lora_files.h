#pragma once
// LoRA adapters in Hugging Face PEFT's layout (docs/finetune.md, "LoRA"), and merging them into
// their base model.
//
// A LoRA run's checkpoint holds the adapters as its model (model.safetensors: the trainable
// store, PEFT's names `base_model.model.<module>.lora_A.weight` [r, in] / `lora_B.weight`
// [out, r]) with the optimizer and state.json as any run's, so resume and reshard are the usual
// ones; beside them adapter_model.safetensors (the same tensors) and adapter_config.json
// (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout, target_modules,
// fan_in_fan_out for GPT-2's Conv1D, base_model_name_or_path = model.init_from), so that
// `PeftModel.from_pretrained(base, checkpoint_dir)` loads it. No config.json: the directory is
// an adapter, not a model (transformers would load it as a model with random weights).
#include <cstdint>
#include <string>
#include <vector>

#include "nn/params.h"
#include "session/session.h"

namespace dtrain {

inline constexpr const char* kAdapterModelFile = "adapter_model.safetensors";
inline constexpr const char* kAdapterConfigFile = "adapter_config.json";

// adapter_config.json's text for the session's recipe
std::string lora_adapter_config(const Config& cfg);
// Writes both files into `dir` from the adapters' tensors (universal layout). Returns bytes.
uint64_t write_lora_adapter(const Config& cfg, const std::vector<ParamStore::Exported>& adapters,
                            const std::string& dir);

struct MergedLora {
  std::string adapter_dir;  // the verified checkpoint (or adapter directory) read
  std::string base;         // the base model's weights read (a file or the shards)
  std::string out;
  int merged = 0;           // weights with an adapter added
  int64_t tensors = 0;      // tensors written
};

// `dtrain checkpoint merge-lora`: W' = W + (lora_alpha / r) B A for every adapter of `adapter`
// (a LoRA checkpoint, a LoRA run directory's newest valid one, or a PEFT adapter directory), the
// transpose for fan_in_fan_out (GPT-2's Conv1D [in, out]); written with every other tensor of
// the base model (f32) as OUT/model.safetensors beside the base's config.json and tokenizer
// files: a Hugging Face model directory. `base` "" = adapter_config.json's
// base_model_name_or_path (a Hugging Face model directory, a dtrain checkpoint or run directory).
// `out` must not exist or be empty. UserError for a missing or mismatched tensor.
MergedLora merge_lora(const std::string& adapter, const std::string& base, const std::string& out);

}  // namespace dtrain

#pragma once
// model.init_from: start a run from pretrained weights (fine-tuning) instead of the seeded
// initialisation. The source is a safetensors file with PyTorch names and layouts (what
// dtrain writes, or a torchvision state_dict saved with safetensors.torch.save_file), a
// checkpoint directory (a ZeRO-3 one's model shards put together as they are read), a run
// directory (its newest valid checkpoint), or a model
// directory holding model.safetensors, or model.safetensors.index.json and its shards,
// without SHA256SUMS (Hugging Face's; GPT-2 names without "transformer.", its causal-mask
// buffers and tied lm_head are understood; a Llama / Qwen2 directory's config.json must
// describe the recipe's model, field by field). Only weights
// and batch-norm buffers are read: the optimizer, the schedule and the data start afresh.
//
// strict (model.init_strict, default): every tensor of the model must be in the file with
// its shape, and the file must hold nothing else; otherwise UserError naming the file and
// the tensor. Not strict: tensors missing from the file or of another shape (a new
// classifier, another vocabulary) keep this model's initialisation, and tensors the model
// does not have are ignored, as Hugging Face's ignore_mismatched_sizes with strict=False.
// bf16/f16 tensors are widened to f32.
#include <string>
#include <vector>

#include "session/session.h"

namespace dtrain {

struct InitReport {
  std::string file;                  // the safetensors file read (ZeRO-3: "<dir>/model-*-of-<N>.safetensors")
  int loaded = 0;                    // tensors taken from it
  std::vector<std::string> kept;     // the model's own initialisation kept (not strict)
  std::vector<std::string> ignored;  // in the file, not used (not strict)
};

InitReport init_model_from(Session& s, const std::string& path, bool strict);

// Weights alone: `path` itself when it is a file, PATH/model.safetensors when PATH is a model
// directory without SHA256SUMS (Hugging Face's), PATH itself when such a directory holds
// model.safetensors.index.json (sharded); "" for anything else (a dtrain checkpoint or
// run directory, or nothing at all).
std::string weights_only_file(const std::string& path);

}  // namespace dtrain

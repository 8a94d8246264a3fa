#pragma once
// `dtrain checkpoint consolidate`: a checkpoint's model as a plain model directory that
// torchvision (safetensors) and transformers (from_pretrained) load.
//
// A checkpoint written without ZeRO-3 holds the whole model in model.safetensors in PyTorch's
// names and layouts: consolidating copies it. Under ZeRO-3 each rank of the shard group wrote
// its pieces of the flat parameters (model-<i>-of-<N>.safetensors, checkpoint/flat_shards.h):
// consolidating reads every parameter from the ranges of the shards it spans, in the layout
// of the checkpoint's own recipe, and writes model.safetensors (checkpoint/model_tensors.h).
// Either way the checkpoint is validated first (CheckpointManager::verify: every file against
// SHA256SUMS, the shard sets complete), a GPT checkpoint's config.json and tokenizer files
// (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json) are copied beside it and
// every copy is hashed again against SHA256SUMS. The optimizer state, state.json and the
// recipe stay behind.
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

struct ConsolidatedModel {
  std::string checkpoint;           // the verified checkpoint directory the files came from
  std::string out;                  // the directory written
  std::vector<std::string> files;   // file names written, model.safetensors first
  int64_t tensors = 0, bytes = 0;   // model.safetensors' tensors; bytes of every file copied
};

// The checkpoint directory's default output: RUN_DIR/consolidated/step_XXXXXXXX for a
// checkpoint under RUN_DIR/checkpoints/, else CHECKPOINT-consolidated.
std::string default_consolidated_dir(const std::string& checkpoint_dir);

// `path`: a checkpoint directory, or a run directory (its `latest` checkpoint; an invalid one
// is skipped with a warning for the newest valid one, as every command reads run dirs).
// `out` ("" = default_consolidated_dir) must not exist or be an empty directory. Writes into
// a temporary sibling and renames it into place. UserError for an invalid checkpoint or an
// occupied `out`; RuntimeFault on I/O failure.
ConsolidatedModel consolidate_checkpoint(const std::string& path, const std::string& out);

}  // namespace dtrain

#pragma once
// A model's tensors in PyTorch's names, shapes and layouts, whichever way they were saved:
//  * a safetensors file (model.safetensors of a checkpoint written without ZeRO-3, or weights
//    alone: torchvision's state_dict, Hugging Face's model directory);
//  * Hugging Face's sharded weights: a directory's model.safetensors.index.json and the
//    model-0000i-of-0000n.safetensors files its weight_map names (save_pretrained's
//    max_shard_size);
//  * the model shards of a ZeRO-3 checkpoint (model-<i>-of-<N>.safetensors, train/
//    flat_shards.h): each parameter is assembled from the ranges of the files it spans when it
//    is read, in the layout of the model the checkpoint's own recipe (its config.toml)
//    declares; that layout must be the shards' param_layout.
// Resume, eval, sample, init_from, inspect and consolidate read a checkpoint's model through
// it, so a sharded checkpoint never needs an offline conversion step.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "nn/params.h"
#include "checkpoint/flat_shards.h"
#include "checkpoint/safetensors.h"

namespace dtrain {

struct Runtime;

class ModelTensors final : public TensorSource {
 public:
  // `path`: a safetensors file, or a checkpoint directory (verified by the caller:
  // resolve_checkpoint_dir) with model.safetensors or model shards. UserError naming the file
  // for anything else.
  explicit ModelTensors(const std::string& path);
  ~ModelTensors() override;

  // the file, or "<dir>/model-*-of-<N>.safetensors"
  const std::string& origin() const override { return origin_; }
  bool sharded() const { return shards_ != nullptr; }
  const FlatShards* shards() const { return shards_.get(); }  // null for a file

  // Tensors in state order (a file's: its own order).
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const override;
  const std::string& dtype(const std::string& name) const override;
  std::vector<int64_t> shape(const std::string& name) const override;
  size_t nbytes(const std::string& name) const override;
  void read(const std::string& name, void* dst, size_t nbytes) const override;

  // For ParamStore::import_state: each tensor read at its first request and kept alive as
  // long as this object.
  TensorLookup lookup();

 private:
  struct Param {
    const ParamDesc* desc = nullptr;  // into layout_'s parameters
    StateEntry entry;
  };
  const Param* param(const std::string& name) const;
  // sharded: shard 0, which holds the buffers and counters (UserError for "params")
  const SafetensorsReader& buffers(const std::string& name) const;

  std::string origin_;
  std::unique_ptr<SafetensorsReader> file_;
  // Hugging Face's sharded weights: the files, and each tensor's file
  std::vector<std::unique_ptr<SafetensorsReader>> hf_files_;
  std::map<std::string, const SafetensorsReader*> hf_of_;
  const SafetensorsReader* hf_file(const std::string& name) const;  // UserError naming origin() when absent
  std::unique_ptr<FlatShards> shards_;
  std::unique_ptr<Runtime> layout_;      // sharded: the recipe's model, declared only
  std::map<std::string, Param> params_;  // sharded: the flat parameters by name
  std::vector<std::string> names_;
  std::map<std::string, std::vector<uint8_t>> held_;  // lookup()'s tensors
};

}  // namespace dtrain

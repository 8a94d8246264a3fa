#pragma once
// Saving and loading a Session to/from a checkpoint directory:
//   model.safetensors                 fp32 weights + BN buffers, PyTorch names and layouts
//   optim-00000-of-00001.safetensors  optimizer state (flat f32 buffers)
//   state.json                        step, data position, schedule, config hash, versions
//   config.toml                       the resolved recipe
#include <cstdint>
#include <string>

#include "data/image_loader.h"
#include "train/session.h"

namespace dtrain {

struct TrainState {
  int64_t step = 0;               // optimizer steps completed
  LoaderState loader;             // position of the training data
  double wall_time_s = 0;         // training time accumulated over all segments of the run
};

// Writes the files into `dir` (the checkpoint manager makes it atomic). Returns bytes written.
uint64_t write_checkpoint_files(Session& s, const TrainState& st, const std::string& dir);

// Loads model (and optimizer, when the session has one) from a verified checkpoint dir.
// Throws UserError naming the file and the problem when it does not fit the recipe.
TrainState load_checkpoint(Session& s, const std::string& dir);

// Only the model weights (eval, import): model.safetensors of `dir`.
void load_model_weights(Session& s, const std::string& dir);

}  // namespace dtrain

#pragma once
// Saving and loading a Session to/from a checkpoint directory:
//   model.safetensors                 fp32 weights + BN buffers, PyTorch names and layouts
//   optim-<i>-of-<N>.safetensors      optimizer state (flat f32 buffers), N contiguous
//                                     ranges, one file each (train/optim_shards.h)
//   state.json                        step, data position, schedule, config hash, versions,
//                                     CPU threads
//   config.toml                       the resolved recipe
#include <cstdint>
#include <string>
#include <vector>

#include "data/image_loader.h"
#include "train/session.h"

namespace dtrain {

struct TrainState {
  int64_t step = 0;               // optimizer steps completed
  LoaderState loader;             // position of the training data (images, masks)
  uint64_t position = 0;          // GPT: token batches drawn by this rank (TokenLoader)
  double wall_time_s = 0;         // training time accumulated over all segments of the run
  // read from a checkpoint (load_checkpoint): the CPU threads the run that wrote it used, as
  // job_cpu_threads gives them; empty when not recorded (a CUDA run, an older checkpoint)
  std::vector<int> written_cpu_threads;
};

// The CPU threads of the job (state.json "cpu_threads"): one value when every rank used the
// same count (Session::cpu_threads; rank 0 knows every rank's, Session::rank_cpu_threads),
// else one per rank; empty on a CUDA device.
std::vector<int> job_cpu_threads(const Session& s);
// "1 CPU thread per rank", "2 CPU threads per rank", or "per rank 2, 1 CPU threads".
std::string describe_cpu_threads(const std::vector<int>& threads);

// Writes the files into `dir` (the checkpoint manager makes it atomic). Returns bytes written.
// `world_size`: the number of ranks that trained (recorded with the per-rank batch size in
// state.json). `optim_shards`: how many optimizer files the checkpoint holds (state.json
// records it); with 1 this writes optim-00000-of-00001 from the session's optimizer (which
// must hold the full state); with N > 1 every rank writes its own shard with
// write_optim_shard and this writes none. `full_params`: with sharded parameters (ZeRO-3) every
// parameter in the flat layout, gathered (DataParallel::gather_full_params); with tensor
// parallelism every parameter in the universal layout (parallel::tp_gather_params); null
// otherwise. `optim_universal`: with tensor parallelism the optimizer state in the universal
// layout (parallel::tp_gather_state), written as the one optimizer file.
// `pp`: with pipeline parallelism the full model's tensors and optimizer state gathered on
// rank 0 (train/pipeline_ckpt.h), written instead of the session's stage.
struct PipelineCheckpoint;
uint64_t write_checkpoint_files(Session& s, const TrainState& st, const std::string& dir, int world_size = 1,
                                int optim_shards = 1, const std::vector<float>* full_params = nullptr,
                                const std::vector<ParamStore::Exported>* optim_universal = nullptr,
                                const PipelineCheckpoint* pp = nullptr);

// Loads model (and optimizer, when the session has one) from a verified checkpoint dir.
// Throws UserError naming the file and the problem when it does not fit the recipe.
// The optimizer's range (all of it, or its ZeRO shard) is read from the shard files that
// overlap it, after every file was checked (OptimShards), so a checkpoint of N ranks loads
// on M. When the world size (or batch
// size) differs, the data position restarts the saved epoch at the first batch that
// covers the saved global sample position (at most one batch of samples is repeated; the
// next epoch when that is past the end).
TrainState load_checkpoint(Session& s, const std::string& dir);

// Only the model weights (eval, import): model.safetensors of `dir`.
void load_model_weights(Session& s, const std::string& dir);

}  // namespace dtrain

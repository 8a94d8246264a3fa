#pragma once
// Saving and loading a Session to/from a checkpoint directory:
//   model.safetensors                 fp32 weights + BN buffers, PyTorch names and layouts
//   model-<i>-of-<N>.safetensors      instead, under ZeRO-3: each shard-group rank's pieces
//                                     of the flat parameters (checkpoint/flat_shards.h)
//   optim-<i>-of-<N>.safetensors      optimizer state (flat f32 buffers), N contiguous
//                                     ranges, one file each (checkpoint/flat_shards.h)
//   state.json                        step, data position, schedule, config hash, versions,
//                                     CPU threads
//   config.toml                       the resolved recipe
#include <cstdint>
#include <string>
#include <vector>

#include "data/image_loader.h"
#include "session/session.h"

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

// What the ranks of a run write beside write_checkpoint_files (all defaults: one process).
struct PipelineCheckpoint;
struct CheckpointParts {
  int world_size = 1;    // the ranks that trained (recorded with the per-rank batch size)
  // optimizer files the checkpoint holds (state.json records it): with 1 this writes
  // optim-00000-of-00001 from the session's optimizer (which must hold the full state); with
  // N > 1 every rank writes its own shard with write_optim_shard and this writes none
  int optim_shards = 1;
  // ZeRO-3: the model files the shard group's ranks write with write_model_shard (state.json
  // records it); this then writes no model.safetensors. 0: this writes model.safetensors
  int model_shards = 0;
  // with tensor parallelism every parameter in the universal layout (parallel::
  // tp_gather_params; under ZeRO-3 too); null otherwise
  const std::vector<float>* full_params = nullptr;
  // with tensor parallelism the optimizer state in the universal layout
  // (parallel::tp_gather_state), written as the one optimizer file
  const std::vector<ParamStore::Exported>* optim_universal = nullptr;
  // with pipeline parallelism the full model's tensors and optimizer state gathered on rank 0
  // (checkpoint/pipeline_ckpt.h), written instead of the session's stage
  const PipelineCheckpoint* pp = nullptr;
};

// Writes the files into `dir` (the checkpoint manager makes it atomic). Returns bytes written.
uint64_t write_checkpoint_files(Session& s, const TrainState& st, const std::string& dir,
                                const CheckpointParts& parts = {});

// Loads model (and optimizer, when the session has one) from a verified checkpoint dir.
// Throws UserError naming the file and the problem when it does not fit the recipe.
// The optimizer's range (all of it, or its ZeRO shard) is read from the shard files that
// overlap it, after every file was checked (FlatShards), so a checkpoint of N ranks loads
// on M. When the world size (or batch
// size) differs, the data position restarts the saved epoch at the first batch that
// covers the saved global sample position (at most one batch of samples is repeated; the
// next epoch when that is past the end).
TrainState load_checkpoint(Session& s, const std::string& dir);

// The batch geometry of checkpoint `dir` (a resume's: CheckpointManager::latest_valid): the
// global batch (sequences or images per optimizer step) and the data-parallel ranks that
// trained. Zeros when `dir` is "" (no checkpoint). A checkpoint written before state.json recorded
// its global batch gives data.batch_size x world_size x `grad_accum` (the recipe's).
struct CheckpointBatch {
  int64_t global_batch = 0;
  int data_ranks = 0;
};
CheckpointBatch checkpoint_batch(const std::string& dir, int64_t grad_accum);

// Only the model weights (eval, sample): model.safetensors of `dir`, or its ZeRO-3 model shards
// (checkpoint/model_tensors.h; a sharded session of the same layout reads only its own pieces).
// A LoRA checkpoint: the adapters, after the frozen model from the recipe's model.init_from.
void load_model_weights(Session& s, const std::string& dir);

}  // namespace dtrain

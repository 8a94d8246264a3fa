#pragma once
// The flat-state files of a checkpoint: the optimizer's state and, under ZeRO-3, the model's
// parameters, each cut into element ranges of the parameter flat layout.
//
// Optimizer ("optim-"): the optimizer's flat f32 buffers in the parameter flat layout (SGD
// "momentum"; AdamW "exp_avg", "exp_avg_sq") plus "step" (I64 scalar). It is cut into N
// contiguous element ranges that tile [0, num_params), one file per range:
//   optim-<i:05d>-of-<N:05d>.safetensors    elements [begin_i, end_i) of every state buffer
// With ZeRO (stage 1/2) rank i of N writes its own shard (its parallel::shard_range); with the
// state replicated (ZeRO 0, one process) one file holds all of it (N = 1).
// Model ("model-", ZeRO-3 only): rank i of the shard group's N ranks writes its pieces of the
// f32 master parameters as one tensor "params" into model-<i:05d>-of-<N:05d>.safetensors, so no
// rank ever holds the whole model to save it (torch.distributed.checkpoint and DeepSpeed's
// ZeRO-3 files do the same). Shard 0 also holds the model's buffers and counters (BatchNorm
// running statistics, num_batches_tracked) under their PyTorch names: rank 0's, as
// model.safetensors holds them. Without ZeRO-3 the model is one model.safetensors in PyTorch's
// names (train_state.h).
// The __metadata__ of every file says what it holds (all values are strings):
//   optimizer     "sgd" | "adamw"          (optimizer files only)
//   shard_index   i               shard_count  N
//   range_begin   begin_i         range_end    end_i      num_params  total elements
//   param_layout  ParamStore::layout_hash() of the model that wrote it
//   step, format, producer
// With ZeRO-3 a rank owns one piece of every unit (Optimizer::pieces(), ParamStore::
// shard_pieces()): its file then holds several ranges, listed in __metadata__ "ranges" as
// "b0:e0,b1:e1,..." (range_begin/range_end give the first and last), the tensors holding the
// ranges' elements back to back. The ranges of all files together tile [0, num_params).
// A reader of any world size assembles any range [b, e) from the files that overlap it,
// reading only those bytes (SafetensorsReader::read_range).
#include <cstdint>
#include <memory>
#include <string>
#include <functional>
#include <map>
#include <vector>

#include "nn/params.h"
#include "optim/optimizer.h"
#include "checkpoint/safetensors.h"

namespace dtrain {

// Writes exported tensors (ParamStore / Optimizer / GradCompressor::export_state) as one
// safetensors file with `meta`, fsynced; returns the bytes of tensor data.
uint64_t write_exported(const std::string& path, const std::vector<ParamStore::Exported>& ex,
                        const std::map<std::string, std::string>& meta);

enum class FlatKind { Optimizer, Model };

// "optim-00001-of-00004.safetensors" / "model-00001-of-00004.safetensors"
std::string flat_shard_name(FlatKind kind, int index, int count);
// index and count of such a name of `kind` (5+ digits each); false otherwise.
bool parse_flat_shard_name(FlatKind kind, const std::string& name, int* index, int* count);

// Writes `opt`'s state (its pieces of the flat buffers) into dir/flat_shard_name(Optimizer,
// index, count) and fsyncs it. The `count` writers' pieces must tile the flat buffers (the caller's
// contract: parallel::shard_range, ZeRO-3's unit shards, or the full range with count 1).
// Returns the bytes of tensor data written.
uint64_t write_optim_shard(const Optimizer& opt, const ParamStore& ps, int64_t step, const std::string& dir,
                           int index, int count);
// Tensor parallelism: optimizer state already in the universal layout (parallel::
// tp_gather_state) as the checkpoint's one file: range [0, ps.universal_num_params()),
// ps.layout_hash(), exactly what one process writes.
uint64_t write_optim_universal(const std::string& kind, const std::vector<ParamStore::Exported>& states,
                               const ParamStore& ps, int64_t step, const std::string& dir);

// ZeRO-3: this rank's pieces of the parameters (ps.shard_pieces(), ps sharded over `count`
// ranks as rank `index`) into dir/flat_shard_name(Model, index, count), fsynced; shard 0 also
// holds the buffers and counters. Returns the bytes of tensor data written.
uint64_t write_model_shard(const ParamStore& ps, int64_t step, const std::string& dir, int index, int count);

// PowerSGD's state of rank `rank` of `world` (parallel.grad_compression = "powersgd": its
// error feedback and Q per bucket, parallel::GradCompressor::export_state), a file per rank:
// "powersgd-00001-of-00002.safetensors", metadata step, rank and world_size. Returns the bytes.
std::string powersgd_state_name(int rank, int world);
uint64_t write_powersgd_state(const std::vector<ParamStore::Exported>& state, int64_t step, const std::string& dir,
                              int rank, int world);
// The tensors of dir/powersgd_state_name(rank, world) for `load` (their bytes alive during the
// call). Returns "" when they were loaded, else why not: no such file (a checkpoint without
// PowerSGD or of another world size) or `load` returning false (another bucket layout); a
// damaged file is a UserError naming it.
std::string read_powersgd_state(const std::string& dir, int rank, int world,
                                const std::function<bool(const TensorLookup&)>& load);

struct FlatShardInfo {
  std::string file;  // name inside the checkpoint directory
  int index = 0;
  int64_t begin = 0, end = 0;  // the first range's begin, the last range's end
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end) in the file's order
};

// The optimizer files or the model files of one checkpoint directory, opened and
// cross-checked before anything is loaded (independent of the model): names, all N files
// present, the same N, num_params and param_layout in every file, ranges that tile
// [0, num_params) without gap or overlap, the same flat tensors in every file (F32 [elements of
// its ranges]) and the same step. Optimizer files: the same optimizer kind, "step" an I64
// scalar. Model files: the flat tensor "params", other tensors (the buffers) in shard 0 only.
// Any problem -> UserError naming the file.
class FlatShards {
 public:
  // expected_count: the number of files state.json announces (-1: unknown). A directory
  // with no file of `kind` and expected_count <= 0 is valid and has count() == 0.
  FlatShards(const std::string& dir, FlatKind kind, int expected_count = -1);
  ~FlatShards();

  int count() const { return int(shards_.size()); }
  const std::vector<FlatShardInfo>& shards() const { return shards_; }
  const std::string& kind() const { return kind_; }  // the optimizer's; "" for model files
  int64_t num_params() const { return num_params_; }
  const std::string& layout() const { return layout_; }  // "" in files written before it existed
  int64_t step() const { return step_; }
  const std::vector<std::string>& state_names() const { return names_; }  // F32 buffers
  // Model files: shard 0, which also holds the buffers and counters under their own names
  const SafetensorsReader& first() const { return *readers_.at(0); }
  // "<dir>/optim-*-of-<N>.safetensors" (or model-*), for messages
  std::string origin() const;

  // Elements [b, e) of F32 state `name` (b <= e <= num_params), read from the files that
  // overlap the range and nothing else.
  std::vector<uint8_t> read(const std::string& name, int64_t b, int64_t e) const;
  // The same into `dst` (room for e - b floats).
  void read_into(const std::string& name, int64_t b, int64_t e, float* dst) const;

 private:
  std::string dir_;
  FlatKind what_;
  std::vector<FlatShardInfo> shards_;
  std::vector<std::unique_ptr<SafetensorsReader>> readers_;
  std::vector<std::string> names_;
  std::string kind_, layout_;
  int64_t num_params_ = 0, step_ = 0;
};

// "" when the files of `kind` in `dir` pass FlatShards' checks (or there are none and
// state.json announces none), else the first problem with file names relative to `dir`,
// e.g. "optim-00002-of-00004.safetensors: missing (shard 2 of 4)". For
// CheckpointManager::verify.
std::string flat_shards_problem(const std::string& dir, FlatKind kind, int expected_count);

}  // namespace dtrain

#pragma once
// Checkpoint directories of a run: <run_dir>/checkpoints/step_%08d/ holding the files the
// trainer writes (model.safetensors, optim-*.safetensors, state.json) plus SHA256SUMS
// (sha256sum format), and <run_dir>/checkpoints/latest naming the newest complete one.
//
// Commit protocol (a crash at any instant leaves the previous checkpoint valid and
// `latest` naming a complete one):
//   1. files are written into checkpoints/.tmp-step_%08d-<pid>/
//   2. every file is fsynced, read back and hashed into SHA256SUMS; the dir is fsynced
//   3. the dir is renamed to step_%08d (atomic exchange if that name exists), checkpoints/
//      is fsynced
//   4. `latest` is replaced (write tmp, fsync, rename, fsync dir) -- last
//   5. old checkpoints are pruned (renamed to .tmp-del-*, then deleted).
// Leftover .tmp-* dirs of dead processes are ignored by readers and deleted on the next save.
// checkpoints/best.json (checkpoint.keep_best) names the best-evaluated checkpoint, which
// pruning keeps beside the newest keep_last.
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace dtrain {

class CheckpointManager {
 public:
  // the files of the format: the checksums of a checkpoint's files, its state, the newest
  // checkpoint's name, the best one's record (checkpoints/)
  static constexpr const char* kSums = "SHA256SUMS";
  static constexpr const char* kState = "state.json";
  static constexpr const char* kLatest = "latest";
  static constexpr const char* kBest = "best.json";

  explicit CheckpointManager(std::string run_dir);

  const std::string& run_dir() const { return run_dir_; }
  std::string checkpoints_dir() const { return run_dir_ + "/checkpoints"; }
  static std::string dir_name(int64_t step);  // "step_00001000"
  // Step of a "step_<digits>" name (a trailing path is allowed); -1 if it is not one.
  static int64_t step_of(const std::string& dir_or_name);

  // begin + write(tmpdir) + commit. write() must create state.json (JSON) and may create
  // any other regular files (no subdirectories). keep_last <= 0 keeps everything.
  // Returns the final directory path. I/O failures -> RuntimeFault.
  std::string save(int64_t step, const std::function<void(const std::string& tmpdir)>& write, int keep_last);
  // The two halves of save(), for callers that write from several processes: begin()
  // cleans dead .tmp-* dirs and returns a fresh empty tmpdir; commit() performs steps 2-5.
  std::string begin(int64_t step);
  std::string commit(int64_t step, const std::string& tmpdir, int keep_last);

  // "" when ckpt_dir is a valid checkpoint, else the first problem found, e.g.
  // "model.safetensors: checksum mismatch", "SHA256SUMS: missing", "state.json: not valid JSON",
  // "optim-00002-of-00004.safetensors: missing (shard 2 of 4)" (the optimizer shard files
  // must all be present and consistent: checkpoint/flat_shards.h).
  static std::string verify(const std::string& ckpt_dir);

  // Newest valid checkpoint (full path): `latest` first, then step_* newest first. Every
  // invalid checkpoint skipped appends a note to `notes` (may be null), e.g.
  // "checkpoints/step_00000200: model.safetensors: checksum mismatch; falling back to step_00000100".
  // Returns "" when there is none.
  std::string latest_valid(std::vector<std::string>* notes) const;

  // checkpoint.keep_best: checkpoints/best.json names the checkpoint with the best evaluation
  //   {"checkpoint": "step_00000200", "step": 200, "metric": "eval_accuracy", "mode": "max", "value": 0.93}
  // written atomically after that checkpoint was committed; prune() never removes it.
  // mark_best takes the committed directory and the fields besides "checkpoint".
  void mark_best(const std::string& ckpt_dir, const nlohmann::json& fields) const;
  // best.json's text, "" when there is none (or it is unreadable)
  std::string best_json() const;
  // The directory best.json names ("" when none): step_* of this run, verified or not.
  std::string best_dir() const;

  // step_* directories (full paths), sorted by step ascending. Does not verify them.
  std::vector<std::string> list() const;

  // Test-only: called at each commit stage ("written", "summed", "renamed", "latest",
  // "pruned") so fault-injection tests can stop the process at a chosen instant.
  static void set_test_hook(std::function<void(const std::string& stage)> hook);

 private:
  void clean_stale_tmp() const;
  void prune(int64_t just_written, int keep_last) const;
  std::string run_dir_;
};

// What a command's --checkpoint names, as a verified checkpoint directory: a checkpoint
// directory itself, RUN_DIR/checkpoints/best (checkpoint.keep_best), or a run directory (its
// newest valid checkpoint, older ones' problems logged). UserError otherwise.
std::string resolve_checkpoint_dir(const std::string& path);

}  // namespace dtrain

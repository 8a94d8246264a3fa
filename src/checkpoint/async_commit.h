#pragma once
// checkpoint.async: the trainer writes a checkpoint's files into its temporary directory on
// the training thread (the snapshot: the device-to-host copies and page-cache writes), and
// CheckpointManager::commit (fsync every file, read back and hash, rename, `latest`, prune:
// the slow part) runs on this background thread while training goes on. One commit at a
// time; the crash guarantees are commit()'s, since a commit that never finishes leaves only a
// .tmp-* directory that readers ignore.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <thread>

#include "checkpoint/checkpoint.h"

namespace dtrain {

struct CommitDone {
  int64_t step = 0;
  std::string path;          // the committed checkpoint
  uint64_t bytes = 0;        // what the training thread wrote
  double seconds = 0;        // from the start of the save to the end of the commit
  double blocked_s = 0;      // of which the training thread spent writing the snapshot
};

class AsyncCommit {
 public:
  AsyncCommit() = default;
  ~AsyncCommit();  // waits for a running commit (its error is dropped: the caller is unwinding)
  AsyncCommit(const AsyncCommit&) = delete;
  AsyncCommit& operator=(const AsyncCommit&) = delete;

  bool pending() const { return th_.joinable(); }
  int64_t step() const { return res_.step; }  // of the pending (or last) commit
  // Starts cm.commit(step, tmpdir, keep_last) on the background thread; none may be pending.
  void start(CheckpointManager& cm, int64_t step, std::string tmpdir, int keep_last, uint64_t bytes,
             std::chrono::steady_clock::time_point t0, double blocked_s);
  // The finished commit, if there is one (wait: block until it finishes). Rethrows the
  // commit's exception on this thread.
  std::optional<CommitDone> poll(bool wait);

 private:
  std::thread th_;
  std::atomic<bool> done_{false};
  std::exception_ptr err_;
  CommitDone res_;
};

}  // namespace dtrain

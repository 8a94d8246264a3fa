#include "checkpoint/async_commit.h"

#include <utility>

namespace dtrain {

AsyncCommit::~AsyncCommit() {
  if (th_.joinable()) th_.join();
}

void AsyncCommit::start(CheckpointManager& cm, int64_t step, std::string tmpdir, int keep_last, uint64_t bytes,
                        std::chrono::steady_clock::time_point t0, double blocked_s) {
  if (th_.joinable()) th_.join();  // callers poll first; never two commits at once
  done_ = false;
  err_ = nullptr;
  res_ = CommitDone{step, "", bytes, 0, blocked_s};
  th_ = std::thread([this, &cm, step, tmpdir = std::move(tmpdir), keep_last, t0] {
    try {
      res_.path = cm.commit(step, tmpdir, keep_last);
    } catch (...) {
      err_ = std::current_exception();
    }
    res_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    done_ = true;
  });
}

std::optional<CommitDone> AsyncCommit::poll(bool wait) {
  if (!th_.joinable() || (!wait && !done_)) return std::nullopt;
  th_.join();
  if (err_) std::rethrow_exception(std::exchange(err_, nullptr));
  return res_;
}

}  // namespace dtrain

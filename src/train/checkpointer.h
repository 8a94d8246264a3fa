#pragma once
// The trainer's checkpoint saves: synchronous or asynchronous (checkpoint.async), by one
// process or collectively by every rank (checkpoint/dist_checkpoint.h), each reported in the run
// directory's events, the log and the metrics (rank 0).
#include <cstdint>
#include <string>

#include "obs/metrics.h"
#include "checkpoint/async_commit.h"
#include "checkpoint/checkpoint.h"
#include "session/dist_setup.h"
#include "train/run_dir.h"
#include "session/session.h"
#include "checkpoint/train_state.h"

namespace dtrain {

class Checkpointer {
 public:
  // d: null on one process; run: null except on rank 0.
  Checkpointer(Session& s, DistRuntime* d, const std::string& run_dir, RunDir* run, MetricRegistry& reg)
      : s_(s), d_(d), cm_(run_dir), run_(run), reg_(reg) {}
  CheckpointManager& manager() { return cm_; }
  // Every rank calls it (collective with data parallelism). Rank 0 writes the model,
  // state.json and, unless ZeRO shards the optimizer, the one optimizer file; with ZeRO every
  // rank writes its own optimizer shard. With checkpoint.async a periodic save writes its
  // files here and rank 0 commits them on a background thread; every other save first waits
  // for a pending commit and is synchronous. `why`: periodic | best | preempted | final.
  void save(const TrainState& st, const std::string& why);
  // Reports a background commit once it has finished (wait: block until it has); rethrows
  // its failure.
  void finish_async(bool wait);

 private:
  void failed(int64_t step, const Error& e);
  void done(const std::string& path, uint64_t bytes, double secs, const std::string& why, double blocked_s = -1);

  Session& s_;
  DistRuntime* d_;
  CheckpointManager cm_;
  AsyncCommit ac_;  // after cm_: its thread uses cm_, and its destructor waits for it
  RunDir* run_;
  MetricRegistry& reg_;
};

}  // namespace dtrain

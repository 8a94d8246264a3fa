#pragma once
// The trainer's side of data parallelism: the launcher argv of `dtrain train
// --nproc-per-node N`, and a worker's runtime (store, communicator, gradient buckets,
// ZeRO sharder) with the collective helpers the training loop needs.
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/data_parallel.h"
#include "dist/env.h"
#include "dist/store.h"
#include "train/session.h"
#include "train/step.h"

namespace dtrain {

// `args` (this process's argv) without the launcher options (--nproc-per-node, --nnodes,
// --node-rank, --master-addr, --master-port, --max-restarts, both "--opt v" and
// "--opt=v"), argv[0] replaced by the absolute path of this executable.
std::vector<std::string> worker_argv_from(const std::vector<std::string>& args, const std::string& exe);

struct DistRuntime {
  dist::DistEnv env;
  int zero_stage = 0;
  std::unique_ptr<dist::StoreServer> server;  // rank 0 outside dtrain's launcher and torchrun
  std::unique_ptr<dist::Store> store;         // dtrain's store or torchrun's agent store
  std::unique_ptr<dist::Communicator> comm;
  std::unique_ptr<dist::GradBuckets> buckets;
  std::unique_ptr<dist::ZeroSharder> zero;
  DistStep step;  // what train_step needs
  // gather_rank_stats' device buffers (made at the first log step, reused after)
  Buffer stats_mine, stats_all;
  int64_t saves = 0;  // collective checkpoint saves so far (store keys of the next one)

  std::string key(const std::string& k) const { return "r" + std::to_string(env.restart_count) + "/train/" + k; }
};

// Store + communicator for `env` (validated against parallel.backend and the device);
// UserError for impossible combinations. Call before make_session's heavy work is fine.
std::unique_ptr<DistRuntime> connect(const dist::DistEnv& env, const Config& cfg, Device device);
// Every rank must run the same recipe: UserError naming the first rank whose config hash
// differs from rank 0's.
void check_same_config(DistRuntime& d, const std::string& hash);
// Parameters equal on every rank (broadcast from rank 0 + digest check), then buckets and
// the ZeRO sharder over the session's parameters.
void attach(DistRuntime& d, Session& s, double bucket_mb);
// Every rank's host name (gethostname), indexed by rank; collective (through the store).
std::vector<std::string> gather_hostnames(DistRuntime& d);
// One small all-gather through the communicator: every rank's step-time p50 (seconds, the
// rank's own busy time: step minus the time spent waiting in gradient sync) and its sample
// count, indexed by rank. Collective: every rank calls it at the same step.
struct RankStat {
  double p50_s = 0;
  double samples = 0;
};
std::vector<RankStat> gather_rank_stats(DistRuntime& d, Backend& be, const RankStat& mine);
// Rank 0's string, on every rank (through the store, under `key`).
std::string share_from_rank0(DistRuntime& d, const std::string& key, const std::string& value);

}  // namespace dtrain

#pragma once
// The trainer's side of data parallelism: the launcher argv of `dtrain train
// --nproc-per-node N`, and a worker's runtime (store, communicator, gradient buckets,
// ZeRO sharder) with the collective helpers the training loop needs.
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/env.h"
#include "comm/store.h"
#include "parallel/data_parallel.h"
#include "parallel/tensor_parallel.h"
#include "session/layout.h"
#include "session/session.h"

namespace dtrain {


struct DistRuntime {
  comm::DistEnv env;
  int zero_stage = 0;
  int shard_group_size = 0;  // ZeRO-3's shard group (parallel.shard_group_size resolved: 1..world)
  DType reduce_dtype = DType::F32;  // parallel.reduce_dtype (BF16: ZeRO-3 only)
  parallel::CompressionOptions compression;  // parallel.grad_compression
  bool sync_bn = false;  // model.sync_bn
  std::unique_ptr<comm::StoreServer> server;  // rank 0 outside dtrain's launcher and torchrun
  std::unique_ptr<comm::Store> store;         // dtrain's store or torchrun's agent store
  // Tensor parallelism (parallel.tensor = T > 1): the world communicator, split into the
  // mesh's "dp" group (then `comm`) and "tp" group (`tp_comm`, with the layers' view `tp`);
  // null otherwise. Declared before `comm` so it outlives the groups split from it.
  std::unique_ptr<comm::Communicator> world_comm;
  std::unique_ptr<comm::Communicator> tp_comm;
  std::unique_ptr<parallel::CommTensorParallel> tp;
  // Pipeline parallelism (parallel.pipeline = P > 1): the mesh's "pp" group (session/pipeline.h)
  std::unique_ptr<comm::Communicator> pp_comm;
  // data parallelism's group: every rank (the world), or the dp group under tensor parallelism
  std::unique_ptr<comm::Communicator> comm;
  std::unique_ptr<parallel::DataParallel> dp;  // made by attach()
  // gather_rank_stats' device buffers (made at the first log step, reused after)
  Buffer stats_mine, stats_all;
  int64_t saves = 0;  // collective checkpoint saves so far (store keys of the next one)

  std::string key(const std::string& k) const { return fmt::format("r{}/train/{}", env.restart_count, k); }
};

// Store + communicator for `env` (validated against parallel.backend and be's device; the
// communicators order their work after be's compute stream); UserError for impossible
// combinations.
std::unique_ptr<DistRuntime> connect(const comm::DistEnv& env, const Config& cfg, const ParallelLayout& layout,
                                     Backend& be);
// Every rank must run the same recipe: UserError naming the first rank whose config hash
// differs from rank 0's.
void check_same_config(DistRuntime& d, const std::string& hash);
// Data parallelism over the session's parameters (equal on every rank: broadcast from rank
// 0 and checked; then buckets and the ZeRO sharder).
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
// Every rank's CPU thread count (Session::cpu_threads, 0 on CUDA) on rank 0, indexed by
// rank; empty on the other ranks. Every rank calls it (each sets its key in the store).
std::vector<int> gather_cpu_threads(DistRuntime& d, int mine);
// Rank 0's string, on every rank (through the store, under `key`).
std::string share_from_rank0(DistRuntime& d, const std::string& key, const std::string& value);

}  // namespace dtrain

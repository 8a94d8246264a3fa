#include "session/dist_setup.h"

#include <chrono>
#include <cstring>
#include <unistd.h>

#include "core/error.h"
#include "comm/mesh.h"
#include "comm/rendezvous.h"
#include "models/gpt.h"
#include "session/layout.h"
#include "session/pipeline.h"
#include "session/task.h"

namespace dtrain {

std::unique_ptr<DistRuntime> connect(const comm::DistEnv& env, const Config& cfg, const ParallelLayout& l,
                                     Backend& be) {
  const Device device = be.device();
  auto d = std::make_unique<DistRuntime>();
  d->env = env;
  d->zero_stage = l.zero;
  d->shard_group_size = l.shard_group;
  d->reduce_dtype = l.reduce_dtype;
  d->compression = l.compression;
  const std::string backend = cfg.parallel.backend;
  if (device.is_cpu() && backend == "nccl")
    user_error("{}: parallel.backend = \"nccl\" needs a CUDA device (run.device is cpu; use \"gloo\" or \"auto\")",
               cfg.source());
  if (device.is_cuda() && backend == "gloo")
    user_error("{}: parallel.backend = \"gloo\" works on CPU tensors only; with a CUDA device use \"nccl\" or \"auto\"",
               cfg.source());
#ifndef DTRAIN_WITH_CUDA
  if (device.is_cuda())
    user_error("{}: distributed training on {} needs NCCL, which this dtrain was built without", cfg.source(),
               device.str());
#endif
  const double timeout = double(cfg.parallel.timeout_s);
  std::string token = env.job_token;
  if (token.empty()) {
    token = cfg.parallel.job_id;
    if (token.empty()) token = "dtrain:" + env.master_addr + ":" + std::to_string(env.master_port);
  }
  auto rdzv = comm::open_rendezvous(env, token, std::chrono::milliseconds(int64_t(timeout * 1000)));
  d->server = std::move(rdzv.server);
  d->store = std::move(rdzv.store);
  d->comm = comm::make_communicator(env, *d->store, be, timeout);
  d->sync_bn = cfg.model.sync_bn;
  const int t = l.tensor, p = l.pipeline;
  if (t > 1 || p > 1) {
    // ranks tensor-innermost: a tp group is T consecutive ranks, data parallelism strides by T,
    // the pipeline (outermost) by D*T
    comm::MeshComms g = comm::split_mesh(*d->comm, comm::DeviceMesh(p, l.data, t));
    d->world_comm = std::move(d->comm);
    d->comm = std::move(g.data);
    if (t > 1) {
      d->tp_comm = std::move(g.tensor);
      d->tp = std::make_unique<parallel::CommTensorParallel>(*d->tp_comm);
    }
    if (p > 1) d->pp_comm = std::move(g.pipeline);
  }
  return d;
}

std::string share_from_rank0(DistRuntime& d, const std::string& key, const std::string& value) {
  if (d.env.rank == 0) {
    d.store->set(d.key(key), value);
    return value;
  }
  return d.store->get_string(d.key(key));
}

std::vector<std::string> gather_hostnames(DistRuntime& d) {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) std::strcpy(buf, "?");
  d.store->set(d.key("host/" + std::to_string(d.env.rank)), std::string(buf));
  std::vector<std::string> out;
  for (int r = 0; r < d.env.world_size; ++r) out.push_back(d.store->get_string(d.key("host/" + std::to_string(r))));
  return out;
}

std::vector<int> gather_cpu_threads(DistRuntime& d, int mine) {
  d.store->set(d.key("cpu_threads/" + std::to_string(d.env.rank)), std::to_string(mine));
  if (d.env.rank != 0) return {};
  std::vector<int> out;
  for (int r = 0; r < d.env.world_size; ++r) {
    const std::string v = d.store->get_string(d.key("cpu_threads/" + std::to_string(r)));
    try {
      out.push_back(std::stoi(v));
    } catch (const std::exception&) {
      fault("store key cpu_threads/{}: expected an integer, got '{}'", r, v);
    }
  }
  return out;
}

std::vector<RankStat> gather_rank_stats(DistRuntime& d, Backend& be, const RankStat& mine) {
  comm::Communicator& c = d.world_comm ? *d.world_comm : *d.comm;  // every rank (tensor parallel: not only dp's)
  const int W = c.size();
  if (!d.stats_mine.data()) {
    d.stats_mine = Buffer(be, 2 * 4);
    d.stats_all = Buffer(be, size_t(2 * W) * 4);
  }
  Buffer &sh = d.stats_mine, &all = d.stats_all;
  float v[2] = {float(mine.p50_s), float(mine.samples)};
  be.copy_from_host(sh.data(), v, sizeof v);
  Tensor a = sh.tensor(DType::F32, Shape{2});
  Tensor b = all.tensor(DType::F32, Shape{2 * int64_t(W)});
  c.allgather(a, b);
  std::vector<float> host(size_t(2 * W));
  be.copy_to_host(host.data(), all.data(), host.size() * 4);
  std::vector<RankStat> out(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) out[size_t(r)] = {double(host[size_t(2 * r)]), double(host[size_t(2 * r + 1)])};
  return out;
}

void check_same_config(DistRuntime& d, const std::string& hash) {
  d.store->set(d.key("config_hash/" + std::to_string(d.env.rank)), hash);
  std::string ref = d.store->get_string(d.key("config_hash/0"));
  if (d.env.rank == 0) {
    for (int r = 1; r < d.env.world_size; ++r) {
      std::string h = d.store->get_string(d.key("config_hash/" + std::to_string(r)));
      if (h != hash)
        user_error("rank {} runs a different recipe than rank 0 (config hash {} vs {}): every rank must use the same "
                   "recipe and --set overrides", r, h.substr(0, 12), hash.substr(0, 12));
    }
  } else if (ref != hash) {
    user_error("rank {} runs a different recipe than rank 0 (config hash {} vs {}): every rank must use the same "
               "recipe and --set overrides", d.env.rank, hash.substr(0, 12), ref.substr(0, 12));
  }
}

void attach(DistRuntime& d, Session& s, double bucket_mb) {
  d.dp = std::make_unique<parallel::DataParallel>(
      *d.comm, s.params, parallel::DataParallelOptions{d.zero_stage, bucket_mb, d.sync_bn, d.shard_group_size, d.reduce_dtype,
                                                       d.compression});
  const FlatRange r = d.dp->optimizer_range();
  DTRAIN_CHECK(!s.opt || (s.opt->range_begin() == r.begin && (r.end < 0 || s.opt->range_end() == r.end)),
               "optimizer range differs from the ZeRO shard");
}

}  // namespace dtrain

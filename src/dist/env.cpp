#include "dist/env.h"

#include <cstdlib>
#include <optional>

#include "core/error.h"

namespace dtrain::dist {
namespace {

struct Env {
  const EnvLookup& get;
  std::optional<std::string> str(const char* name) const {
    const char* v = get(name);
    if (!v || !*v) return std::nullopt;
    return std::string(v);
  }
  std::optional<int> num(const char* name, int lo, int hi) const {
    auto s = str(name);
    if (!s) return std::nullopt;
    size_t pos = 0;
    long long v = 0;
    try {
      v = std::stoll(*s, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    if (pos == 0 || pos != s->size())
      user_error("environment variable {}='{}': expected an integer", name, *s);
    if (v < lo || v > hi)
      user_error("environment variable {}={}: expected a value in [{}, {}]", name, v, lo, hi);
    return int(v);
  }
};

constexpr int kMaxInt = 1 << 30;

// Slurm's SLURM_TASKS_PER_NODE looks like "4(x2),3"; the first count is ours when the
// layout is uniform, which is all we support without SLURM_NTASKS_PER_NODE.
std::optional<int> slurm_tasks_per_node(const Env& e) {
  if (auto n = e.num("SLURM_NTASKS_PER_NODE", 1, kMaxInt)) return n;
  auto s = e.str("SLURM_TASKS_PER_NODE");
  if (!s) return std::nullopt;
  size_t i = 0;
  while (i < s->size() && isdigit((unsigned char)(*s)[i])) ++i;
  if (i == 0) user_error("environment variable SLURM_TASKS_PER_NODE='{}': expected e.g. '4(x2)'", *s);
  return std::stoi(s->substr(0, i));
}

}  // namespace

DistEnv dist_env_from(const EnvLookup& getenv_fn) {
  Env e{getenv_fn};
  DistEnv d;
  const char* rank_var = "RANK";
  const char* world_var = "WORLD_SIZE";
  const char* local_var = "LOCAL_RANK";
  if (e.str("RANK") || e.str("WORLD_SIZE")) {
    d.source = e.str("DTRAIN_LAUNCHER")            ? "dtrain"
               : e.str("TORCHELASTIC_RUN_ID") ||
                       e.str("TORCHELASTIC_USE_AGENT_STORE") ? "torchrun"
                                                             : "env";
    d.rank = e.num("RANK", 0, kMaxInt).value_or(0);
    d.world_size = e.num("WORLD_SIZE", 1, kMaxInt).value_or(1);
    d.local_rank = e.num("LOCAL_RANK", 0, kMaxInt).value_or(d.rank);
    d.local_world_size = e.num("LOCAL_WORLD_SIZE", 1, kMaxInt).value_or(d.world_size);
    d.group_rank = e.num("GROUP_RANK", 0, kMaxInt).value_or(d.rank / d.local_world_size);
    d.restart_count = e.num("TORCHELASTIC_RESTART_COUNT", 0, kMaxInt).value_or(0);
  } else if (e.str("SLURM_PROCID") && e.str("SLURM_NTASKS")) {
    d.source = "slurm";
    rank_var = "SLURM_PROCID", world_var = "SLURM_NTASKS", local_var = "SLURM_LOCALID";
    d.rank = *e.num("SLURM_PROCID", 0, kMaxInt);
    d.world_size = *e.num("SLURM_NTASKS", 1, kMaxInt);
    d.local_rank = e.num("SLURM_LOCALID", 0, kMaxInt).value_or(0);
    d.local_world_size = slurm_tasks_per_node(e).value_or(d.world_size);
    d.group_rank = e.num("SLURM_NODEID", 0, kMaxInt).value_or(d.rank / d.local_world_size);
    d.restart_count = e.num("SLURM_RESTART_COUNT", 0, kMaxInt).value_or(0);
    if (!e.str("MASTER_ADDR"))
      if (auto a = e.str("SLURM_LAUNCH_NODE_IPADDR")) d.master_addr = *a;
  } else if (e.str("OMPI_COMM_WORLD_RANK") && e.str("OMPI_COMM_WORLD_SIZE")) {
    d.source = "mpi";
    rank_var = "OMPI_COMM_WORLD_RANK", world_var = "OMPI_COMM_WORLD_SIZE";
    local_var = "OMPI_COMM_WORLD_LOCAL_RANK";
    d.rank = *e.num("OMPI_COMM_WORLD_RANK", 0, kMaxInt);
    d.world_size = *e.num("OMPI_COMM_WORLD_SIZE", 1, kMaxInt);
    d.local_rank = e.num("OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxInt).value_or(0);
    d.local_world_size = e.num("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxInt).value_or(d.world_size);
    d.group_rank = e.num("OMPI_COMM_WORLD_NODE_RANK", 0, kMaxInt).value_or(d.rank / d.local_world_size);
  }
  if (auto a = e.str("MASTER_ADDR")) d.master_addr = *a;
  d.master_port = e.num("MASTER_PORT", 1, 65535).value_or(29500);
  if (d.rank >= d.world_size)
    user_error("environment variable {}={} must be below {}={}", rank_var, d.rank, world_var,
               d.world_size);
  if (d.local_rank >= d.local_world_size)
    user_error("environment variable {}={} must be below the local world size {}", local_var,
               d.local_rank, d.local_world_size);
  if (d.local_world_size > d.world_size)
    user_error("local world size {} exceeds {}={}", d.local_world_size, world_var, d.world_size);
  d.distributed = d.world_size > 1;
  d.job_token = e.str("DTRAIN_JOB_TOKEN").value_or("");
  auto agent = e.str("TORCHELASTIC_USE_AGENT_STORE");
  d.agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  if (auto p = e.str("DTRAIN_TCPSTORE_PROTOCOL")) {
    if (*p != "auto" && *p != "legacy" && *p != "validate")
      user_error("environment variable DTRAIN_TCPSTORE_PROTOCOL='{}': expected auto, legacy (torch <= 2.1) or "
                 "validate (torch >= 2.2)", *p);
    d.tcpstore_protocol = *p;
  }
  // The dtrain launcher (it sets DTRAIN_LAUNCHER=1) hosts dtrain's store itself; under
  // torchrun's agent store nobody does; under every other source rank 0 hosts it.
  d.host_store = d.distributed && d.rank == 0 && d.source != "dtrain" && !d.agent_store;
  return d;
}

DistEnv dist_env() {
  return dist_env_from([](const char* n) -> const char* { return std::getenv(n); });
}

}  // namespace dtrain::dist

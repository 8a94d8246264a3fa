#include "comm/env.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <optional>
#include <utility>
#include <vector>

#include "core/error.h"

namespace dtrain::comm {
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

// Slurm's task layouts look like "4(x2),3": 4 tasks on each of the first two nodes, 3 on
// the third. Returns the count of node `node` (SLURM_NODEID), the variable named in errors.
int slurm_tasks_on_node(const std::string& var, const std::string& s, int node) {
  const auto bad = [&] { user_error("environment variable {}='{}': expected e.g. '4(x2),3'", var, s); };
  std::vector<std::pair<int, long long>> layout;  // (tasks, nodes)
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    while (j < s.size() && isdigit((unsigned char)s[j])) ++j;
    if (j == i || j - i > 9) bad();
    const int count = std::stoi(s.substr(i, j - i));
    if (count < 1) bad();
    long long reps = 1;
    if (j < s.size() && s[j] == '(') {
      size_t k = j + 1;
      if (k >= s.size() || s[k] != 'x') bad();
      size_t m = ++k;
      while (m < s.size() && isdigit((unsigned char)s[m])) ++m;
      if (m == k || m - k > 9 || m >= s.size() || s[m] != ')') bad();
      reps = std::stoll(s.substr(k, m - k));
      j = m + 1;
    }
    layout.emplace_back(count, reps);
    if (j < s.size() && s[j] != ',') bad();
    if (j + 1 == s.size()) bad();  // a trailing comma
    i = j + 1;
  }
  long long seen = 0;
  for (auto [count, reps] : layout) {
    if (node < seen + reps) return count;
    seen += reps;
  }
  user_error("environment variable {}='{}' lists {} nodes, but SLURM_NODEID={}", var, s, seen, node);
}

}  // namespace

std::string slurm_first_host(const std::string& list) {
  // Hostlist expressions: "gpu[01-04,07],login2" or "rack[1-2]-n[3-4]": the first host keeps
  // each bracket's first number with its zero padding ("gpu01", "rack1-n3").
  std::string host;
  int depth = 0;
  bool first_in_bracket = false;
  for (char c : list) {
    if (depth == 0 && c == ',') break;
    if (c == '[') {
      ++depth, first_in_bracket = true;
    } else if (c == ']') {
      --depth;
    } else if (depth == 0) {
      host += c;
    } else if (first_in_bracket) {
      if (c == ',' || c == '-') first_in_bracket = false;
      else host += c;
    }
  }
  if (depth != 0 || host.empty())
    user_error("Slurm node list '{}': expected a host list such as 'node[01-04],login2'", list);
  return host;
}

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
    const auto node = e.num("SLURM_NODEID", 0, kMaxInt);
    // The step's layout (srun sets it) before the job's; --ntasks-per-node is uniform.
    if (auto v = e.str("SLURM_STEP_TASKS_PER_NODE"))
      d.local_world_size = slurm_tasks_on_node("SLURM_STEP_TASKS_PER_NODE", *v, node.value_or(0));
    else if (auto n = e.num("SLURM_NTASKS_PER_NODE", 1, kMaxInt))
      d.local_world_size = *n;
    else if (auto t = e.str("SLURM_TASKS_PER_NODE"))
      d.local_world_size = slurm_tasks_on_node("SLURM_TASKS_PER_NODE", *t, node.value_or(0));
    else
      d.local_world_size = d.world_size;
    d.group_rank = node.value_or(d.rank / d.local_world_size);
    d.restart_count = e.num("SLURM_RESTART_COUNT", 0, kMaxInt).value_or(0);
    // Rank 0 hosts the store and runs on the step's first node (srun's block and cyclic
    // distributions both put task 0 there), so that node is the master unless MASTER_ADDR
    // says otherwise. The port, unless MASTER_PORT is set, comes from the job id (15000 + its
    // last four digits, PyTorch Lightning's rule), so two jobs sharing a node do not collide.
    if (auto l = e.str("SLURM_STEP_NODELIST") ? e.str("SLURM_STEP_NODELIST")
                 : e.str("SLURM_JOB_NODELIST") ? e.str("SLURM_JOB_NODELIST")
                                               : e.str("SLURM_NODELIST"))
      d.master_addr = slurm_first_host(*l);
    else if (auto a = e.str("SLURM_LAUNCH_NODE_IPADDR"))
      d.master_addr = *a;
    if (auto job = e.num("SLURM_JOB_ID", 0, kMaxInt)) d.master_port = 15000 + *job % 10000;
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
  d.master_port = e.num("MASTER_PORT", 1, 65535).value_or(d.master_port);
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

CpuThreads cpu_threads_from(int configured, const std::string& configured_by, const EnvLookup& getenv_fn,
                            int affinity) {
  if (configured > 0) return {configured, configured_by};
  Env e{getenv_fn};
  if (auto n = e.num("OMP_NUM_THREADS", 1, 1 << 16)) return {*n, "OMP_NUM_THREADS"};
  const int local = dist_env_from(getenv_fn).local_world_size;
  const int cpus = std::max(1, affinity);
  return {std::max(1, cpus / local), fmt::format("{} CPU{} / {} local rank{}", cpus, cpus == 1 ? "" : "s", local,
                                                 local == 1 ? "" : "s")};
}

CpuThreads cpu_threads(int configured, const std::string& configured_by) {
  return cpu_threads_from(configured, configured_by, [](const char* n) -> const char* { return std::getenv(n); }, affinity_cpus());
}

int affinity_cpus() {
  // a mask as large as the kernel's (EINVAL: too small for its CPU count; grow it)
  for (int n = 1024; n <= (1 << 20); n *= 4) {
    cpu_set_t* set = CPU_ALLOC(size_t(n));
    if (!set) break;
    const size_t bytes = CPU_ALLOC_SIZE(size_t(n));
    CPU_ZERO_S(bytes, set);
    const bool ok = sched_getaffinity(0, bytes, set) == 0;
    const int err = errno;
    const int count = ok ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (ok) return std::max(1, count);
    if (err != EINVAL) break;
  }
  return 1;
}

}  // namespace dtrain::comm

#pragma once
// Rank discovery: who am I in the job? Read from, in order of precedence,
//   1. dtrain's launcher / torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//      GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT
//   2. Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, the local world
//      size from SLURM_STEP_TASKS_PER_NODE (else SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE;
//      "4(x2),3" layouts are read per node); master MASTER_ADDR, else the first host of
//      SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST / SLURM_NODELIST, else
//      SLURM_LAUNCH_NODE_IPADDR); port MASTER_PORT, else 15000 + SLURM_JOB_ID % 10000
//   3. Open MPI: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE, OMPI_COMM_WORLD_NODE_RANK
// MASTER_ADDR/MASTER_PORT default to 127.0.0.1:29500 when the source does not set them.
//
// Rendezvous store (see rendezvous.h): under torchrun with TORCHELASTIC_USE_AGENT_STORE=True
// (`agent_store`) every rank is a client of the agent's own c10d TCPStore at
// MASTER_ADDR:MASTER_PORT; otherwise dtrain's StoreServer listens on MASTER_PORT, hosted
// by dtrain's launcher or, without it, by rank 0 (`host_store`).
// DTRAIN_TCPSTORE_PROTOCOL = auto (default) | legacy | validate picks the c10d dialect
// (see c10d_store.h) instead of probing for it.
#include <functional>
#include <string>

namespace dtrain::comm {

struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1, group_rank = 0;
  int restart_count = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool agent_store = false;   // TORCHELASTIC_USE_AGENT_STORE=True: use torchrun's c10d store
  bool host_store = false;    // this process must host dtrain's store (rank 0 without launcher)
  std::string tcpstore_protocol = "auto";  // DTRAIN_TCPSTORE_PROTOCOL
  bool distributed = false;   // world_size > 1
  std::string job_token;      // DTRAIN_JOB_TOKEN, "" when unset
  // "dtrain" (dtrain's launcher, DTRAIN_LAUNCHER=1) | "torchrun" | "env" (RANK/WORLD_SIZE
  // set by hand) | "slurm" | "mpi" | "none"
  std::string source = "none";
};

using EnvLookup = std::function<const char*(const char*)>;  // getenv-like

// UserError naming the variable on unparsable or inconsistent values (rank >= world...).
DistEnv dist_env_from(const EnvLookup& getenv_fn);
DistEnv dist_env();  // from the process environment

// The first host of a Slurm host list ("gpu[01-04],login2" -> "gpu01"); UserError when
// the list is malformed.
std::string slurm_first_host(const std::string& list);

// CPU threads of this process (OpenMP team of oneDNN, cpu::sgemm and dtrain's loops),
// decided here and nowhere else:
//   1. `configured` (run.threads) when > 0;
//   2. else OMP_NUM_THREADS when set: a positive integer (UserError naming it otherwise);
//   3. else max(1, affinity_cpus / the local world size): the CPUs this process may run on
//      (sched_getaffinity), shared by the ranks on this node (dist_env_from's
//      local_world_size: LOCAL_WORLD_SIZE, Slurm's tasks per node, OMPI_COMM_WORLD_LOCAL_SIZE;
//      1 outside a launched job).
// The count changes the numerics (reductions split by thread), so equal counts give
// bit-identical losses whichever launcher started the ranks.
struct CpuThreads {
  int threads = 1;
  std::string source;  // `configured_by` | "OMP_NUM_THREADS" | "2 CPUs / 2 local ranks"
};
// configured > 0: that count, from `configured_by` (the recipe key that gave it)
CpuThreads cpu_threads_from(int configured, const std::string& configured_by, const EnvLookup& getenv_fn,
                            int affinity_cpus);
// this process: its environment and affinity mask
CpuThreads cpu_threads(int configured, const std::string& configured_by);
int affinity_cpus();  // CPUs in this process's affinity mask (at least 1)

}  // namespace dtrain::comm

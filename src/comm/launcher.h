#pragma once
// The launcher (`dtrain train --nproc-per-node N ...`): forks N workers on this node
// running worker_argv, with torchrun's environment:
//   RANK = node_rank * N + local, LOCAL_RANK, WORLD_SIZE = nnodes * N, LOCAL_WORLD_SIZE = N,
//   GROUP_RANK = node_rank, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
//   TORCHELASTIC_MAX_RESTARTS, DTRAIN_JOB_TOKEN, DTRAIN_LAUNCHER=1 (+ extra_env), and
//   OMP_NUM_THREADS = max(1, CPUs of the launcher's affinity mask / N) unless extra_env or
//   the launcher's environment sets it (one notice line says so, as torchrun's does).
// The node-0 launcher hosts the StoreServer on MASTER_PORT (so the store outlives worker
// restarts). Workers get their own process group (the terminal's Ctrl-C reaches only the
// launcher, which forwards it once) and die with SIGTERM if the launcher dies.
// SIGINT/SIGTERM to the launcher are forwarded to every worker and the launcher waits for
// them (they checkpoint and exit); a second signal kills them (SIGKILL).
// A worker failure (non-zero exit or a signal) terminates the others (SIGTERM, then
// SIGKILL after grace_s) and restarts the whole group while restarts remain
// (TORCHELASTIC_RESTART_COUNT grows; workers resume from the latest checkpoint), else
// launch() returns 1 after logging the failed rank and its status.
// With nnodes > 1 every node runs its own launcher; each restarts its own workers, which
// stays in step because a failure anywhere breaks every rank's collectives.
#include <map>
#include <string>
#include <vector>

namespace dtrain::comm {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int max_restarts = 0;
  double grace_s = 10;      // SIGTERM -> SIGKILL when killing workers after a failure
  // Shared secret of the job's store. "" -> DTRAIN_JOB_TOKEN from the environment, else
  // "dtrain:<master_addr>:<master_port>:<nnodes>x<nproc_per_node>" (the same on every node).
  std::string job_token;
  std::map<std::string, std::string> extra_env;  // e.g. OMP_NUM_THREADS (else each worker's share)
};

struct LaunchResult {
  int exit_code = 0;     // 0 all workers exited 0; 2 a worker exited 2 (a user error: never
                         // restarted); 1 another failure without restarts left or workers
                         // that did not exit 0 after a forwarded signal
  int restarts = 0;      // group restarts performed
  int failed_rank = -1;  // global rank of the last failure, -1 if none
  std::string message;   // one line describing the outcome (also logged)
  int forwarded_signal = 0;
};

// Validates options (UserError naming the option), runs the job, returns when done.
LaunchResult launch_workers(const LaunchOptions& opt, const std::vector<std::string>& worker_argv);
inline int launch(const LaunchOptions& opt, const std::vector<std::string>& worker_argv) {
  return launch_workers(opt, worker_argv).exit_code;
}

std::vector<std::string> current_argv();  // this process's argv (from /proc/self/cmdline)
// The workers' command line: `argv` without the launcher's own options `opts` (each given as
// "--opt V" or "--opt=V"), argv[0] replaced by `exe`.
std::vector<std::string> worker_argv(const std::vector<std::string>& argv, const std::string& exe,
                                     const std::vector<std::string>& opts);
std::string self_exe();                    // absolute path of this executable (/proc/self/exe)

}  // namespace dtrain::comm

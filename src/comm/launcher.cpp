#include "comm/launcher.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>

#include "core/error.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "core/signals.h"
#include "comm/env.h"
#include "comm/store.h"

extern char** environ;

namespace dtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int> g_signal{0};
std::atomic<int> g_signal_count{0};

void on_signal(int sig) {
  g_signal.store(sig);
  g_signal_count.fetch_add(1);
}

struct Worker {
  int global_rank = 0;
  pid_t pid = -1;
  bool alive = false;
  int status = 0;  // waitpid status once exited
};

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("wait status {}", status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// Builds envp (inherited environment with overrides) before fork: the child of a
// multi-threaded process may only call async-signal-safe functions until exec.
std::vector<std::string> make_env(const std::map<std::string, std::string>& over) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos && over.count(kv.substr(0, eq))) continue;
    env.push_back(std::move(kv));
  }
  for (auto& [k, v] : over) env.push_back(k + "=" + v);
  return env;
}

pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  std::vector<char*> a, e;
  for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  for (auto& s : env) e.push_back(const_cast<char*>(s.c_str()));
  e.push_back(nullptr);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) fault("launcher: fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);  // the launcher died before prctl
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execvpe(a[0], a.data(), e.data());
    const char msg[] = "dtrain launcher: exec of the worker failed\n";
    (void)!write(2, msg, sizeof(msg) - 1);
    _exit(127);
  }
  return pid;
}

// Reaps exited workers without blocking; returns the index of a newly failed one or -1.
int reap(std::vector<Worker>& ws) {
  int failed_idx = -1;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (!ws[i].alive) continue;
    int st = 0;
    pid_t r = waitpid(ws[i].pid, &st, WNOHANG);
    if (r == ws[i].pid) {
      ws[i].alive = false;
      ws[i].status = st;
      if (failed(st) && failed_idx < 0) failed_idx = int(i);
    }
  }
  return failed_idx;
}

int alive_count(const std::vector<Worker>& ws) {
  int n = 0;
  for (auto& w : ws) n += w.alive;
  return n;
}

void signal_all(std::vector<Worker>& ws, int sig) {
  for (auto& w : ws)
    if (w.alive) kill(w.pid, sig);
}

// SIGTERM, then SIGKILL after grace_s; returns when every worker has been reaped.
void terminate_all(std::vector<Worker>& ws, double grace_s) {
  signal_all(ws, SIGTERM);
  auto kill_at = Clock::now() + std::chrono::milliseconds(int64_t(grace_s * 1000));
  bool killed = false;
  while (alive_count(ws)) {
    reap(ws);
    if (!killed && Clock::now() >= kill_at) {
      signal_all(ws, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void validate(const LaunchOptions& o, const std::vector<std::string>& argv) {
  if (o.nproc_per_node < 1) user_error("--nproc-per-node {}: expected at least 1", o.nproc_per_node);
  if (o.nnodes < 1) user_error("--nnodes {}: expected at least 1", o.nnodes);
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    user_error("--node-rank {}: expected a value in [0, {})", o.node_rank, o.nnodes);
  if (o.master_port < 1 || o.master_port > 65535)
    user_error("--master-port {}: expected a port in [1, 65535]", o.master_port);
  if (o.master_addr.empty()) user_error("--master-addr: expected a host name or address");
  if (o.max_restarts < 0) user_error("--max-restarts {}: expected 0 or more", o.max_restarts);
  if (argv.empty()) user_error("launcher: no worker command given");
}

// Cross-node agreement on the restart count (torchelastic's rendezvous rounds). Every node's
// launcher restarts its own workers; a failure on one node usually breaks the collectives of
// every rank, so all restart together, but not always: workers that fail before their
// rendezvous leave the other nodes' workers waiting in the old round's keys (the store keys are
// prefixed with the restart count) until they time out, and a node that fails more often
// drifts ahead. So a launcher whose group failed opens the next round in the store
// (`launcher/round/<n>`), and a launcher whose workers still run sees it within ~250 ms and
// restarts into that round too. Best effort: when the store cannot be reached (its node cut
// off or gone) the workers fail on their own and the launcher restarts as before.
class Rounds {
 public:
  Rounds(const LaunchOptions& o, std::string token) : o_(o), token_(std::move(token)) {}
  void open(int round) {
    with_store([&](Store& st) { st.set(key(round), std::string("1")); });
  }
  bool opened(int round) {
    bool yes = false;
    with_store([&](Store& st) { yes = st.check({key(round)}); });
    return yes;
  }
  // Rate-limits polling from the launcher's 10 ms loop.
  bool due() {
    const auto now = Clock::now();
    if (now < next_poll_) return false;
    next_poll_ = now + std::chrono::milliseconds(250);
    return true;
  }

 private:
  static std::string key(int round) { return "launcher/round/" + std::to_string(round); }
  template <class F>
  void with_store(F&& f) {
    try {
      StoreDeadline deadline(Clock::now() + std::chrono::milliseconds(500));
      if (!client_) {
        if (Clock::now() < next_connect_) return;
        next_connect_ = Clock::now() + std::chrono::seconds(2);
        client_ = std::make_unique<StoreClient>(o_.master_addr, o_.master_port, token_, std::chrono::milliseconds(500));
      }
      f(*client_);
    } catch (const Error&) {
      client_.reset();  // unreachable for now: the next call reconnects (at most every 2 s)
    }
  }
  const LaunchOptions& o_;
  std::string token_;
  std::unique_ptr<StoreClient> client_;
  Clock::time_point next_poll_{}, next_connect_{};
};

}  // namespace

LaunchResult launch_workers(const LaunchOptions& opt, const std::vector<std::string>& worker_argv) {
  validate(opt, worker_argv);
  std::string token = opt.job_token;
  if (token.empty()) {
    const char* t = std::getenv("DTRAIN_JOB_TOKEN");
    token = (t && *t) ? t
                      : fmt::format("dtrain:{}:{}:{}x{}", opt.master_addr, opt.master_port,
                                    opt.nnodes, opt.nproc_per_node);
  }
  std::unique_ptr<StoreServer> server;
  if (opt.node_rank == 0) server = std::make_unique<StoreServer>("", opt.master_port, token);

  // Each worker's share of this node's CPUs, as torchrun gives each worker 1 thread: N workers
  // that each took every CPU would oversubscribe them N times over (and run other numerics
  // than workers started by mpirun or srun, see comm::cpu_threads).
  std::map<std::string, std::string> worker_env = opt.extra_env;
  const char* user_omp = std::getenv("OMP_NUM_THREADS");
  if (!worker_env.count("OMP_NUM_THREADS") && !(user_omp && *user_omp)) {
    const int cpus = affinity_cpus();
    const int share = std::max(1, cpus / opt.nproc_per_node);
    worker_env["OMP_NUM_THREADS"] = std::to_string(share);
    log::info("launcher: setting OMP_NUM_THREADS={} for each of {} workers ({} CPUs on this node); set it to override",
              share, opt.nproc_per_node, cpus);
  }

  // SIGINT/SIGTERM for the launcher's lifetime (the old handlers come back at the end)
  g_signal = 0;
  g_signal_count = 0;
  StopSignalScope signals(on_signal);
  LaunchResult res;
  const int world = opt.nnodes * opt.nproc_per_node;
  std::optional<Rounds> rounds;
  if (opt.nnodes > 1 && opt.max_restarts > 0) rounds.emplace(opt, token);
  for (int attempt = 0;; ++attempt) {
    std::vector<Worker> ws(size_t(opt.nproc_per_node));
    for (int l = 0; l < opt.nproc_per_node; ++l) {
      auto env = worker_env;
      int rank = opt.node_rank * opt.nproc_per_node + l;
      env["RANK"] = std::to_string(rank);
      env["LOCAL_RANK"] = std::to_string(l);
      env["WORLD_SIZE"] = std::to_string(world);
      env["LOCAL_WORLD_SIZE"] = std::to_string(opt.nproc_per_node);
      env["GROUP_RANK"] = std::to_string(opt.node_rank);
      env["MASTER_ADDR"] = opt.master_addr;
      env["MASTER_PORT"] = std::to_string(opt.master_port);
      env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
      env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(opt.max_restarts);
      env["DTRAIN_JOB_TOKEN"] = token;
      env["DTRAIN_LAUNCHER"] = std::string(1, '1');  // not = "1": GCC 12 -Wrestrict false positive
      env.erase("TORCHELASTIC_USE_AGENT_STORE");
      ws[size_t(l)] = Worker{rank, -1, false, 0};
      ws[size_t(l)].pid = spawn(worker_argv, make_env(env));
      ws[size_t(l)].alive = true;
    }
    log::info("launcher: started {} worker(s) (ranks {}-{} of {}), attempt {}", ws.size(),
              ws.front().global_rank, ws.back().global_rank, world, attempt);

    int failed_idx = -1;
    int forwarded = 0;
    bool followed = false;  // another node opened the next round while these workers ran
    while (alive_count(ws)) {
      int sig = g_signal.load();
      if (sig && !forwarded) {
        log::warn("launcher: got signal {}, forwarding it to the workers", sig);
        signal_all(ws, sig);
        forwarded = sig;
        res.forwarded_signal = sig;
      } else if (forwarded && g_signal_count.load() > 1) {
        log::warn("launcher: second signal, killing the workers");
        signal_all(ws, SIGKILL);
      }
      int f = reap(ws);
      if (f >= 0 && !forwarded) {
        failed_idx = f;
        break;
      }
      if (rounds && !forwarded && rounds->due() && rounds->opened(attempt + 1)) {
        followed = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (forwarded) {
      bool all_ok = true;
      for (auto& w : ws) all_ok = all_ok && !failed(w.status);
      res.exit_code = all_ok ? 0 : 1;
      res.message = fmt::format("launcher: stopped by signal {}; workers {}", forwarded,
                                all_ok ? "exited cleanly" : "did not all exit 0");
      log::warn("{}", res.message);
      return res;
    }
    if (followed) {
      terminate_all(ws, opt.grace_s);
      const std::string what = fmt::format("another node restarted the group (round {} opened)", attempt + 1);
      if (attempt < opt.max_restarts && !g_signal.load()) {
        ++res.restarts;
        log::warn("launcher: {}; restarting the group ({} of {} restarts)", what, attempt + 1, opt.max_restarts);
        continue;
      }
      res.exit_code = 1;
      res.message = fmt::format("launcher: {}; no restarts left (max_restarts = {})", what, opt.max_restarts);
      log::error("{}", res.message);
      return res;
    }
    if (failed_idx < 0) {
      res.exit_code = 0;
      res.message = fmt::format("launcher: all {} worker(s) finished", ws.size());
      return res;
    }
    const Worker& bad = ws[size_t(failed_idx)];
    res.failed_rank = bad.global_rank;
    std::string what = fmt::format("worker rank {} (pid {}) failed with {}", bad.global_rank,
                                   bad.pid, describe(bad.status));
    // The others usually fail a moment later on their own (a collective, the checkpoint
    // verdict) and say why: give them up to a second before stopping them.
    for (auto until = Clock::now() + std::chrono::milliseconds(int64_t(std::min(1.0, opt.grace_s) * 1000));
         alive_count(ws) && Clock::now() < until;) {
      reap(ws);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    terminate_all(ws, opt.grace_s);
    // exit 2 is a user error (the recipe, the data, a checkpoint) the worker has named on its
    // own line: a restart would fail the same way, and the job ends with the same code
    if (WIFEXITED(bad.status) && WEXITSTATUS(bad.status) == 2) {
      res.exit_code = 2;
      res.message = fmt::format("launcher: worker rank {} stopped on a user error (exit 2): not restarting",
                                bad.global_rank);
      log::info("{}", res.message);
      return res;
    }
    if (attempt < opt.max_restarts && !g_signal.load()) {
      ++res.restarts;
      if (rounds) rounds->open(attempt + 1);  // the other nodes follow into the same round
      log::warn("launcher: {}; restarting the group ({} of {} restarts)", what, attempt + 1,
                opt.max_restarts);
      continue;
    }
    res.exit_code = 1;
    res.message = fmt::format("launcher: {}; no restarts left (max_restarts = {})", what, opt.max_restarts);
    log::error("{}", res.message);
    return res;
  }
}

std::vector<std::string> worker_argv(const std::vector<std::string>& argv, const std::string& exe,
                                     const std::vector<std::string>& opts) {
  std::vector<std::string> out{exe};
  for (size_t i = 1; i < argv.size(); ++i) {
    bool drop = false;
    for (const std::string& opt : opts) {
      if (argv[i] == opt) {
        drop = true;
        ++i;  // its value
        break;
      }
      if (argv[i].rfind(opt + "=", 0) == 0) {
        drop = true;
        break;
      }
    }
    if (!drop) out.push_back(argv[i]);
  }
  return out;
}

std::vector<std::string> current_argv() {
  std::string s = fs::read_file("/proc/self/cmdline");
  std::vector<std::string> out;
  size_t b = 0;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == '\0') {
      out.push_back(s.substr(b, i - b));
      b = i + 1;
    }
  if (b < s.size()) out.push_back(s.substr(b));
  return out;
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) fault("launcher: cannot read /proc/self/exe: {}", std::strerror(errno));
  return std::string(buf, size_t(n));
}

}  // namespace dtrain::comm

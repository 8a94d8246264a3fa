#pragma once
// "Nodes" that are really apart on one machine: each one a Linux network namespace with its
// own address and interface name, joined by a bridge (docs/distributed.md, "Nodes in network
// namespaces").
//
//   NetnsNodes net(3);                       // namespaces dtrain-nn-<pid>-n0..n2 (+ -br)
//   if (!net.ok()) SKIP_TEST(net.why_not()); // not root, no `ip`, no CAP_NET_ADMIN, ...
//   BgProc p(net.exec(0) + "dtrain train ...", log);  // runs inside node 0's namespace
//   net.cut(1);                              // ip link set <node 1's veth> down
//
// Layout: a namespace <prefix>-br holds the bridge `br0` (so the root namespace is never
// touched); node i's namespace <prefix>-n<i> holds `lo` and the veth `dtn<i>` (a distinct name
// per node) with address 10.<a>.<b>.<i + 1>/24, its peer `p<i>` enslaved to the bridge; and
// /etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts, names the nodes
// dtnode0, dtnode1, ... The destructor kills every process left in the namespaces and deletes
// them (and the /etc/netns directories), also when the test failed; the constructor first
// removes those of crashed runs (the prefix with a pid that is no longer alive). Every step
// runs `ip` (iproute2); when one fails, ok() is false, why_not() names the command and its
// error, and the test skips visibly (tests/support/skip.h).
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "run_cmd.h"

class NetnsNodes {
 public:
  static constexpr const char* kPrefix = "dtrain-nn-";

  explicit NetnsNodes(int nodes) : n_(nodes) {
    const long pid = long(getpid());
    prefix_ = kPrefix + std::to_string(pid);
    subnet_ = "10." + std::to_string(100 + pid % 100) + "." + std::to_string((pid / 100) % 250) + ".";
    if (run_cmd("command -v ip").code != 0) {
      why_ = "no `ip` command (iproute2) on this machine";
      return;
    }
    remove_stale();
    if (!step("ip netns add " + bridge_ns())) return;
    created_.push_back(bridge_ns());
    if (!step("ip -n " + bridge_ns() + " link add br0 type bridge") ||
        !step("ip -n " + bridge_ns() + " link set br0 up") || !step("ip -n " + bridge_ns() + " link set lo up"))
      return;
    for (int i = 0; i < n_; ++i) {
      const std::string ns = this->ns(i), p = "p" + std::to_string(i);
      if (!step("ip netns add " + ns)) return;
      created_.push_back(ns);
      if (!step("ip link add " + iface(i) + " netns " + ns + " type veth peer name " + p + " netns " + bridge_ns()) ||
          !step("ip -n " + bridge_ns() + " link set " + p + " master br0") ||
          !step("ip -n " + bridge_ns() + " link set " + p + " up") ||
          !step("ip -n " + ns + " addr add " + addr(i) + "/24 dev " + iface(i)) ||
          !step("ip -n " + ns + " link set " + iface(i) + " up") || !step("ip -n " + ns + " link set lo up"))
        return;
    }
    // Host names: `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts.
    std::string hosts = "127.0.0.1 localhost\n::1 localhost\n";
    for (int i = 0; i < n_; ++i) hosts += addr(i) + " " + host(i) + "\n";
    for (int i = 0; i < n_; ++i) {
      std::error_code ec;
      std::filesystem::create_directories(etc_dir(i), ec);
      std::ofstream f(etc_dir(i) + "/hosts");
      f << hosts;
      if (ec || !f.good()) {
        why_ = "cannot write " + etc_dir(i) + "/hosts (the per-namespace hosts file of `ip netns exec`)";
        return;
      }
    }
    ok_ = true;
  }
  ~NetnsNodes() { teardown(); }
  NetnsNodes(const NetnsNodes&) = delete;
  NetnsNodes& operator=(const NetnsNodes&) = delete;

  bool ok() const { return ok_; }
  const std::string& why_not() const { return why_; }
  int size() const { return n_; }
  std::string ns(int i) const { return prefix_ + "-n" + std::to_string(i); }
  std::string bridge_ns() const { return prefix_ + "-br"; }
  std::string addr(int i) const { return subnet_ + std::to_string(i + 1); }
  std::string iface(int i) const { return "dtn" + std::to_string(i); }
  // The prefix of a shell command that runs inside node i's namespace.
  std::string exec(int i) const { return "ip netns exec " + ns(i) + " "; }
  // Node i's host name, host_prefix() + i: the hosts file of every namespace maps each to its
  // node's address (so `dtnode[0-2]` works as a Slurm node list).
  static std::string host_prefix() { return "dtnode"; }
  std::string host(int i) const { return host_prefix() + std::to_string(i); }
  // As exec(i), with the host name host(i) (a UTS namespace of its own): gethostname() in
  // the command returns it, as on a machine of its own.
  std::string exec_as_host(int i) const {
    return exec(i) + "unshare --uts sh -c 'hostname " + host(i) + " && exec \"$0\" \"$@\"' ";
  }

  // Cuts node i's link (its veth goes down: no route to the others) or brings it back.
  bool cut(int i) { return run_cmd("ip -n " + ns(i) + " link set " + iface(i) + " down").code == 0; }
  bool restore(int i) { return run_cmd("ip -n " + ns(i) + " link set " + iface(i) + " up").code == 0; }
  // Node i disappears: SIGKILL to every process in its namespace, then the namespace (and with
  // it the veth pair) is deleted. `silent`: the link goes first, so the others see no FIN.
  bool remove(int i, bool silent) {
    if (silent && run_cmd("ip -n " + ns(i) + " link del " + iface(i)).code != 0) return false;
    kill_all(ns(i));
    const bool ok = run_cmd("ip netns del " + ns(i)).code == 0;
    std::erase(created_, ns(i));
    return ok;
  }

 private:
  bool step(const std::string& cmd) {
    auto r = run_cmd(cmd);
    if (r.code == 0) return true;
    std::string err = r.err;
    while (!err.empty() && (err.back() == '\n' || err.back() == ' ')) err.pop_back();
    why_ = "cannot build network namespaces: `" + cmd + "` failed (exit " + std::to_string(r.code) + "): " + err +
           (geteuid() != 0 ? " (not root: needs CAP_NET_ADMIN and CAP_SYS_ADMIN)" : "");
    return false;
  }

  // SIGKILL to every process in namespace `ns`, until none is left (a launcher may fork).
  static void kill_all(const std::string& ns) {
    for (int round = 0; round < 50; ++round) {
      auto r = run_cmd("ip netns pids " + ns + " 2>/dev/null");
      std::istringstream in(r.out);
      bool any = false;
      for (long pid; in >> pid;) {
        if (pid > 0 && pid != long(getpid())) kill(pid_t(pid), SIGKILL), any = true;
      }
      if (!any) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  std::string etc_dir(int i) const { return "/etc/netns/" + ns(i); }

  void teardown() {
    for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
      kill_all(*it);
      run_cmd("ip netns del " + *it + " 2>/dev/null");
    }
    created_.clear();
    std::error_code ec;
    for (int i = 0; i < n_; ++i) std::filesystem::remove_all(etc_dir(i), ec);
  }

  // Namespaces (and /etc/netns directories) of earlier runs that crashed before their
  // destructor: the prefix with a pid that is no longer alive. Those of test processes running
  // now are left alone.
  static bool stale(const std::string& name) {
    if (name.rfind(kPrefix, 0) != 0) return false;
    const long pid = std::atol(name.c_str() + std::string(kPrefix).size());
    if (pid <= 0) return false;
    // gone, or a zombie (killed, not yet reaped by its parent)
    std::ifstream st("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(st, line)) return true;
    const size_t p = line.rfind(')');
    return p != std::string::npos && p + 2 < line.size() && line[p + 2] == 'Z';
  }
  static void remove_stale() {
    auto r = run_cmd("ip netns list 2>/dev/null");
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);) {
      const std::string name = line.substr(0, line.find(' '));
      if (!stale(name)) continue;
      kill_all(name);
      run_cmd("ip netns del " + name + " 2>/dev/null");
    }
    std::error_code ec;
    std::vector<std::filesystem::path> dirs;
    for (auto& e : std::filesystem::directory_iterator("/etc/netns", ec))
      if (stale(e.path().filename().string())) dirs.push_back(e.path());
    for (auto& d : dirs) std::filesystem::remove_all(d, ec);
  }

  int n_;
  std::string prefix_, subnet_, why_;
  bool ok_ = false;
  std::vector<std::string> created_;
};

// A shell command in the background (its own process group), stdout and stderr to `log`.
// The destructor kills the group if it is still running.
class BgProc {
 public:
  using Clock = std::chrono::steady_clock;
  BgProc(const std::string& cmd, const std::string& log) : log_(log) {
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      const std::string full = "exec > " + shell_quote(log) + " 2>&1 </dev/null; exec " + cmd;
      execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    if (pid_ > 0) setpgid(pid_, pid_);
  }
  ~BgProc() {
    if (pid_ > 0 && code_ == kRunning) {
      kill(-pid_, SIGKILL);
      int st = 0;
      waitpid(pid_, &st, 0);
    }
  }
  BgProc(const BgProc&) = delete;
  BgProc& operator=(const BgProc&) = delete;

  static constexpr int kRunning = -1000;
  // Exit code (128 + signal when killed), or kRunning when it did not end by `deadline`.
  int wait_until(Clock::time_point deadline) {
    while (code_ == kRunning && pid_ > 0) {
      int st = 0;
      pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        code_ = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
        ended_ = Clock::now();
        break;
      }
      if (Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return code_;
  }
  int wait_for(double seconds) {
    return wait_until(Clock::now() + std::chrono::milliseconds(int64_t(seconds * 1000)));
  }
  int code() const { return code_; }
  Clock::time_point ended() const { return ended_; }
  std::string output() const {
    std::ifstream f(log_, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int code_ = kRunning;
  Clock::time_point ended_{};
};

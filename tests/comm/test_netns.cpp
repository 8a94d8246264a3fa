// Nodes that are really apart: each "node" is a network namespace of its own with its own
// address and interface name (tests/support/netns_fixture.h), so the ranks of different nodes reach
// each other only through their veths and a bridge, as on a cluster. The real binary, CPU,
// Gloo, tiny recipes, 1 thread per rank.
//   * 2 nodes x 2 workers under dtrain's launcher (--master-addr = node 0's address,
//     GLOO_SOCKET_IFNAME = each node's veth), 3 nodes x 1 worker with torchrun's variables
//     and with Slurm's (the master is the first host of SLURM_STEP_NODELIST, each node with
//     its own host name): the per-step losses of one process with grad_accum = the world size.
//   * Faults: a node's link cut mid-training, the store's node disappearing, a node that
//     joins late. Every rank of every node must exit non-zero within parallel.timeout_s (plus
//     the arrival grace and a little slack) with a line naming the peer, or train on.
// Ports 29600-29609 (each namespace has its own port space anyway).
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "netns_fixture.h"
#include "checkpoint_fixture.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "skip.h"

namespace stdfs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_netns";

// No launcher variables from the environment the tests run in.
const std::string kCleanEnv =
    "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK -u TORCHELASTIC_RESTART_COUNT "
    "-u TORCHELASTIC_USE_AGENT_STORE -u TORCHELASTIC_RUN_ID -u DTRAIN_LAUNCHER -u DTRAIN_JOB_TOKEN -u SLURM_PROCID "
    "-u SLURM_NTASKS -u SLURM_LOCALID -u SLURM_NTASKS_PER_NODE -u SLURM_TASKS_PER_NODE -u SLURM_NODEID "
    "-u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_LOCAL_RANK -u OMPI_COMM_WORLD_LOCAL_SIZE "
    "-u OMPI_COMM_WORLD_NODE_RANK -u SLURM_STEP_TASKS_PER_NODE -u SLURM_STEP_NODELIST -u SLURM_JOB_NODELIST "
    "-u SLURM_NODELIST -u SLURM_JOB_ID -u SLURM_LAUNCH_NODE_IPADDR -u MASTER_ADDR -u MASTER_PORT -u OMP_NUM_THREADS "
    "-u GLOO_SOCKET_IFNAME -u DTRAIN_GLOO_IFACE -u DTRAIN_GLOO_HOST -u DTRAIN_FAILPOINTS ";

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string log_of(const std::string& name, int node) { return kWork + "/" + name + ".node" + std::to_string(node) + ".log"; }

// kind "resnet" (12x12 synthetic images) or "gpt" (synthetic tokens), 6 steps, 1 thread per
// rank; removes the run directory.
std::string recipe(const std::string& name, const std::string& kind, int timeout_s, const std::string& extra = "") {
  stdfs::create_directories(kWork);
  stdfs::remove_all(run_dir(name));
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 5\ndevice = \"cpu\"\nthreads = 1\n";
  if (kind == "gpt")
    f << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\nvocab_size = 256\n"
      << "[data]\nkind = \"synthetic\"\n"
      << "[train]\nbatch_size = 4\nmax_steps = 6\n"
      << "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.0\n";
  else
    f << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
      << "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
      << "[train]\nbatch_size = 8\nmax_steps = 6\n"
      << "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nweight_decay = 5e-4\n";
  f << "[checkpoint]\nevery_steps = 1000\n"
    << "[eval]\nevery_steps = 0\nbatch_size = 4\nmax_batches = 1\n"
    << "[log]\nevery_steps = 1\ntensorboard = false\n"
    << "[parallel]\ntimeout_s = " << timeout_s << "\n"
    << extra;
  return path;
}

std::string train(const std::string& rec, const std::string& args = "") { return kBin + " train " + rec + " " + args; }

std::vector<double> losses(const std::string& name) { return train_losses(run_dir(name)); }

int world_size(const std::string& name) {
  for (auto& r : metric_rows(run_dir(name), "train")) return r.value("world_size", 1);
  return 0;
}

int64_t last_step(const std::string& name) {
  int64_t s = 0;
  for (auto& r : metric_rows(run_dir(name), "train")) s = r["step"].get<int64_t>();
  return s;
}


double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// One background process per node; waits for all of them (at most `limit_s` each, from now).
struct Cluster {
  std::vector<std::unique_ptr<BgProc>> nodes;
  void start(const std::string& cmd, const std::string& log) { nodes.push_back(std::make_unique<BgProc>(cmd, log)); }
  // Polls every node together (so each one's ended() is when it ended, give or take 20 ms).
  std::vector<int> wait_all(double limit_s) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(limit_s * 1000));
    while (true) {
      std::vector<int> codes;
      bool running = false;
      for (auto& n : nodes) {
        codes.push_back(n->wait_until(Clock::now()));
        running = running || codes.back() == BgProc::kRunning;
      }
      if (!running || Clock::now() >= deadline) return codes;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::string outputs() const {
    std::string s;
    for (size_t i = 0; i < nodes.size(); ++i) s += fmt::format("---- node {} ----\n{}", i, nodes[i]->output());
    return s;
  }
};

// Waits until rank 0 logged `step` (false after `limit_s`).
bool wait_for_step(const std::string& name, int64_t step, double limit_s) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(limit_s * 1000));
  while (Clock::now() < deadline) {
    if (last_step(name) >= step) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// The line of `text` that contains `needle` ("" when none).
std::string line_with(const std::string& text, const std::string& needle) {
  size_t p = text.find(needle);
  if (p == std::string::npos) return "";
  size_t b = text.rfind('\n', p);
  b = b == std::string::npos ? 0 : b + 1;
  size_t e = text.find('\n', p);
  return text.substr(b, e == std::string::npos ? std::string::npos : e - b);
}

// `--nnodes N --nproc-per-node P --node-rank r --master-addr <node 0> --master-port PORT` in
// node r's namespace, GLOO_SOCKET_IFNAME = its veth.
std::string launcher_cmd(const NetnsNodes& net, int node, int nproc, int port, const std::string& rec,
                         const std::string& env = "", const std::string& args = "") {
  return net.exec(node) + kCleanEnv + "GLOO_SOCKET_IFNAME=" + net.iface(node) + " " + env + " " +
         train(rec, fmt::format("--nnodes {} --nproc-per-node {} --node-rank {} --master-addr {} --master-port {} {}",
                                net.size(), nproc, node, net.addr(0), port, args));
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("netns: 2 nodes x 2 workers under dtrain's launcher give the losses of 1 process with grad_accum 4") {
  NetnsNodes net(2);
  if (!net.ok()) SKIP_TEST(net.why_not());
  const auto t0 = Clock::now();
  const std::string rec = recipe("nn_launch", "resnet", 30);
  auto ref = run_cmd(kCleanEnv + train(recipe("nn_launch_ref", "resnet", 30), "--set train.grad_accum=4"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  Cluster c;
  for (int n = 0; n < 2; ++n) c.start(launcher_cmd(net, n, 2, 29600, rec), log_of("nn_launch", n));
  auto codes = c.wait_all(90);
  INFO(c.outputs());
  CHECK(codes == std::vector<int>{0, 0});
  CHECK(world_size("nn_launch") == 4);
  check_close("2 nodes x 2 vs grad_accum 4", losses("nn_launch"), losses("nn_launch_ref"), 6);
  MESSAGE(fmt::format("took {:.1f} s", seconds(t0, Clock::now())));
}

TEST_CASE("netns: 3 nodes x 1 worker with torchrun's variables give the losses of 1 process with grad_accum 3") {
  NetnsNodes net(3);
  if (!net.ok()) SKIP_TEST(net.why_not());
  const auto t0 = Clock::now();
  const std::string rec = recipe("nn_torchrun", "gpt", 30);
  auto ref = run_cmd(kCleanEnv + train(recipe("nn_torchrun_ref", "gpt", 30), "--set train.grad_accum=3"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  Cluster c;
  for (int n = 0; n < 3; ++n)
    c.start(net.exec(n) + kCleanEnv +
                fmt::format("RANK={0} WORLD_SIZE=3 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK={0} "
                            "TORCHELASTIC_RESTART_COUNT=0 TORCHELASTIC_RUN_ID=netns MASTER_ADDR={1} MASTER_PORT=29601 "
                            "GLOO_SOCKET_IFNAME={2} ",
                            n, net.addr(0), net.iface(n)) +
                train(rec),
            log_of("nn_torchrun", n));
  auto codes = c.wait_all(90);
  INFO(c.outputs());
  CHECK(codes == std::vector<int>{0, 0, 0});
  CHECK(world_size("nn_torchrun") == 3);
  check_close("3 nodes (torchrun) vs grad_accum 3", losses("nn_torchrun"), losses("nn_torchrun_ref"), 6);
  MESSAGE(fmt::format("took {:.1f} s", seconds(t0, Clock::now())));
}

// As srun starts tasks: no MASTER_ADDR and no interface variable. Each node has its own host
// name (a UTS namespace); the hosts file of every namespace maps them to the nodes' addresses.
// The master is the first host of SLURM_STEP_NODELIST, and Gloo's own address is this node's
// host name, as on a cluster whose host names resolve to the nodes' interfaces.
TEST_CASE("netns: 3 nodes x 1 worker with Slurm's variables give the losses of 1 process with grad_accum 3") {
  for (const char* tool : {"unshare", "hostname"})
    if (run_cmd(std::string("command -v ") + tool).code != 0)
      SKIP_TEST(tool << " not found (util-linux, hostname): each node needs a host name of its own");
  NetnsNodes net(3);
  if (!net.ok()) SKIP_TEST(net.why_not());
  const auto t0 = Clock::now();
  const std::string rec = recipe("nn_slurm", "resnet", 30);
  auto ref = run_cmd(kCleanEnv + train(recipe("nn_slurm_ref", "resnet", 30), "--set train.grad_accum=3"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  Cluster c;
  for (int n = 0; n < 3; ++n)
    c.start(net.exec_as_host(n) + kCleanEnv +
                fmt::format("SLURM_PROCID={0} SLURM_NTASKS=3 SLURM_LOCALID=0 SLURM_NODEID={0} "
                            "SLURM_STEP_TASKS_PER_NODE='1(x3)' SLURM_STEP_NODELIST='{1}[0-2]' SLURM_JOB_ID=4242 "
                            "MASTER_PORT=29602 ",
                            n, net.host_prefix()) +
                train(rec),
            log_of("nn_slurm", n));
  auto codes = c.wait_all(90);
  INFO(c.outputs());
  CHECK(codes == std::vector<int>{0, 0, 0});
  CHECK(world_size("nn_slurm") == 3);
  check_close("3 nodes (Slurm) vs grad_accum 3", losses("nn_slurm"), losses("nn_slurm_ref"), 6);
  // every rank under its node's own host name (gathered through the store)
  auto rows = metric_rows(run_dir("nn_slurm"), "train");
  REQUIRE(!rows.empty());
  REQUIRE(rows.back().contains("ranks"));
  for (int r = 0; r < 3; ++r) CHECK(rows.back()["ranks"][size_t(r)]["host"] == net.host(r));
  MESSAGE(fmt::format("took {:.1f} s", seconds(t0, Clock::now())));
}

// Faults. parallel.timeout_s = kFaultTimeout; the arrival report after a failed collective waits
// a quarter of it (docs/distributed.md, "Communicators"); the limit adds some slack for process
// exit on a loaded machine.
constexpr int kFaultTimeout = 8;
constexpr double kFaultLimit = kFaultTimeout + kFaultTimeout / 4.0 + 4.0;

// Node 1's veth goes down after step 3 (rank 0 sleeps 100 ms a step, so the run is still going).
// Nodes 0 and 2 time out in their collective and name rank 1, which never recorded its failure
// in the store; node 1 reaches neither its peers nor the store, and says so.
TEST_CASE("netns: a link cut mid-training makes every rank of every node exit non-zero within the timeout") {
  NetnsNodes net(3);
  if (!net.ok()) SKIP_TEST(net.why_not());
  const auto t0 = Clock::now();
  const std::string name = "nn_cut";
  const std::string rec = recipe(name, "resnet", kFaultTimeout, "");
  Cluster c;
  for (int n = 0; n < 3; ++n)
    c.start(launcher_cmd(net, n, 1, 29603, rec, "DTRAIN_FAILPOINTS=train.slow_step=0:100", "--set train.max_steps=1000"),
            log_of(name, n));
  const bool going = wait_for_step(name, 3, 60);
  INFO(c.outputs());
  REQUIRE(going);
  const auto cut = Clock::now();
  REQUIRE(net.cut(1));
  auto codes = c.wait_all(kFaultLimit + 20);
  const std::string store = net.addr(0) + ":29603";
  for (int n = 0; n < 3; ++n) {
    INFO("node " << n);
    CHECK(codes[size_t(n)] == 1);
    if (codes[size_t(n)] != BgProc::kRunning)
      CHECK(seconds(cut, c.nodes[size_t(n)]->ended()) <= kFaultLimit);
    const std::string out = c.nodes[size_t(n)]->output();
    CHECK(line_with(out, "launcher: worker rank " + std::to_string(n)).find("failed with exit status 1") !=
          std::string::npos);
    const std::string err = line_with(out, "error: gloo ");
    MESSAGE("node " << n << " (" << fmt::format("{:.1f}", seconds(cut, c.nodes[size_t(n)]->ended()))
                    << " s after the cut): " << err);
    if (n == 1) {  // cut off: neither its peers nor the store answer
      CHECK(err.find("arrivals unknown: the store is unreachable: store " + store) != std::string::npos);
    } else {
      CHECK(err.find("not arrived within 2000 ms: rank 1 (global 1)") != std::string::npos);
    }
  }
  MESSAGE(fmt::format("took {:.1f} s", seconds(t0, Clock::now())));
}

// The link comes back after every rank has failed: with --max-restarts the launchers start
// their groups again (restart 1 on both nodes), the new group rendezvous once node 1 is
// reachable, resumes from the last checkpoint, and ends with the weights of an uninterrupted
// run (1 process with grad_accum 2, the same steps).
TEST_CASE("netns: after a cut link comes back the launchers restart and finish with the uninterrupted weights") {
  NetnsNodes net(2);
  if (!net.ok()) SKIP_TEST(net.why_not());
  const std::string name = "nn_restore", ref = "nn_restore_ref";
  auto once = run_cmd(kCleanEnv + train(recipe(ref, "resnet", kFaultTimeout, ""),
                                        "--set train.grad_accum=2 --set train.max_steps=14 --set checkpoint.every_steps=2"));
  REQUIRE_MESSAGE(once.code == 0, once.all());
  const std::string rec = recipe(name, "resnet", kFaultTimeout, "");
  Cluster c;
  for (int n = 0; n < 2; ++n)
    c.start(launcher_cmd(net, n, 1, 29606, rec, "DTRAIN_FAILPOINTS=train.slow_step=0:300",
                         "--max-restarts 2 --set train.max_steps=14 --set checkpoint.every_steps=2"),
            log_of(name, n));
  const bool going = wait_for_step(name, 5, 60);
  INFO(c.outputs());
  REQUIRE(going);
  REQUIRE(net.cut(1));
  std::this_thread::sleep_for(std::chrono::seconds(kFaultTimeout + 4));  // every rank has failed by now
  REQUIRE(net.restore(1));
  const auto codes = c.wait_all(120);
  CHECK(codes == std::vector<int>{0, 0});
  for (int n = 0; n < 2; ++n)
    CHECK(c.nodes[size_t(n)]->output().find("restarting the group (1 of 2 restarts)") != std::string::npos);
  CHECK(last_step(name) == 14);
  int resumes = 0;
  for (auto& e : read_jsonl(run_dir(name) + "/events.jsonl")) resumes += e.value("event", "") == "resume";
  CHECK(resumes >= 1);
  // every step's loss (the resumed run's, for steps run twice) and the final weights are the
  // uninterrupted run's, within the layouts' tolerance
  std::map<int64_t, double> by_step;
  for (auto& r : metric_rows(run_dir(name), "train")) by_step[r["step"].get<int64_t>()] = r["loss"].get<double>();
  std::vector<double> got;
  for (auto& [step, loss] : by_step) got.push_back(loss);
  check_close("restored run vs 1 process", got, losses(ref), 14);
  check_weights(run_dir(name) + "/checkpoints/step_00000014", run_dir(ref) + "/checkpoints/step_00000014");
}

// Node 0 hosts the store (its launcher) and rank 0. It disappears twice: its processes killed
// first (the survivors' connections are closed at once), then silently, its link gone before its
// processes (nothing answers: the survivors time out, and so does the store).
TEST_CASE("netns: the store's node disappearing gives the other nodes a one-line error within the timeout") {
  const auto t0 = Clock::now();
  for (bool silent : {false, true}) {
    NetnsNodes net(3);
    if (!net.ok()) SKIP_TEST(net.why_not());
    const std::string name = silent ? "nn_gone_silent" : "nn_gone";
    const std::string rec = recipe(name, "resnet", kFaultTimeout, "");
    Cluster c;
    for (int n = 0; n < 3; ++n)
      c.start(launcher_cmd(net, n, 1, 29604, rec, "DTRAIN_FAILPOINTS=train.slow_step=0:100",
                           "--set train.max_steps=1000"),
              log_of(name, n));
    const bool going = wait_for_step(name, 3, 60);
    INFO(c.outputs());
    REQUIRE(going);
    const auto gone = Clock::now();
    REQUIRE(net.remove(0, silent));
    auto codes = c.wait_all(kFaultLimit + 20);
    CHECK(codes[0] == 128 + SIGKILL);
    const std::string store = net.addr(0) + ":29604";
    for (int n = 1; n < 3; ++n) {
      INFO((silent ? "silent" : "killed") << ", node " << n);
      CHECK(codes[size_t(n)] == 1);
      if (codes[size_t(n)] != BgProc::kRunning)
        CHECK(seconds(gone, c.nodes[size_t(n)]->ended()) <= (silent ? kFaultLimit : 5.0));
      const std::string out = c.nodes[size_t(n)]->output();
      const std::string err = line_with(out, "error: gloo ");
      MESSAGE((silent ? "silent" : "killed") << ", node " << n << " ("
                                             << fmt::format("{:.1f}", seconds(gone, c.nodes[size_t(n)]->ended()))
                                             << " s after): " << err);
      CHECK(err.find("arrivals unknown: the store is unreachable: store " + store) != std::string::npos);
      // one error line from the worker, one from its launcher
      size_t errors = 0;
      for (size_t p = out.find("error: "); p != std::string::npos; p = out.find("error: ", p + 1)) ++errors;
      CHECK(errors == 2);
    }
  }
  MESSAGE(fmt::format("took {:.1f} s", seconds(t0, Clock::now())));
}

// Node 1 starts 4 s after node 0, then node 0 (the store's host) 4 s after node 1: the early
// node waits (its store client retries the connection; Gloo's rendezvous waits for the
// addresses), and both train with the losses of 1 process with grad_accum 2.
TEST_CASE("netns: a node that joins late within the rendezvous timeout is waited for") {
  NetnsNodes net(2);
  if (!net.ok()) SKIP_TEST(net.why_not());
  const auto t0 = Clock::now();
  auto ref = run_cmd(kCleanEnv + train(recipe("nn_late_ref", "resnet", 30), "--set train.grad_accum=2"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  for (int late : {1, 0}) {
    const std::string name = "nn_late" + std::to_string(late);
    const std::string rec = recipe(name, "resnet", 20);
    const int early = 1 - late;
    Cluster c;
    const auto start = Clock::now();
    c.start(launcher_cmd(net, early, 1, 29605, rec), log_of(name, early));
    std::this_thread::sleep_for(std::chrono::seconds(4));
    c.start(launcher_cmd(net, late, 1, 29605, rec), log_of(name, late));
    auto codes = c.wait_all(60);
    INFO("node " << late << " late: " << c.outputs());
    CHECK(codes == std::vector<int>{0, 0});
    if (codes[0] == 0) CHECK(seconds(start, c.nodes[0]->ended()) >= 4.0);  // it did wait
    check_close("node " + std::to_string(late) + " late vs grad_accum 2", losses(name), losses("nn_late_ref"), 6);
  }
  MESSAGE(fmt::format("took {:.1f} s", seconds(t0, Clock::now())));
}

}  // TEST_SUITE

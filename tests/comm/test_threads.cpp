// CPU threads per process (comm::cpu_threads): run.threads, else OMP_NUM_THREADS, else the
// process's share of its CPUs among the ranks of its node; dtrain's launcher giving each
// worker its share; the count recorded in run_start and state.json, and the warnings when a
// resume or a rank runs with another count (the losses then differ in the last bits).
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "comm/env.h"
#include "comm/launcher.h"
#include "comm/store.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "run_cmd.h"
#include "run_readers.h"

using namespace dtrain;
using namespace dtrain::comm;
namespace stdfs = std::filesystem;

namespace {

const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_threads";

CpuThreads threads_of(int configured, std::map<std::string, std::string> env, int affinity) {
  return cpu_threads_from(
      configured, "run.threads",
      [&env](const char* k) -> const char* {
        auto it = env.find(k);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      affinity);
}

// Sets (or, with nullopt, unsets) an environment variable for the scope; restores it after.
struct ScopedEnv {
  std::string name;
  std::optional<std::string> old;
  ScopedEnv(const char* n, std::optional<std::string> v) : name(n) {
    if (const char* o = std::getenv(n)) old = o;
    if (v) setenv(n, v->c_str(), 1);
    else unsetenv(n);
  }
  ~ScopedEnv() {
    if (old) setenv(name.c_str(), old->c_str(), 1);
    else unsetenv(name.c_str());
  }
};

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }

// A tiny ResNet on synthetic images, run.threads left at 0; removes the run directory.
std::string recipe(const std::string& name) {
  stdfs::create_directories(kWork);
  stdfs::remove_all(run_dir(name));
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 3\ndevice = \"cpu\"\n"
    << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
    << "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
    << "[train]\nbatch_size = 8\nmax_steps = 6\n"
    << "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n"
    << "[checkpoint]\nevery_steps = 100\n[eval]\nevery_steps = 0\n[log]\nevery_steps = 1\ntensorboard = false\n"
    << "[parallel]\ntimeout_s = 30\n";
  return path;
}

// Every variable that could pick the thread count or the rank, cleared.
const std::string kCleanEnv =
    "env -u OMP_NUM_THREADS -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK "
    "-u TORCHELASTIC_RESTART_COUNT -u TORCHELASTIC_USE_AGENT_STORE -u DTRAIN_LAUNCHER -u DTRAIN_JOB_TOKEN "
    "-u SLURM_PROCID -u SLURM_NTASKS -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT ";

nlohmann::json event(const std::string& name, const std::string& kind) {
  for (auto& e : read_jsonl(run_dir(name) + "/events.jsonl"))
    if (e["event"] == kind) return e;
  return nullptr;
}

nlohmann::json latest_state(const std::string& name) {
  std::string latest = fs::read_file(run_dir(name) + "/checkpoints/latest");
  while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  return nlohmann::json::parse(fs::read_file(run_dir(name) + "/checkpoints/" + latest + "/state.json"));
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("threads: run.threads then OMP_NUM_THREADS then the CPUs of the affinity mask over the local ranks") {
  // run.threads wins over everything, even a malformed OMP_NUM_THREADS
  auto t = threads_of(3, {{"OMP_NUM_THREADS", "5"}}, 8);
  CHECK(t.threads == 3);
  CHECK(t.source == "run.threads");
  CHECK(threads_of(2, {{"OMP_NUM_THREADS", "x"}}, 8).threads == 2);
  // OMP_NUM_THREADS, whatever the affinity and the local ranks
  t = threads_of(0, {{"OMP_NUM_THREADS", "5"}, {"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "4"}}, 2);
  CHECK(t.threads == 5);
  CHECK(t.source == "OMP_NUM_THREADS");
  // outside a launched job: every CPU of the mask
  t = threads_of(0, {}, 8);
  CHECK(t.threads == 8);
  CHECK(t.source == "8 CPUs / 1 local rank");
  CHECK(threads_of(0, {{"OMP_NUM_THREADS", ""}}, 8).threads == 8);  // set but empty = unset
  // the share of the ranks on this node, as each launcher tells it
  t = threads_of(0, {{"RANK", "1"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}}, 8);
  CHECK(t.threads == 2);
  CHECK(t.source == "8 CPUs / 4 local ranks");
  CHECK(threads_of(0, {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "6"}, {"SLURM_STEP_TASKS_PER_NODE", "3(x2)"}}, 8)
            .threads == 2);  // 8 / 3, rounded down
  CHECK(threads_of(0, {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}, 1)
            .threads == 1);  // mpirun bound the rank to 1 core: never 0
  CHECK(threads_of(0, {{"RANK", "0"}, {"WORLD_SIZE", "16"}}, 4).threads == 1);  // more ranks than CPUs
  CHECK(threads_of(0, {}, 0).threads == 1);
  // a malformed OMP_NUM_THREADS is the user's error, naming the variable
  for (const char* bad : {"abc", "0", "-2", "1.5", "4,2", "2x"})
    CHECK_THROWS_WITH_AS(threads_of(0, {{"OMP_NUM_THREADS", bad}}, 8), doctest::Contains("OMP_NUM_THREADS"), UserError);
  // this process: its mask holds at least one CPU
  CHECK(affinity_cpus() >= 1);
  ScopedEnv omp("OMP_NUM_THREADS", "3");
  CHECK(cpu_threads(0, "run.threads").threads == 3);
}

TEST_CASE("launcher: each worker gets OMP_NUM_THREADS = its share of the CPUs unless it is set") {
  const std::string dir = kWork + "/launch";
  stdfs::remove_all(dir);
  stdfs::create_directories(dir);
  const int port = StoreServer("127.0.0.1", 0, "x").port();
  LaunchOptions o;
  o.nproc_per_node = 2;
  o.master_port = port;
  const std::vector<std::string> argv{"/bin/sh", "-c", "echo $OMP_NUM_THREADS > " + dir + "/omp.$RANK"};
  {
    ScopedEnv omp("OMP_NUM_THREADS", std::nullopt);
    REQUIRE(launch_workers(o, argv).exit_code == 0);
    const std::string share = fmt::format("{}\n", std::max(1, affinity_cpus() / 2));
    CHECK(fs::read_file(dir + "/omp.0") == share);
    CHECK(fs::read_file(dir + "/omp.1") == share);
    // set by the caller (bench --collectives, dtrain train with run.threads): kept
    o.extra_env["OMP_NUM_THREADS"] = "3";
    REQUIRE(launch_workers(o, argv).exit_code == 0);
    CHECK(fs::read_file(dir + "/omp.1") == "3\n");
  }
  // set by the user: kept
  ScopedEnv omp("OMP_NUM_THREADS", "7");
  o.extra_env.clear();
  REQUIRE(launch_workers(o, argv).exit_code == 0);
  CHECK(fs::read_file(dir + "/omp.0") == "7\n");
  CHECK(fs::read_file(dir + "/omp.1") == "7\n");
}

}  // TEST_SUITE

TEST_SUITE("integration") {

TEST_CASE("threads: a malformed OMP_NUM_THREADS is a user error naming it") {
  const std::string bin = shell_quote(dtrain_bin());
  auto r = run_cmd(kCleanEnv + "OMP_NUM_THREADS=two " + bin + " train " + recipe("omp_bad"));
  CHECK(r.code == 2);
  // libgomp warns about the variable itself as it loads; dtrain's own line is the last one
  CHECK_MESSAGE(r.err.find("error: environment variable OMP_NUM_THREADS='two': expected an integer") !=
                    std::string::npos, r.err);
  CHECK_FALSE(stdfs::exists(run_dir("omp_bad")));  // refused before the run directory was made
  // run.threads decides without reading it
  auto ok = run_cmd(kCleanEnv + "OMP_NUM_THREADS=two " + bin + " train " + recipe("omp_bad") +
                    " --set run.threads=1 --set train.max_steps=1");
  CHECK_MESSAGE(ok.code == 0, ok.all());
}

TEST_CASE("threads: run_start and state.json record the CPU threads and a resume with another count warns") {
  const std::string bin = shell_quote(dtrain_bin());
  const std::string rec = recipe("thr_resume");
  // preempted after step 3 with 1 thread
  auto a = run_cmd(kCleanEnv + "OMP_NUM_THREADS=1 DTRAIN_FAILPOINTS=train.stop_at_step=3 " + bin + " train " + rec);
  REQUIRE_MESSAGE(a.code == 0, a.all());
  const auto start = event("thr_resume", "run_start");
  CHECK(start["cpu_threads"] == 1);
  CHECK(start["cpu_threads_from"] == "OMP_NUM_THREADS");
  auto st = latest_state("thr_resume");
  CHECK(st["step"] == 3);
  CHECK(st["cpu_threads"] == 1);
  CHECK_FALSE(st.contains("cpu_threads_per_rank"));
  // resumed with 2: one warning line, an event, and the new count in the next checkpoint
  auto b = run_cmd(kCleanEnv + "OMP_NUM_THREADS=2 " + bin + " train --resume " + run_dir("thr_resume"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  const std::string warn =
      "resuming with 2 CPU threads per rank, but the checkpoint was written with 1 CPU thread per rank: losses will "
      "not be bit-identical to an uninterrupted run";
  CHECK_MESSAGE(b.all().find(warn) != std::string::npos, b.all());
  const auto changed = event("thr_resume", "cpu_threads_changed");
  REQUIRE(changed.is_object());
  CHECK(changed["checkpoint"] == nlohmann::json::array({1}));
  CHECK(changed["now"] == nlohmann::json::array({2}));
  st = latest_state("thr_resume");
  CHECK(st["step"] == 6);
  CHECK(st["cpu_threads"] == 2);
  // the same count: no warning
  const std::string rec2 = recipe("thr_same");
  auto c = run_cmd(kCleanEnv + "OMP_NUM_THREADS=2 DTRAIN_FAILPOINTS=train.stop_at_step=3 " + bin + " train " + rec2);
  REQUIRE_MESSAGE(c.code == 0, c.all());
  auto d = run_cmd(kCleanEnv + bin + " train --resume " + run_dir("thr_same") + " --set run.threads=2");
  REQUIRE_MESSAGE(d.code == 0, d.all());
  CHECK_MESSAGE(d.all().find("CPU thread") == std::string::npos, d.all());
  CHECK(event("thr_same", "cpu_threads_changed").is_null());
}

TEST_CASE("threads: ranks of one job with different CPU thread counts warn and record every count") {
  const std::string bin = shell_quote(dtrain_bin());
  const std::string rec = recipe("thr_ranks");
  const std::string o1 = kWork + "/thr_ranks.r1.out";
  const std::string base = "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29791 ";
  auto r = run_cmd(kCleanEnv + base + "RANK=1 OMP_NUM_THREADS=2 " + bin + " train " + rec + " > " + o1 +
                   " 2>&1 & W1=$!; " + kCleanEnv + base + "RANK=0 OMP_NUM_THREADS=1 " + bin + " train " + rec +
                   "; echo rc0=$?; wait $W1; echo rc1=$?; cat " + o1);
  INFO(r.all());
  CHECK(r.out.find("rc0=0") != std::string::npos);
  CHECK(r.out.find("rc1=0") != std::string::npos);
  CHECK(r.all().find("ranks run with different CPU thread counts (per rank 1, 2 CPU threads): losses will not be "
                     "bit-identical to a run whose ranks all use one count") != std::string::npos);
  const auto start = event("thr_ranks", "run_start");
  CHECK(start["cpu_threads"] == 1);
  CHECK(start["cpu_threads_per_rank"] == nlohmann::json::array({1, 2}));
  const auto st = latest_state("thr_ranks");
  CHECK(st["cpu_threads"] == 1);
  CHECK(st["cpu_threads_per_rank"] == nlohmann::json::array({1, 2}));
}

}  // TEST_SUITE

// Data-parallel equivalence beyond the basics of test_train_dist.cpp: GPT on token shards,
// 4 ranks, and workers started by torchrun, Slurm or Open MPI (its variables, and a real
// mpirun) instead of dtrain's launcher.
// N ranks with batch B give the per-step losses of one process with grad_accum = N whose
// micro-batch k is rank k's batch (within 1e-5 relative: other reduction orders). Workers
// of other launchers give the losses of dtrain's launcher bit for bit: a ResNet (batch norm,
// oneDNN convolutions: the case whose numerics depend on the thread count) with run.threads
// left to comm::cpu_threads, which gives every rank 1 thread under each launcher on the same
// 2 CPUs (the commands run under `taskset`).
#include <doctest/doctest.h>

#include <cmath>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <sched.h>
#include <sys/file.h>
#include <csignal>
#include <unistd.h>

#include "run_cmd.h"
#include "token_fixture.h"
#include "run_readers.h"

namespace stdfs = std::filesystem;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_train_dist2";
// Debian's python3 (torch 1.13) for torchrun
const std::string kPython = "/usr/bin/python3";

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string tokens() { return byte_tokens(kWork); }

// A recipe file for run `name`; kind "gpt" (configs/tiny_gpt.toml's model on tokens()) or
// "resnet" (12x12 synthetic images); "resnet-auto" leaves run.threads at 0 (the thread count
// comm::cpu_threads picks), the others set 1. Removes the run directory.
std::string recipe(const std::string& name, const std::string& kind, const std::string& extra = "") {
  stdfs::create_directories(kWork);
  stdfs::remove_all(run_dir(name));
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 3\ndevice = \"cpu\"\n"
    << (kind == "resnet-auto" ? "" : "threads = 1\n");
  if (kind == "gpt")
    f << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\nvocab_size = 256\n"
      << "[data]\nkind = \"tokens\"\npath = \"" << tokens() << "\"\neval_split = \"val\"\n"
      << "[train]\nbatch_size = 4\nmax_steps = 6\n"
      << "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.0\n"
      << "[schedule]\nkind = \"cosine\"\nwarmup_steps = 2\n";
  else
    f << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
      << "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
      << "[train]\nbatch_size = 8\nmax_steps = 6\n"
      << "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nweight_decay = 5e-4\n";
  f << "[checkpoint]\nevery_steps = 100\n"
    << "[eval]\nevery_steps = 0\nbatch_size = 4\nmax_batches = 1\n"
    << "[log]\nevery_steps = 1\ntensorboard = false\n"
    << "[parallel]\ntimeout_s = 30\n"
    << extra;
  return path;
}

std::vector<nlohmann::json> metrics(const std::string& name) { return read_jsonl(run_dir(name) + "/metrics.jsonl"); }

std::vector<double> losses(const std::string& name) { return train_losses(run_dir(name)); }

int world_size(const std::string& name) {
  for (auto& r : metrics(name))
    if (r["kind"] == "train") return r.value("world_size", 1);
  return 0;
}


// Bit-identical per-step losses (the same thread count gives the same numerics).
void check_same(const std::string& what, const std::vector<double>& a, const std::vector<double>& b, size_t steps) {
  INFO(what);
  REQUIRE(a.size() == steps);
  REQUIRE(b.size() == steps);
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1 << ": " << fmt::format("{:.17g} vs {:.17g}", a[i], b[i]));
    CHECK(std::isfinite(a[i]));
    CHECK(a[i] == b[i]);
  }
}

// run_start's record of rank 0's CPU threads: "<count> from <source>"
std::string threads_of(const std::string& name) {
  for (auto& e : read_jsonl(run_dir(name) + "/events.jsonl"))
    if (e["event"] == "run_start" && e.contains("cpu_threads"))
      return e["cpu_threads"].dump() + " from " + e.value("cpu_threads_from", std::string("?"));
  return "(not recorded)";
}

// `taskset -c A,B `: the first two CPUs this test may use, so that every launcher's workers
// share the same 2 CPUs (1 thread each) on any machine
std::string two_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  REQUIRE(!cpus.empty());
  return "taskset -c " + std::to_string(cpus[0]) + (cpus.size() > 1 ? "," + std::to_string(cpus[1]) : "") + " ";
}

std::string train(const std::string& rec, const std::string& args = "") { return kBin + " train " + rec + " " + args; }

// Clears every rank-discovery variable so that only the ones a test sets are seen.
const std::string kCleanEnv =
    "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK -u TORCHELASTIC_RESTART_COUNT "
    "-u TORCHELASTIC_USE_AGENT_STORE -u DTRAIN_LAUNCHER -u DTRAIN_JOB_TOKEN -u SLURM_PROCID -u SLURM_NTASKS "
    "-u SLURM_LOCALID -u SLURM_NTASKS_PER_NODE -u SLURM_TASKS_PER_NODE -u SLURM_NODEID -u OMPI_COMM_WORLD_RANK "
    "-u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_LOCAL_RANK -u OMPI_COMM_WORLD_LOCAL_SIZE -u OMPI_COMM_WORLD_NODE_RANK "
    "-u SLURM_STEP_TASKS_PER_NODE -u SLURM_STEP_NODELIST -u SLURM_JOB_NODELIST -u SLURM_NODELIST -u SLURM_JOB_ID "
    "-u SLURM_LAUNCH_NODE_IPADDR -u MASTER_ADDR -u MASTER_PORT -u OMP_NUM_THREADS ";

// Two workers started by the test itself on two_cpus(), each with its own variables (rank 1
// first: the store hosted by rank 0 may come up later, clients retry).
CmdResult two_workers(const std::string& name, const std::string& rec, const std::string& env1,
                      const std::string& env0) {
  const std::string o1 = kWork + "/" + name + ".r1.out", o0 = kWork + "/" + name + ".r0.out";
  const std::string cpus = two_cpus();
  return run_cmd(kCleanEnv + env1 + " " + cpus + train(rec) + " > " + o1 + " 2>&1 & W1=$!; " + kCleanEnv + env0 + " " +
                 cpus + train(rec) + " > " + o0 + " 2>&1; echo rc0=$?; wait $W1; echo rc1=$?; cat " + o0 + " " + o1);
}

// A private one-node Slurm cluster (Debian's slurmctld + slurmd, installed by
// `scripts/setup.sh --tests`) in a temporary directory: its own ports, no munge
// (auth/none), the machine's host name as the node. Stopped and removed at scope exit.
// `cpus` (e.g. "taskset -c 0,1 ") prefixes the daemons: the tasks run on their CPUs
// (TaskPlugin=task/none binds nothing).
struct SlurmCluster {
  std::string dir, conf, host;
  SlurmCluster(int first_job_id, const std::string& cpus) {
    char tmpl[] = "/tmp/dtrain_slurm_XXXXXX";
    REQUIRE(mkdtemp(tmpl));
    dir = tmpl;
    for (const char* d : {"/state", "/spool", "/log"}) stdfs::create_directories(dir + d);
    char h[256] = {};
    REQUIRE(gethostname(h, sizeof h - 1) == 0);
    host = std::string(h).substr(0, std::string(h).find('.'));
    const std::string user = getuid() == 0 ? "root" : std::string(getenv("USER") ? getenv("USER") : "root");
    conf = dir + "/slurm.conf";
    std::ofstream f(conf);
    f << "ClusterName=dtraintest\nSlurmctldHost=" << host << "(127.0.0.1)\nSlurmctldPort=29771\nSlurmdPort=29772\n"
      << "AuthType=auth/none\nCredType=cred/none\nSlurmUser=" << user << "\nSlurmdUser=" << user << "\n"
      << "StateSaveLocation=" << dir << "/state\nSlurmdSpoolDir=" << dir << "/spool\n"
      << "SlurmctldPidFile=" << dir << "/ctld.pid\nSlurmdPidFile=" << dir << "/slurmd.pid\n"
      << "SlurmctldLogFile=" << dir << "/log/ctld.log\nSlurmdLogFile=" << dir << "/log/slurmd.log\n"
      << "ProctrackType=proctrack/pgid\nTaskPlugin=task/none\nSelectType=select/cons_tres\n"
      << "SelectTypeParameters=CR_Core\nSchedulerType=sched/builtin\nMpiDefault=none\nReturnToService=2\n"
      << "SlurmdParameters=config_overrides\nJobCompType=jobcomp/none\n"
      << "AccountingStorageType=accounting_storage/none\nFirstJobId=" << first_job_id << "\n"
      << "NodeName=" << host << " NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN\n"
      << "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n";
    f.close();
    auto up = run_cmd(env() + cpus + "slurmctld -c -f " + conf + " && " + env() + cpus + "slurmd -f " + conf + " -N " + host);
    REQUIRE_MESSAGE(up.code == 0, up.all());
    for (int i = 0; i < 300 && run_cmd(env() + "sinfo -h -o %T").out.find("idle") == std::string::npos; ++i)
      usleep(100000);
    auto info = run_cmd(env() + "sinfo -h -o %T");
    REQUIRE_MESSAGE(info.out.find("idle") != std::string::npos, info.all() << log());
  }
  std::string env() const { return "SLURM_CONF=" + conf + " "; }
  std::string log() const { return run_cmd("tail -n 20 " + dir + "/log/ctld.log " + dir + "/log/slurmd.log").out; }
  ~SlurmCluster() {
    for (const char* pidfile : {"/slurmd.pid", "/ctld.pid"}) {
      std::ifstream p(dir + pidfile);
      pid_t pid = 0;
      if (p >> pid && pid > 0) {
        kill(pid, SIGTERM);
        for (int i = 0; i < 50 && kill(pid, 0) == 0; ++i) usleep(100000);
      }
    }
    std::error_code ec;
    stdfs::remove_all(dir, ec);
  }
};

}  // namespace

TEST_SUITE("integration") {

// The token loader draws windows in a global order (rank r's micro-batch m of a step is
// global micro-batch m * world + r, see task_lm.cpp), so GPT is exact as the image tasks.
TEST_CASE("dist: GPT on 2 ranks gives the losses of 1 process with grad_accum 2") {
  auto ref = run_cmd(train(recipe("gpt_ref", "gpt"), "--set train.grad_accum=2"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  auto two = run_cmd(train(recipe("gpt_2r", "gpt"), "--nproc-per-node 2 --master-port 29711"));
  REQUIRE_MESSAGE(two.code == 0, two.all());
  CHECK(world_size("gpt_2r") == 2);
  auto lr = losses("gpt_ref");
  check_close("gpt 2 ranks vs grad_accum 2", losses("gpt_2r"), lr, 6);
  CHECK(lr.back() < lr.front());
  // not trivially equal: 1 process without accumulation sees other windows
  auto one = run_cmd(train(recipe("gpt_1", "gpt")));
  REQUIRE_MESSAGE(one.code == 0, one.all());
  auto l1 = losses("gpt_1");
  REQUIRE(l1.size() == 6);
  CHECK(std::abs(l1[0] - lr[0]) > 1e-5 * std::abs(lr[0]));
}

TEST_CASE("dist: 4 ranks with ZeRO-0 and ZeRO-2 give the losses of 1 process with grad_accum 4") {
  auto ref = run_cmd(train(recipe("r4_ref", "resnet"), "--set train.grad_accum=4 --set train.max_steps=4"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  auto z0 = run_cmd(train(recipe("r4_z0", "resnet"), "--nproc-per-node 4 --master-port 29713 --set train.max_steps=4"));
  REQUIRE_MESSAGE(z0.code == 0, z0.all());
  auto z2 = run_cmd(
      train(recipe("r4_z2", "resnet", "zero = 2\n"), "--nproc-per-node 4 --master-port 29715 --set train.max_steps=4"));
  REQUIRE_MESSAGE(z2.code == 0, z2.all());
  CHECK(world_size("r4_z0") == 4);
  CHECK(world_size("r4_z2") == 4);
  auto lr = losses("r4_ref");
  check_close("4 ranks zero 0", losses("r4_z0"), lr, 4);
  check_close("4 ranks zero 2", losses("r4_z2"), lr, 4);
}

// torchrun's elastic agent owns MASTER_PORT with its c10d TCPStore
// (TORCHELASTIC_USE_AGENT_STORE=True); every dtrain rank rendezvouses on that store as a
// c10d client. MASTER_PORT + 1 (where dtrain once hosted a store of its own) is held busy
// by the test to show nothing needs it. Debian's torchrun (torch 1.13, the legacy c10d
// dialect) always; torchrun of every interpreter in DTRAIN_TEST_TORCH_PYTHONS too (e.g.
// torch 2.x, the VALIDATE dialect).
TEST_CASE("dist: workers started by torchrun rendezvous on the agent's store and train with the losses of dtrain's launcher") {
  const std::string cpus = two_cpus();
  auto ref = run_cmd(kCleanEnv + cpus + train(recipe("tr_ref", "resnet-auto"), "--nproc-per-node 2 --master-port 29721"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  // the launcher gives each worker its share of the 2 CPUs, as torchrun does
  CHECK_MESSAGE(ref.all().find("launcher: setting OMP_NUM_THREADS=1 for each of 2 workers") != std::string::npos,
                ref.all());
  CHECK(threads_of("tr_ref") == "1 from OMP_NUM_THREADS");
  std::vector<std::string> pys{kPython};
  if (const char* e = std::getenv("DTRAIN_TEST_TORCH_PYTHONS")) {
    std::stringstream ss(e);
    for (std::string p; std::getline(ss, p, ':');)
      if (!p.empty()) pys.push_back(p);
  }
  const int port = 29724;
  int busy = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(busy >= 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  sa.sin_port = htons(uint16_t(port + 1));
  if (bind(busy, (sockaddr*)&sa, sizeof sa) != 0 || listen(busy, 4) != 0)
    MESSAGE("port " << port + 1 << " is taken by another process: busy anyway");
  for (size_t i = 0; i < pys.size(); ++i) {
    const std::string name = "tr_run" + std::to_string(i);
    const std::string rec = recipe(name, "resnet-auto");
    INFO("torchrun of " << pys[i]);
    // --monitor_interval: the agent polls its workers every 5 s by default
    auto tr = run_cmd(kCleanEnv + cpus + pys[i] + " -m torch.distributed.run --no_python --nproc_per_node 2 --redirects 1 " +
                      "--tee 1 --monitor_interval 0.2 --master_addr 127.0.0.1 --master_port " + std::to_string(port) +
                      " " + kBin + " train " + rec);
    // an extra interpreter without torch is noted; Debian's (python3-torch, scripts/setup.sh) must run
    if (i > 0 && (tr.code == 127 || tr.all().find("No module named") != std::string::npos)) {
      MESSAGE("not tested: torchrun cannot start here (" << pys[i] << " -m torch.distributed.run, exit " << tr.code
                                                      << "): " << tr.all());
      continue;
    }
    REQUIRE_MESSAGE(tr.code == 0, tr.all());
    // rank 0 says which store it used and which c10d dialect the probe found
    const std::string line = "rendezvous: torchrun's agent store at 127.0.0.1:" + std::to_string(port) + " (";
    CHECK_MESSAGE(tr.all().find(line) != std::string::npos, tr.all());
    if (i == 0) CHECK_MESSAGE(tr.all().find(line + "legacy protocol)") != std::string::npos, tr.all());
    CHECK(world_size(name) == 2);
    std::ifstream ev(run_dir(name) + "/events.jsonl");
    std::string all((std::istreambuf_iterator<char>(ev)), std::istreambuf_iterator<char>());
    CHECK(all.find("\"completed\"") != std::string::npos);
    CHECK(threads_of(name) == "1 from OMP_NUM_THREADS");  // torchrun sets OMP_NUM_THREADS=1
    check_same("torchrun vs dtrain launcher", losses(name), losses("tr_ref"), 6);
  }
  close(busy);
}

// model.init_from under data parallelism: every rank reads the same file, so the replicas
// start equal and 2 ranks give the losses of 1 process with grad_accum 2 from the same weights.
TEST_CASE("dist: model.init_from on 2 ranks gives the losses of 1 process with grad_accum 2") {
  auto pre = run_cmd(train(recipe("init_src", "gpt"), "--set train.max_steps=3"));
  REQUIRE_MESSAGE(pre.code == 0, pre.all());
  const std::string from = " --set model.init_from=" + run_dir("init_src");
  auto ref = run_cmd(train(recipe("init_ref", "gpt"), "--set train.grad_accum=2" + from));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  auto two = run_cmd(train(recipe("init_2r", "gpt"), "--nproc-per-node 2 --master-port 29795" + from));
  REQUIRE_MESSAGE(two.code == 0, two.all());
  CHECK(world_size("init_2r") == 2);
  check_close("init_from: 2 ranks vs grad_accum 2", losses("init_2r"), losses("init_ref"), 6);
  // and the start differs from the seeded initialisation's
  auto seeded = run_cmd(train(recipe("init_none", "gpt"), "--set train.grad_accum=2"));
  REQUIRE_MESSAGE(seeded.code == 0, seeded.all());
  CHECK(losses("init_none").front() != losses("init_ref").front());
}

// checkpoint.keep_best for GPT ranks by the lowest validation loss
TEST_CASE("checkpoint.keep_best keeps the GPT checkpoint of the lowest val loss") {
  auto t = run_cmd(train(recipe("gpt_best", "gpt"), "--set checkpoint.keep_best=true --set eval.every_steps=2 "
                                                    "--set train.max_steps=10 --set optim.lr=3e-2"));
  REQUIRE_MESSAGE(t.code == 0, t.all());
  std::vector<std::pair<int64_t, double>> ev;
  for (auto& r : metrics("gpt_best"))
    if (r["kind"] == "eval") ev.emplace_back(r["step"].get<int64_t>(), r["eval_loss"].get<double>());
  REQUIRE(ev.size() == 5);  // steps 2, 4, 6, 8 and the final 10
  auto want = ev[0];
  for (auto& e : ev)
    if (e.second < want.second) want = e;
  std::ifstream f(run_dir("gpt_best") + "/checkpoints/best.json");
  const auto b = nlohmann::json::parse(f);
  CHECK(b["metric"] == "eval_loss");
  CHECK(b["mode"] == "min");
  CHECK(b["step"].get<int64_t>() == want.first);
  CHECK(b["value"].get<double>() == want.second);
}

// torchrun's elastic rendezvous (--rdzv_backend c10d, the multi-node form): the agent sets no
// agent store; it gives the workers a free port on rank 0's host, where rank 0 hosts dtrain's store.
TEST_CASE("dist: workers started by torchrun with the c10d rendezvous backend train with the losses of dtrain's launcher") {
  const std::string cpus = two_cpus();
  auto ref = run_cmd(kCleanEnv + cpus + train(recipe("trc_ref", "resnet-auto"), "--nproc-per-node 2 --master-port 29727"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  auto tr = run_cmd(kCleanEnv + cpus + kPython + " -m torch.distributed.run --no_python --nnodes 1 --nproc_per_node 2 " +
                    "--rdzv_backend c10d --rdzv_endpoint 127.0.0.1:29728 --rdzv_id trc --redirects 1 --tee 1 " +
                    "--monitor_interval 0.2 " + kBin + " train " + recipe("trc", "resnet-auto"));
  REQUIRE_MESSAGE(tr.code == 0, tr.all());
  CHECK_MESSAGE(tr.all().find("(hosted by rank 0), 2 ranks started by torchrun") != std::string::npos, tr.all());
  CHECK(world_size("trc") == 2);
  CHECK(threads_of("trc") == "1 from OMP_NUM_THREADS");
  check_same("torchrun c10d rendezvous vs dtrain launcher", losses("trc"), losses("trc_ref"), 6);
}

TEST_CASE("dist: the environments of torchrun and Slurm and Open MPI train together with the losses of dtrain's launcher") {
  auto ref = run_cmd(kCleanEnv + two_cpus() + train(recipe("env_ref", "resnet-auto"), "--nproc-per-node 2 --master-port 29731"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  const std::string master = "MASTER_ADDR=127.0.0.1 MASTER_PORT=";
  // no OMP_NUM_THREADS: each worker takes its share of the 2 CPUs, 1 (the local world size
  // from SLURM_TASKS_PER_NODE, and from OMPI_COMM_WORLD_SIZE without _LOCAL_SIZE)
  auto slurm = two_workers("env_slurm", recipe("env_slurm", "resnet-auto"),
                           "SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_LOCALID=1 SLURM_TASKS_PER_NODE='2(x1)' " + master + "29733",
                           "SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_LOCALID=0 SLURM_TASKS_PER_NODE='2(x1)' " + master + "29733");
  INFO(slurm.all());
  CHECK(slurm.out.find("rc0=0") != std::string::npos);
  CHECK(slurm.out.find("rc1=0") != std::string::npos);
  CHECK(world_size("env_slurm") == 2);
  auto mpi = two_workers("env_mpi", recipe("env_mpi", "resnet-auto"),
                         "OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=1 " + master + "29735",
                         "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=0 " + master + "29735");
  INFO(mpi.all());
  CHECK(mpi.out.find("rc0=0") != std::string::npos);
  CHECK(mpi.out.find("rc1=0") != std::string::npos);
  CHECK(world_size("env_mpi") == 2);
  // torchrun's variables without its OMP_NUM_THREADS=1 (a user's own script, or torchrun with
  // the variable unset by hand): the share of the 2 CPUs among LOCAL_WORLD_SIZE ranks, 1
  auto trv = two_workers("env_torchrun", recipe("env_torchrun", "resnet-auto"),
                         "RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 " + master + "29737",
                         "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 " + master + "29737");
  INFO(trv.all());
  CHECK(trv.out.find("rc0=0") != std::string::npos);
  CHECK(trv.out.find("rc1=0") != std::string::npos);
  auto lr = losses("env_ref");
  CHECK(threads_of("env_torchrun").find("1 from ") == 0);
  CHECK(threads_of("env_torchrun").find(" / 2 local ranks") != std::string::npos);
  check_same("torchrun's variables vs dtrain launcher", losses("env_torchrun"), lr, 6);
  CHECK(threads_of("env_slurm").find("1 from ") == 0);
  CHECK(threads_of("env_slurm").find(" / 2 local ranks") != std::string::npos);
  CHECK(threads_of("env_mpi").find(" / 2 local ranks") != std::string::npos);
  check_same("slurm vs dtrain launcher", losses("env_slurm"), lr, 6);
  // launcher flags under Slurm: one launcher per node, or a clear refusal
  auto many = run_cmd(kCleanEnv + "SLURM_PROCID=3 SLURM_NTASKS=4 SLURM_NODEID=1 " +
                      train(recipe("env_many", "resnet"), "--nproc-per-node 2 --nnodes 2"));
  CHECK(many.code == 2);
  CHECK_MESSAGE(many.err.find("--nnodes 2: this launcher is task 3 of 4 (slurm); start one dtrain launcher per node") !=
                    std::string::npos,
                many.err);
  check_same("open mpi vs dtrain launcher", losses("env_mpi"), lr, 6);
}

// The real Open MPI launcher (Debian's openmpi-bin, installed by scripts/setup.sh): mpirun
// starts the two workers, they read OMPI_COMM_WORLD_* and rendezvous on MASTER_PORT. mpirun
// binds each to one core (affinity 1 CPU: 1 thread), dtrain's launcher gives each
// OMP_NUM_THREADS=1: the same numerics (before the thread count was decided per process,
// the launcher's workers took both CPUs and the losses parted from step 5).
TEST_CASE("dist: workers started by a real mpirun train with the losses of dtrain's launcher") {
  REQUIRE_MESSAGE(run_cmd("command -v mpirun").code == 0, "mpirun not found (scripts/setup.sh installs openmpi-bin)");
  const std::string cpus = two_cpus();
  auto ref = run_cmd(kCleanEnv + cpus + train(recipe("mpirun_ref", "resnet-auto"), "--nproc-per-node 2 --master-port 29743"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  // root is allowed for CI containers; --oversubscribe: the CI machine may have fewer cores;
  // plm isolated: one node, no ssh/rsh needed
  auto mpi = run_cmd(kCleanEnv + cpus + "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --mca plm isolated "
                     "--oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29745 " +
                     train(recipe("mpirun", "resnet-auto")));
  INFO(mpi.all());
  REQUIRE(mpi.code == 0);
  CHECK(world_size("mpirun") == 2);
  CHECK(threads_of("mpirun").find("1 from ") == 0);
  check_same("mpirun vs dtrain launcher", losses("mpirun"), losses("mpirun_ref"), 6);
}

// A real Slurm: `srun -n 2` on a private one-node cluster starts both workers. They
// read SLURM_PROCID/SLURM_NTASKS/SLURM_STEP_TASKS_PER_NODE, find the master as the first
// host of SLURM_STEP_NODELIST and the port from SLURM_JOB_ID (no MASTER_ADDR/MASTER_PORT
// given), and train with the losses of dtrain's own launcher.
TEST_CASE("dist: workers started by a real Slurm srun train with the losses of dtrain's launcher") {
  for (const char* tool : {"slurmctld", "slurmd", "srun", "sinfo"})
    REQUIRE_MESSAGE(run_cmd(std::string("command -v ") + tool + " || test -x /usr/sbin/" + tool).code == 0,
                    tool << " not found (`scripts/setup.sh --tests` installs slurmctld, slurmd and slurm-client)");
  const std::string cpus = two_cpus();
  auto ref = run_cmd(kCleanEnv + cpus + train(recipe("srun_ref", "resnet-auto"), "--nproc-per-node 2 --master-port 29775"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  SlurmCluster cluster(4777, cpus);  // the job's port: 15000 + 4777
  auto sr = run_cmd(kCleanEnv + "PATH=$PATH:/usr/sbin " + cluster.env() + "srun -n 2 -N 1 --kill-on-bad-exit=1 " +
                    train(recipe("srun", "resnet-auto")));
  INFO(sr.all() << cluster.log());
  REQUIRE(sr.code == 0);
  CHECK(world_size("srun") == 2);
  // rank 0 on the step's first node (this host) hosts the store on the job's port
  CHECK(sr.all().find("rendezvous: dtrain's store at " + cluster.host + ":19777 (hosted by rank 0), 2 ranks started by slurm") !=
        std::string::npos);
  CHECK(threads_of("srun").find("1 from ") == 0);
  check_same("srun vs dtrain launcher", losses("srun"), losses("srun_ref"), 6);
  // torchrun's pattern: srun starts one dtrain launcher, which starts the 2 workers, on the
  // job's port (the second job: 15000 + 4778) rather than 29500
  auto sl = run_cmd(kCleanEnv + "PATH=$PATH:/usr/sbin " + cluster.env() + "srun -n 1 -N 1 " +
                    train(recipe("srun_launch", "resnet-auto"), "--nproc-per-node 2"));
  INFO(sl.all() << cluster.log());
  REQUIRE(sl.code == 0);
  CHECK(sl.all().find("rendezvous: dtrain's store at 127.0.0.1:19778 (hosted by the launcher), 2 ranks started by dtrain") !=
        std::string::npos);
  check_same("srun + dtrain launcher vs dtrain launcher", losses("srun_launch"), losses("srun_ref"), 6);
}

}  // TEST_SUITE

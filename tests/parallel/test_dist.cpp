// Distributed layers: store, env discovery, Gloo collectives, data parallel, launcher.
// Ranks run as threads (each with its own StoreClient and GlooCommunicator) on loopback;
// the dead-peer test forks. Stores bind port 0 to avoid collisions.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "parallel/grad_buckets.h"
#include "parallel/param_sync.h"
#include "parallel/zero.h"
#include "comm/env.h"
#include "comm/gloo_comm.h"
#include "comm/launcher.h"
#include "comm/store.h"
#include "gloo_ranks.h"
#include "nn/params.h"

using namespace dtrain;
using namespace dtrain::comm;
using namespace dtrain::parallel;
using namespace std::chrono_literals;

namespace {

const char* kToken = "test-token";

void run_ranks(int world, const std::function<void(int, GlooCommunicator&)>& fn, double timeout_s = 5) {
  run_gloo_ranks(world, fn, timeout_s);
}

// A port that was free a moment ago.
int free_port() {
  StoreServer s("127.0.0.1", 0, "x");
  return s.port();
}

DistEnv env_of(std::map<std::string, std::string> m) {
  return dist_env_from([&m](const char* k) -> const char* {
    auto it = m.find(k);
    return it == m.end() ? nullptr : it->second.c_str();
  });
}

float val(int rank, size_t i) { return float(rank + 1) * 0.5f + float(i % 97) * 0.25f; }

std::string tmpdir(const char* tag) {
  std::string d = fmt::format("{}/dtrain_test_dist_{}_{}", DTRAIN_BUILD_DIR, tag, getpid());
  fs::remove_tree(d);
  fs::mkdirs(d);
  return d;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("store: set/get/add/check/wait/delete and timeouts") {
  StoreServer server("127.0.0.1", 0, kToken);
  StoreClient a("127.0.0.1", server.port(), kToken, 2s);
  StoreClient b("127.0.0.1", server.port(), kToken, 2s);
  a.set("k", std::string("hello"));
  CHECK(b.get_string("k") == "hello");
  std::vector<uint8_t> bin{0, 1, 2, 255, 0};
  a.set("bin", bin);
  CHECK(b.get("bin") == bin);
  CHECK(a.add("ctr", 5) == 5);
  CHECK(b.add("ctr", -2) == 3);
  CHECK(a.get_string("ctr") == "3");
  CHECK(a.check({"k", "ctr"}));
  CHECK_FALSE(a.check({"k", "nope"}));
  CHECK(a.remove("k"));
  CHECK_FALSE(a.remove("k"));
  CHECK_FALSE(a.check({"k"}));
  // get blocks until another client sets the key
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    b.set("late", std::string("v"));
  });
  auto t0 = std::chrono::steady_clock::now();
  CHECK(a.get_string("late") == "v");
  CHECK(std::chrono::steady_clock::now() - t0 >= 90ms);
  setter.join();
  a.wait({"late", "ctr"});
  // timeouts name the key and the address
  try {
    a.get("missing", 150ms);
    FAIL("get of a missing key returned");
  } catch (const RuntimeFault& e) {
    std::string m = e.what();
    CHECK(m.find("'missing'") != std::string::npos);
    CHECK(m.find("127.0.0.1:" + std::to_string(server.port())) != std::string::npos);
  }
  CHECK_THROWS_AS(a.wait({"late", "absent"}, 100ms), RuntimeFault);
}

TEST_CASE("store: client connects before the server starts - no server -> timeout") {
  int port = free_port();
  std::unique_ptr<StoreServer> server;
  std::thread late([&] {
    std::this_thread::sleep_for(200ms);
    server = std::make_unique<StoreServer>("127.0.0.1", port, kToken);
  });
  StoreClient c("127.0.0.1", port, kToken, 3s);
  c.set("x", std::string("1"));
  late.join();
  CHECK(c.get_string("x") == "1");
  int dead = free_port();
  std::string addr = "127.0.0.1:" + std::to_string(dead);
  CHECK_THROWS_WITH_AS(StoreClient("127.0.0.1", dead, kToken, 200ms), doctest::Contains(addr.c_str()),
                       RuntimeFault);
}

TEST_CASE("store: garbage and oversized frames close that connection only - wrong token refused") {
  StoreServer server("127.0.0.1", 0, kToken);
  StoreClient good("127.0.0.1", server.port(), kToken, 2s);
  good.set("a", std::string("1"));
  auto raw = [&](const std::vector<uint8_t>& bytes) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(uint16_t(server.port()));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
    (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    // the server must close it: read returns 0 (EOF) or an error, within a second
    timeval tv{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[256];
    ssize_t n;
    while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) {
    }
    close(fd);
    return n;
  };
  CHECK(raw({0xff, 0xff, 0xff, 0xff, 1, 2, 3}) <= 0);  // 4 GiB frame
  CHECK(raw({0x05, 0, 0, 0, 0x42, 1, 2, 3, 4}) <= 0);   // unknown opcode
  std::vector<uint8_t> junk(4096);
  uint32_t x = 12345;
  for (auto& b : junk) b = uint8_t((x = x * 1664525u + 1013904223u) >> 24);
  junk[0] = 0x10, junk[1] = 0, junk[2] = 0, junk[3] = 0;  // small frame of random bytes
  CHECK(raw(junk) <= 0);
  CHECK(server.rejected_connections() >= 3);
  CHECK(good.get_string("a") == "1");  // still serving
  StoreClient other("127.0.0.1", server.port(), kToken, 2s);
  CHECK(other.add("n", 1) == 1);
  CHECK_THROWS_WITH_AS(StoreClient("127.0.0.1", server.port(), "wrong", 2s),
                       doctest::Contains("job token rejected"), RuntimeFault);
}

TEST_CASE("gloo interface: DTRAIN_GLOO_IFACE or else the first of PyTorch's GLOO_SOCKET_IFNAME") {
  unsetenv("DTRAIN_GLOO_IFACE");
  unsetenv("GLOO_SOCKET_IFNAME");
  CHECK(gloo_iface_from_env().empty());
  setenv("GLOO_SOCKET_IFNAME", "lo,eth9", 1);
  CHECK(gloo_iface_from_env() == "lo");
  setenv("GLOO_SOCKET_IFNAME", "nosuch0", 1);
  CHECK_THROWS_WITH_AS(gloo_iface_from_env(),
                       doctest::Contains("GLOO_SOCKET_IFNAME=nosuch0: no network interface 'nosuch0' on this machine (it has: "),
                       UserError);
  setenv("DTRAIN_GLOO_IFACE", "lo", 1);  // dtrain's own variable wins
  CHECK(gloo_iface_from_env() == "lo");
  unsetenv("DTRAIN_GLOO_IFACE");
  unsetenv("GLOO_SOCKET_IFNAME");
}

TEST_CASE("env: torchrun / slurm / mpi variables and inconsistencies") {
  auto t = env_of({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                   {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"},
                   {"TORCHELASTIC_RESTART_COUNT", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                   {"TORCHELASTIC_RUN_ID", "none"}});
  CHECK(t.source == "torchrun");
  CHECK(t.rank == 3);
  CHECK(t.world_size == 8);
  CHECK(t.local_rank == 1);
  CHECK(t.local_world_size == 2);
  CHECK(t.group_rank == 1);
  CHECK(t.restart_count == 2);
  CHECK(t.master_addr == "10.0.0.1");
  CHECK(t.master_port == 1234);
  CHECK(t.agent_store);  // every rank is a client of the agent's c10d store on MASTER_PORT
  CHECK(t.tcpstore_protocol == "auto");
  CHECK(t.distributed);
  CHECK_FALSE(t.host_store);
  auto t0 = env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                    {"DTRAIN_TCPSTORE_PROTOCOL", "legacy"}});
  CHECK_FALSE(t0.host_store);  // not even rank 0: the agent hosts the store
  CHECK(t0.agent_store);
  CHECK(t0.master_port == 29500);
  CHECK(t0.tcpstore_protocol == "legacy");
  CHECK_THROWS_WITH_AS(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"DTRAIN_TCPSTORE_PROTOCOL", "v3"}}),
                       doctest::Contains("DTRAIN_TCPSTORE_PROTOCOL='v3'"), UserError);
  auto m0 = env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "x"}});
  CHECK(m0.source == "torchrun");
  CHECK_FALSE(m0.agent_store);
  CHECK(m0.host_store);  // torchrun without the agent store: rank 0 hosts dtrain's store
  auto d = env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"DTRAIN_LAUNCHER", "1"}, {"MASTER_PORT", "4000"},
                   {"DTRAIN_JOB_TOKEN", "tok"}});
  CHECK(d.source == "dtrain");
  CHECK_FALSE(d.host_store);  // the launcher hosts it
  CHECK(d.master_port == 4000);
  CHECK_FALSE(d.agent_store);
  CHECK(d.job_token == "tok");
  auto s = env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                   {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_NODEID", "1"},
                   {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"}});
  CHECK(s.source == "slurm");
  CHECK(s.rank == 5);
  CHECK(s.world_size == 8);
  CHECK(s.local_rank == 1);
  CHECK(s.local_world_size == 4);
  CHECK(s.group_rank == 1);
  CHECK(s.master_addr == "10.1.2.3");
  CHECK(s.master_port == 29500);
  // what a real srun sets: the step's layout per node, its node list, the job id
  auto sr = env_of({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "11"}, {"SLURM_LOCALID", "1"},
                    {"SLURM_NODEID", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"},
                    {"SLURM_TASKS_PER_NODE", "8"}, {"SLURM_STEP_NODELIST", "gpu[07-09]"},
                    {"SLURM_JOB_NODELIST", "gpu[01-09]"}, {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"},
                    {"SLURM_JOB_ID", "123456"}});
  CHECK(sr.local_world_size == 3);  // the third node holds 3 of the 11 tasks
  CHECK(sr.group_rank == 2);
  CHECK(sr.master_addr == "gpu07");  // task 0 runs on the step's first node
  CHECK(sr.master_port == 18456);    // 15000 + the job id's last four digits
  CHECK(sr.host_store == false);
  auto s0 = env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_NODEID", "0"},
                    {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}, {"SLURM_JOB_NODELIST", "n[1-2]"},
                    {"SLURM_JOB_ID", "77"}, {"MASTER_ADDR", "head"}, {"MASTER_PORT", "4100"}});
  CHECK(s0.local_world_size == 4);
  CHECK(s0.master_addr == "head");  // MASTER_ADDR / MASTER_PORT win
  CHECK(s0.master_port == 4100);
  CHECK(s0.host_store);
  CHECK(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODELIST", "vm"}}).master_addr == "vm");
  CHECK_THROWS_WITH_AS(env_of({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "11"}, {"SLURM_NODEID", "3"},
                               {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"}}),
                       doctest::Contains("SLURM_STEP_TASKS_PER_NODE='4(x2),3' lists 3 nodes, but SLURM_NODEID=3"),
                       UserError);
  for (const char* bad : {"4(2)", "4(x2", "x", "4,,3", "4,", "0", "2(x1)3"})
    CHECK_THROWS_WITH_AS(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", bad}}),
                         doctest::Contains("SLURM_TASKS_PER_NODE"), UserError);
  CHECK(slurm_first_host("gpu[01-04,07],login2") == "gpu01");
  CHECK(slurm_first_host("gpu[003,001]") == "gpu003");
  CHECK(slurm_first_host("rack[1-2]-n[03-04]") == "rack1-n03");
  CHECK(slurm_first_host("a,b[1-2]") == "a");
  CHECK_THROWS_WITH_AS(slurm_first_host("gpu[01-04"), doctest::Contains("'gpu[01-04'"), UserError);
  CHECK_THROWS_AS(slurm_first_host(""), UserError);
  auto m = env_of({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                   {"MASTER_ADDR", "node0"}});
  CHECK(m.source == "mpi");
  CHECK(m.rank == 2);
  CHECK(m.world_size == 4);
  CHECK(m.group_rank == 1);
  CHECK(m.master_addr == "node0");
  CHECK(m.host_store == false);
  auto none = env_of({});
  CHECK(none.source == "none");
  CHECK_FALSE(none.distributed);
  CHECK_THROWS_WITH_AS(env_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}), doctest::Contains("RANK=4"), UserError);
  CHECK_THROWS_WITH_AS(env_of({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "2"}}),
                       doctest::Contains("SLURM_PROCID"), UserError);
  CHECK_THROWS_WITH_AS(env_of({{"RANK", "x"}, {"WORLD_SIZE", "4"}}), doctest::Contains("RANK='x'"), UserError);
  CHECK_THROWS_WITH_AS(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
                       doctest::Contains("MASTER_PORT"), UserError);
}

TEST_CASE("gloo: allreduce/allgather/broadcast/reduce_scatter/barrier / 2 and 4 ranks / awkward sizes") {
  for (int W : {2, 4}) {
    CAPTURE(W);
    run_ranks(W, [W](int r, GlooCommunicator& c) {
      CHECK(c.rank() == r);
      CHECK(c.size() == W);
      for (size_t n : {size_t(1), size_t(7), size_t(1237), size_t(100003)}) {
        std::vector<float> a(n);
        for (size_t i = 0; i < n; ++i) a[i] = val(r, i);
        Tensor t(a.data(), DType::F32, Device::cpu(), Shape{int64_t(n)});
        c.allreduce(t, ReduceOp::Sum);
        std::vector<float> b(n);
        for (size_t i = 0; i < n; ++i) b[i] = val(r, i);
        Tensor tb(b.data(), DType::F32, Device::cpu(), Shape{int64_t(n)});
        auto w = c.allreduce_async(tb, ReduceOp::Avg);
        // reduce-scatter: rank r gets the sum of every rank's chunk r
        std::vector<float> in(n * size_t(W)), out(n, -1.f);
        for (size_t i = 0; i < in.size(); ++i) in[i] = val(r, i) + float(i / n);
        Tensor tin(in.data(), DType::F32, Device::cpu(), Shape{int64_t(in.size())});
        Tensor tout(out.data(), DType::F32, Device::cpu(), Shape{int64_t(n)});
        c.reduce_scatter(tin, tout, ReduceOp::Sum);
        w->wait();
        bool ok_ar = true, ok_avg = true, ok_rs = true;
        for (size_t i = 0; i < n; ++i) {
          float sum = 0, rs = 0;
          for (int k = 0; k < W; ++k) {
            sum += val(k, i);
            rs += val(k, size_t(r) * n + i) + float(r);
          }
          ok_ar = ok_ar && std::fabs(a[i] - sum) <= 1e-4f * std::fabs(sum);
          ok_avg = ok_avg && std::fabs(b[i] - sum / float(W)) <= 1e-4f * std::fabs(sum);
          ok_rs = ok_rs && std::fabs(out[i] - rs) <= 1e-4f * std::fabs(rs);
        }
        CHECK(ok_ar);
        CHECK(ok_avg);
        CHECK(ok_rs);
        // allgather: out[k*n + i] = rank k's shard; the shard aliases its slot of `out`
        std::vector<float> g(n * size_t(W), 0.f);
        for (size_t i = 0; i < n; ++i) g[size_t(r) * n + i] = float(r * 1000) + float(i % 13);
        Tensor shard(g.data() + size_t(r) * n, DType::F32, Device::cpu(), Shape{int64_t(n)});
        Tensor tg(g.data(), DType::F32, Device::cpu(), Shape{int64_t(g.size())});
        c.allgather(shard, tg);
        bool ok_ag = true;
        for (int k = 0; k < W; ++k)
          for (size_t i = 0; i < n; ++i) ok_ag = ok_ag && g[size_t(k) * n + i] == float(k * 1000) + float(i % 13);
        CHECK(ok_ag);
        // broadcast from the last rank
        std::vector<float> bc(n, float(r));
        Tensor tbc(bc.data(), DType::F32, Device::cpu(), Shape{int64_t(n)});
        c.broadcast(tbc, W - 1);
        CHECK(bc[0] == float(W - 1));
        CHECK(bc[n - 1] == float(W - 1));
        c.barrier();
      }
    });
  }
}

TEST_CASE("gloo: a peer that dies before a collective -> RuntimeFault naming it / no hang") {
  StoreServer server("127.0.0.1", 0, kToken);
  const int W = 3;
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    try {
      StoreClient sc("127.0.0.1", server.port(), kToken, 5s);
      GlooOptions o;
      o.timeout_s = 3;
      GlooCommunicator comm(sc, W - 1, W, o);
    } catch (...) {
      _exit(2);
    }
    _exit(0);  // dies without joining the collective
  }
  std::vector<std::string> msgs(2);
  std::vector<double> secs(2);
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      StoreClient sc("127.0.0.1", server.port(), kToken, 5s);
      GlooOptions o;
      o.timeout_s = 3;
      GlooCommunicator comm(sc, r, W, o);
      std::vector<float> a(1000, 1.f);
      Tensor t(a.data(), DType::F32, Device::cpu(), Shape{1000});
      auto t0 = std::chrono::steady_clock::now();
      try {
        std::this_thread::sleep_for(100ms);  // let the child exit first
        comm.allreduce(t, ReduceOp::Sum);
      } catch (const RuntimeFault& e) {
        msgs[size_t(r)] = e.what();
      }
      secs[size_t(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // the communicator is broken from now on
      try {
        comm.barrier();
        msgs[size_t(r)] += " | barrier passed";
      } catch (const RuntimeFault&) {
      }
    });
  for (auto& t : th) t.join();
  int st = 0;
  waitpid(child, &st, 0);
  CHECK(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(msgs[size_t(r)]);
    CHECK(msgs[size_t(r)].find("allreduce #0") != std::string::npos);
    CHECK(msgs[size_t(r)].find("peers 0-2") != std::string::npos);
    CHECK(msgs[size_t(r)].find("barrier passed") == std::string::npos);
    CHECK(secs[size_t(r)] < 4.5);
  }
}

TEST_CASE("data parallel: bucket plan in reverse declaration order") {
  std::vector<ParamDesc> ps;
  int64_t off = 0;
  for (int64_t n : {100, 300000, 50, 70000, 10}) {
    ParamDesc d;
    d.name = "p" + std::to_string(ps.size());
    d.shape = Shape{n};
    d.offset = off;
    off += n;
    ps.push_back(d);
  }
  // first bucket ~0.25 MiB (65536 floats), then 0.5 MiB (131072 floats)
  auto b = plan_buckets(ps, 0.25, 0.5);
  REQUIRE(b.size() == 3);
  CHECK(b[0].params == std::vector<int>{4, 3});  // 70010 >= 65536
  CHECK(b[1].params == std::vector<int>{2, 1});  // 300050
  CHECK(b[2].params == std::vector<int>{0});
  CHECK(b[0].end == off);
  CHECK(b[2].begin == 0);
  for (size_t i = 0; i + 1 < b.size(); ++i) CHECK(b[i].begin == b[i + 1].end);
  CHECK_THROWS_AS(plan_buckets(ps, 1, 0), UserError);
  CHECK(shard_range(10, 0, 4).begin == 0);
  CHECK(shard_range(10, 0, 4).end == 3);
  CHECK(shard_range(10, 3, 4).begin == 9);
  CHECK(shard_range(10, 3, 4).end == 10);
  CHECK(shard_range(2, 3, 4).begin == 2);
  CHECK(shard_range(2, 3, 4).end == 2);
}

TEST_CASE("data parallel: bucketed all-reduce averages grads - sync_params - ZeRO shards") {
  const int W = 3;
  run_ranks(W, [](int r, GlooCommunicator& c) {
    auto be = make_backend("cpu", 0, 1);
    ParamStore ps;
    int64_t sizes[] = {5, 40000, 3, 9000, 17};
    for (int i = 0; i < 5; ++i) {
      ParamDesc d;
      d.name = "p" + std::to_string(i);
      d.shape = Shape{sizes[i]};
      d.init = Init::Uniform;
      d.init_arg = 1.f;
      ps.declare(d);
    }
    ps.declare_buffer("running", Shape{7}, 0.f);
    ps.finalize(*be);
    ps.initialize(uint64_t(100 + r));  // different params per rank
    // sync: everyone ends with rank 0's params
    sync_params(c, ps);
    ParamStore ref;
    for (int i = 0; i < 5; ++i) {
      ParamDesc d;
      d.name = "p" + std::to_string(i);
      d.shape = Shape{sizes[i]};
      d.init = Init::Uniform;
      d.init_arg = 1.f;
      ref.declare(d);
    }
    ref.declare_buffer("running", Shape{7}, 0.f);
    ref.finalize(*be);
    ref.initialize(100);
    CHECK(params_digest(ps) == params_digest(ref));
    // grads: rank-dependent; bucketed all-reduce -> average
    const int64_t N = ps.num_params();
    float* g = ps.flat_grads().f32();
    for (int64_t i = 0; i < N; ++i) g[i] = float(r) * 2.f + float(i % 11);
    GradBuckets gb(c, ps, /*bucket_mb=*/0.05, /*first_bucket_mb=*/0.01);
    CHECK(gb.buckets().size() >= 2);
    gb.begin_step(true);
    for (int id = 4; id >= 1; --id) gb.on_grad_ready(id);  // param 0 never reports
    CHECK(gb.launched() >= 1);
    double waited = gb.finish();
    CHECK(waited >= 0);
    bool ok = true;
    for (int64_t i = 0; i < N; ++i) ok = ok && std::fabs(g[i] - (2.f + float(i % 11))) < 1e-5f;  // mean of 0,2,4
    CHECK(ok);
    // accumulation micro-batch: no communication
    gb.begin_step(false);
    for (int id = 4; id >= 0; --id) gb.on_grad_ready(id);
    CHECK(gb.launched() == 0);
    // ZeRO: reduce-scatter grads into my shard, then all-gather params
    for (int64_t i = 0; i < N; ++i) g[i] = float(r + 1) + float(i % 5);
    ZeroSharder z(c, ps, 2);
    FlatRange fr = z.range();
    CHECK(fr.begin == shard_range(N, r, 3).begin);
    z.reduce_grads();
    bool ok_rs = true;
    for (int64_t i = fr.begin; i < fr.end; ++i) ok_rs = ok_rs && std::fabs(g[i] - (2.f + float(i % 5))) < 1e-5f;
    CHECK(ok_rs);
    float* p = ps.flat_params().f32();
    for (int64_t i = fr.begin; i < fr.end; ++i) p[i] = float(r) + 0.5f;  // "optimizer update"
    z.allgather_params();
    bool ok_ag = true;
    for (int k = 0; k < 3; ++k) {
      FlatRange kr = shard_range(N, k, 3);
      for (int64_t i = kr.begin; i < kr.end; ++i) ok_ag = ok_ag && p[i] == float(k) + 0.5f;
    }
    CHECK(ok_ag);
    // a rank with different params is named by the checksum verification
    verify_params(c, ps);  // all equal after the all-gather
    if (r == 2) p[0] += 1.f;
    CHECK_THROWS_WITH_AS(verify_params(c, ps), doctest::Contains("rank(s) 2 hold"), RuntimeFault);
  });
}

TEST_CASE("launcher: env of the workers / restart on failure / give up / SIGTERM forwarding") {
  std::string dir = tmpdir("launch");
  LaunchOptions o;
  o.nproc_per_node = 2;
  o.nnodes = 2;
  o.node_rank = 1;  // node 1: no store hosted here, global ranks 2 and 3
  o.master_port = free_port();
  o.grace_s = 1;
  std::string script = "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR "
                       "$MASTER_PORT $TORCHELASTIC_RESTART_COUNT $DTRAIN_LAUNCHER\" > " + dir + "/env.$RANK";
  auto res = launch_workers(o, {"/bin/sh", "-c", script});
  CHECK(res.exit_code == 0);
  CHECK(fs::read_file(dir + "/env.2") ==
        fmt::format("2 0 4 2 1 127.0.0.1 {} 0 1\n", o.master_port));
  CHECK(fs::read_file(dir + "/env.3") ==
        fmt::format("3 1 4 2 1 127.0.0.1 {} 0 1\n", o.master_port));

  // rank 1 fails on the first attempt; rank 0 would sleep forever and gets terminated
  LaunchOptions r = o;
  r.nnodes = 1;
  r.node_rank = 0;
  r.master_port = free_port();
  r.max_restarts = 1;
  std::string flaky = "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then if [ $RANK = 1 ]; then exit 3; "
                      "else exec sleep 30; fi; fi; echo ok > " + dir + "/ok.$RANK";
  auto t0 = std::chrono::steady_clock::now();
  res = launch_workers(r, {"/bin/sh", "-c", flaky});
  CHECK(res.exit_code == 0);
  CHECK(res.restarts == 1);
  CHECK(fs::exists(dir + "/ok.0"));
  CHECK(fs::exists(dir + "/ok.1"));
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);

  r.max_restarts = 0;
  r.master_port = free_port();
  res = launch_workers(r, {"/bin/sh", "-c", "if [ $RANK = 1 ]; then exit 3; fi; exec sleep 30"});
  CHECK(res.exit_code == 1);
  CHECK(res.failed_rank == 1);
  CHECK(res.message.find("rank 1") != std::string::npos);
  CHECK(res.message.find("exit status 3") != std::string::npos);

  // exit 2 (a user error the worker named) is not retried and is the launcher's exit code
  r.max_restarts = 3;
  r.master_port = free_port();
  res = launch_workers(r, {"/bin/sh", "-c", "if [ $RANK = 1 ]; then echo x >> " + dir + "/tries; exit 2; fi; exec sleep 30"});
  CHECK(res.exit_code == 2);
  CHECK(res.restarts == 0);
  CHECK(res.failed_rank == 1);
  CHECK(fs::read_file(dir + "/tries") == "x\n");
  r.max_restarts = 0;

  // SIGTERM to the launcher reaches every worker, which exits cleanly
  r.master_port = free_port();
  std::string trap = "trap 'echo term > " + dir + "/term.$RANK; exit 0' TERM; touch " + dir +
                     "/up.$RANK; while true; do sleep 0.05; done";
  std::thread killer([&] {
    for (int i = 0; i < 200 && !(fs::exists(dir + "/up.0") && fs::exists(dir + "/up.1")); ++i)
      std::this_thread::sleep_for(20ms);
    std::this_thread::sleep_for(50ms);
    kill(getpid(), SIGTERM);
  });
  res = launch_workers(r, {"/bin/sh", "-c", trap});
  killer.join();
  CHECK(res.forwarded_signal == SIGTERM);
  CHECK(res.exit_code == 0);
  CHECK(fs::exists(dir + "/term.0"));
  CHECK(fs::exists(dir + "/term.1"));

  CHECK_THROWS_AS(launch_workers(LaunchOptions{0}, {"/bin/true"}), UserError);
  auto argv = current_argv();
  REQUIRE_FALSE(argv.empty());
  CHECK(fs::base_name(self_exe()) == fs::base_name(argv[0]));
  fs::remove_tree(dir);
}

}  // TEST_SUITE

// Hostile peers against a real 2-rank training run: while dtrain trains (the launcher
// hosts the rendezvous store, rank 0 serves /metrics), a fuzzer sends both ports random
// bytes, huge length prefixes and request lines, a byte per second, and holds 1,000
// connections to each. The run must not notice (exit 0, the losses of an undisturbed run,
// bit for bit), the launcher's memory must stay bounded, both servers must shed the
// attackers within their deadlines, and a real client and a real scrape must get in.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "comm/store.h"
#include "net_fuzz.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "free_port.h"

using namespace netfuzz;
using namespace std::chrono_literals;
namespace stdfs = std::filesystem;

namespace {

const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_net_fuzz";
const std::string kToken = "net-fuzz-job";
constexpr int kHold = 1000;           // idle connections held against each server
constexpr int64_t kMemBoundMiB = 32;  // growth allowed to the launcher (store host) and rank 0
constexpr int64_t kCheckMs = 14000;   // when every attacker must be gone

std::string recipe(const std::string& name) {
  stdfs::create_directories(kWork);
  std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 11\ndevice = \"cpu\"\nthreads = 1\n"
    << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
    << "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
    << "[train]\nbatch_size = 8\nmax_steps = 50\n"
    << "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n"
    << "[checkpoint]\nevery_steps = 0\n[eval]\nevery_steps = 0\n[log]\nevery_steps = 1\n"
    << "[parallel]\ntimeout_s = 60\n";
  return path;
}

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }

// Starts `dtrain train` (the launcher) with extra environment; its pid.
pid_t start_train(const std::vector<std::string>& args, const std::vector<std::string>& env, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    for (auto& e : env) putenv(const_cast<char*>(e.c_str()));
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv;
    std::string bin = dtrain_bin();
    argv.push_back(bin.data());
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(bin.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

int http_status(const std::string& r) {
  return r.rfind("HTTP/1.1 ", 0) == 0 && r.size() >= 12 ? std::stoi(r.substr(9, 3)) : -1;
}

// Peak of VmHWM and VmRSS of pid, sampled until stop.
struct MemWatch {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> peak_kib{0};
  std::thread th;
  explicit MemWatch(pid_t pid) {
    th = std::thread([this, pid] {
      while (!stop) {
        int64_t v = std::max(status_kib(pid, "VmHWM"), status_kib(pid, "VmRSS"));
        if (v > peak_kib) peak_kib = v;
        std::this_thread::sleep_for(50ms);
      }
    });
  }
  ~MemWatch() {
    stop = true;
    th.join();
  }
};

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("fuzz: store and /metrics attacked during a 2-rank run - same losses and bounded memory and attackers shed") {
  const rlim_t nofile = raise_nofile(8192);
  if (nofile < 4 * kHold) {
    MESSAGE("SKIPPED: needs RLIMIT_NOFILE >= " << 4 * kHold << " (hard limit here " << nofile << ")");
    return;
  }
  stdfs::remove_all(run_dir("fuzz_ref"));
  stdfs::remove_all(run_dir("fuzz_hit"));
  // the undisturbed run
  auto ref = run_cmd(shell_quote(dtrain_bin()) + " train " + recipe("fuzz_ref") + " --nproc-per-node 2 --master-port " +
                     std::to_string(free_port()));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  const auto ref_losses = train_losses(run_dir("fuzz_ref"));
  REQUIRE(ref_losses.size() == 50);

  // the attacked run: rank 0 slowed (400 ms a step) so that it outlasts every deadline below
  const int store_port = free_port(), http_port = free_port();
  const std::string log = kWork + "/fuzz_hit.log";
  pid_t launcher = start_train({"train", recipe("fuzz_hit"), "--nproc-per-node", "2", "--master-port",
                                std::to_string(store_port), "--metrics-port", std::to_string(http_port)},
                               {"DTRAIN_JOB_TOKEN=" + kToken, "DTRAIN_FAILPOINTS=train.slow_step=0:400"}, log);
  auto alive = [&] { return waitpid(launcher, nullptr, WNOHANG) == 0; };
  const std::string metrics = run_dir("fuzz_hit") + "/metrics.jsonl";
  for (int i = 0; i < 600 && alive() && train_losses(run_dir("fuzz_hit")).empty(); ++i)
    std::this_thread::sleep_for(50ms);
  REQUIRE_MESSAGE(alive(), slurp(log));
  pid_t rank0 = -1;
  for (pid_t c : children_of(launcher))
    if (environ_of(c, "RANK") == "0") rank0 = c;
  REQUIRE(rank0 > 0);
  const int64_t launcher0 = std::max(status_kib(launcher, "VmHWM"), status_kib(launcher, "VmRSS"));
  const int64_t rank0_0 = status_kib(rank0, "VmRSS");
  MemWatch mem_launcher(launcher), mem_rank0(rank0);
  const auto t0 = Clock::now();

  // 1. hold 1,000 idle connections to each server
  std::vector<int> held_store, held_http;
  for (int i = 0; i < kHold; ++i) {
    held_store.push_back(connect_nb(store_port));
    held_http.push_back(connect_nb(http_port));
  }
  // 2. a byte per second: a valid hello to the store, a valid request to /metrics
  std::atomic<int64_t> slow_store_ms{-1}, slow_http_ms{-1};
  std::atomic<bool> stop_slow{false};
  auto slow = [&](int port, std::string bytes, std::atomic<int64_t>& cut_ms) {
    int fd = connect_blocking(port);
    bool cut = fd < 0;
    for (size_t i = 0; !cut && !stop_slow && i < bytes.size(); ++i) {
      cut = send(fd, &bytes[i], 1, MSG_NOSIGNAL) != 1;
      for (int k = 0; k < 20 && !cut && !stop_slow; ++k) {
        cut = closed_by_peer(fd);
        std::this_thread::sleep_for(50ms);
      }
    }
    if (cut) cut_ms = ms_since(t0);  // else -1: never cut
    if (fd >= 0) close(fd);
  };
  std::string hello = "\x01" + le32(uint32_t(kToken.size())) + kToken;
  std::thread slow_store(slow, store_port, le32(uint32_t(hello.size())) + hello + std::string(64, 'z'),
                         std::ref(slow_store_ms));
  std::thread slow_http(slow, http_port, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(64, 'z'),
                        std::ref(slow_http_ms));
  // 3. huge length prefixes and request lines, each followed by 512 KiB
  Rng rng(5);
  const std::string junk = rng.bytes(512 << 10);
  size_t huge_sent = 0;
  std::vector<int> huge;
  for (int i = 0; i < 300; ++i) {
    uint32_t len = i % 3 == 0 ? 0xFFFFFFFFu : i % 3 == 1 ? (64u << 20) : (64u << 20) - 1;
    int fd = connect_nb(store_port);
    pollfd p{fd, POLLOUT, 0};
    poll(&p, 1, 1000);
    huge_sent += send_some(fd, le32(len) + "\x01" + junk, 200);
    huge.push_back(fd);
  }
  for (int i = 0; i < 20; ++i) {
    std::string r = exchange(http_port, "GET /" + std::string(size_t(100) << 10, 'a') + " HTTP/1.1\r\n\r\n", 2000);
    CHECK((r.empty() || http_status(r) == 400 || http_status(r) == 431));
  }
  // 4. random bytes, and random frames under the size limit (plausible opcodes and fields)
  std::vector<std::string> http_replies;
  for (int i = 0; i < 200; ++i) {
    std::string b = rng.bytes(1 + rng.next() % 16384);
    exchange(store_port, b, 1000);
    std::string body = std::string(1, char(1 + rng.next() % 7)) + rng.bytes(rng.next() % 4000);
    exchange(store_port, le32(uint32_t(body.size())) + body, 1000);
    http_replies.push_back(exchange(http_port, rng.bytes(1 + rng.next() % 16384), 1000));
    http_replies.push_back(exchange(http_port, "GET /" + rng.bytes(rng.next() % 64) + " HTTP/1.1\r\n\r\n", 1000));
  }
  for (auto& r : http_replies) {
    int s = http_status(r);
    INFO(r.substr(0, 200));
    CHECK((r.empty() || s == 400 || s == 404 || s == 408 || s == 431 || s == 503));
  }
  // 5. during the flood: a client of the job joins the store, a scraper reads /metrics
  auto tj = Clock::now();
  {
    dtrain::comm::StoreClient probe("127.0.0.1", store_port, kToken, 20s);
    probe.set("fuzz/probe", std::string("alive"));
    CHECK(probe.get_string("fuzz/probe") == "alive");
  }
  const int64_t join_ms = ms_since(tj);
  std::string scrape;
  for (int i = 0; i < 5 && http_status(scrape) != 200; ++i) {
    if (i) std::this_thread::sleep_for(300ms);
    scrape = exchange(http_port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 3000);
  }
  CHECK(http_status(scrape) == 200);
  CHECK(scrape.find("dtrain_samples_total{") != std::string::npos);
  const int64_t flood_done_ms = ms_since(t0);

  // 6. after the deadlines (hello 10 s, HTTP request 5 s, from the accept; the flood has
  // queued for accepting during the first second or two): every attacker is gone
  while (ms_since(t0) < kCheckMs && alive()) std::this_thread::sleep_for(100ms);
  REQUIRE_MESSAGE(alive(), "the run ended before the deadlines were checked: " << slurp(log));
  int open_store = 0, open_http = 0, open_huge = 0;
  for (int fd : held_store) open_store += fd >= 0 && !closed_by_peer(fd);
  for (int fd : held_http) open_http += fd >= 0 && !closed_by_peer(fd);
  for (int fd : huge) open_huge += fd >= 0 && !closed_by_peer(fd);
  const int64_t launcher_peak = mem_launcher.peak_kib, rank0_peak = mem_rank0.peak_kib;
  std::string after = exchange(http_port, "GET /metrics HTTP/1.1\r\n\r\n", 3000);
  stop_slow = true;
  slow_store.join();
  slow_http.join();
  for (auto* v : {&held_store, &held_http, &huge})
    for (int fd : *v)
      if (fd >= 0) close(fd);

  int st = 0;
  waitpid(launcher, &st, 0);
  const std::string out = slurp(log);
  MESSAGE("store host (launcher): " << launcher0 / 1024 << " MiB before, peak " << launcher_peak / 1024
                                    << " MiB under attack; rank 0: " << rank0_0 / 1024 << " MiB before, peak "
                                    << rank0_peak / 1024 << " MiB");
  MESSAGE("huge frames: " << huge_sent / 1024 << " KiB sent; flood done after " << flood_done_ms
                          << " ms; a job client joined in " << join_ms << " ms; slow senders cut after "
                          << slow_store_ms.load() << " ms (store) and " << slow_http_ms.load() << " ms (/metrics)");
  MESSAGE("still open after " << kCheckMs << " ms: " << open_store << " store, " << open_http << " /metrics, " << open_huge
                                      << " huge-frame connections");
  CHECK_MESSAGE((WIFEXITED(st) && WEXITSTATUS(st) == 0), out);
  CHECK(train_losses(run_dir("fuzz_hit")) == ref_losses);  // bit for bit
  CHECK(launcher_peak - launcher0 < kMemBoundMiB * 1024);
  CHECK(rank0_peak - rank0_0 < kMemBoundMiB * 1024);
  CHECK(open_store == 0);
  CHECK(open_http == 0);
  CHECK(open_huge == 0);
  CHECK(slow_store_ms.load() > 0);
  CHECK((slow_http_ms.load() > 0 && slow_http_ms.load() < 8000));
  CHECK(http_status(after) == 200);
  // rejections are logged, and throttled: a handful of lines for thousands of attackers
  size_t lines = 0;
  for (size_t p = 0; (p = out.find("store: ", p)) != std::string::npos; ++p) ++lines;
  CHECK(out.find("store: closed a connection: no hello in time") != std::string::npos);
  CHECK(lines < 30);
}

}  // TEST_SUITE

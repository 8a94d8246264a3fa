// The servers that face the network (dtrain's rendezvous store, the /metrics endpoint)
// against hostile peers: oversized frames before the job token, connection floods, a
// process out of file descriptors, a handler that throws. The limits' own knobs
// (StoreLimits, the throttled log) are in tests/comm/test_store_limits.cpp; the same attacks
// during a real training run in tests/comm/test_net_fuzz.cpp.
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm/store.h"
#include "core/error.h"
#include "core/log.h"
#include "net_fuzz.h"
#include "obs/http_server.h"
#include "obs/metrics.h"

using namespace dtrain;
using namespace std::chrono_literals;
using namespace netfuzz;

namespace {

const char* kToken = "limits-token";

std::string http_get(int port, const std::string& path = "/metrics") {
  return exchange(port, "GET " + path + " HTTP/1.1\r\nHost: localhost\r\n\r\n", 3000);
}

int status_of(const std::string& resp) {
  if (resp.rfind("HTTP/1.1 ", 0) != 0 || resp.size() < 12) return -1;
  return std::stoi(resp.substr(9, 3));
}

int64_t open_fds() {
  int64_t n = 0;
  for (auto& e : std::filesystem::directory_iterator("/proc/self/fd")) n += !e.path().empty();
  return n;
}

double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + 1e-6 * double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// Runs `flood(port)` in a forked child (its own descriptors) while this process's soft
// RLIMIT_NOFILE leaves the server only `spare` descriptors; returns the CPU seconds this
// process spent in the `hold_ms` the child held its connections, and the child's exit code.
// The child must only use async-signal-safe calls.
template <typename Flood>
std::pair<double, int> with_few_fds(int spare, int hold_ms, Flood flood) {
  rlimit saved{};
  getrlimit(RLIMIT_NOFILE, &saved);
  int rd[2];
  REQUIRE(pipe(rd) == 0);
  rlimit low = saved;
  low.rlim_cur = rlim_t(open_fds() + spare);
  REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
  pid_t pid = fork();
  if (pid == 0) {
    setrlimit(RLIMIT_NOFILE, &saved);  // the child floods with its own descriptors
    close(rd[0]);
    int code = flood();
    char b = 1;
    (void)!write(rd[1], &b, 1);  // connections made and answered (or not)
    struct timespec ts{hold_ms / 1000 + 1, 0};
    nanosleep(&ts, nullptr);
    _exit(code);
  }
  close(rd[1]);
  char b;
  (void)!read(rd[0], &b, 1);
  close(rd[0]);
  double c0 = cpu_seconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(hold_ms));
  double spent = cpu_seconds() - c0;
  int st = 0;
  waitpid(pid, &st, 0);
  setrlimit(RLIMIT_NOFILE, &saved);
  return {spent, WIFEXITED(st) ? WEXITSTATUS(st) : 128};
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("store limits: before the hello a frame holds at most 4 KiB - a peer announcing more is closed at once") {
  raise_nofile(4096);
  comm::StoreServer server("127.0.0.1", 0, kToken);
  comm::StoreClient good("127.0.0.1", server.port(), kToken, 5s);
  good.set("a", std::string("1"));
  // HELLO opcode after the length: only the length is wrong
  for (uint32_t len : {4097u, 1u << 20, (64u << 20) - 1}) {
    INFO("announced length " << len);
    int fd = connect_blocking(server.port());
    REQUIRE(fd >= 0);
    (void)!send(fd, (le32(len) + "\x01" + std::string(100, 'x')).data(), 105, MSG_NOSIGNAL);
    auto t0 = Clock::now();
    CHECK(wait_closed(fd, 2000));
    CHECK(ms_since(t0) < 1000);
    close(fd);
  }
  // 200 peers each announce a 64 MiB frame and send 1 MiB of it: the server holds none of it
  const int64_t rss0 = status_kib(getpid(), "VmRSS");
  std::string mib = le32((64u << 20) - 1) + Rng(1).bytes(1 << 20);
  std::vector<int> fds;
  size_t sent = 0;
  for (int i = 0; i < 200; ++i) {
    int fd = connect_nb(server.port());
    REQUIRE(fd >= 0);
    pollfd p{fd, POLLOUT, 0};
    poll(&p, 1, 1000);
    sent += send_some(fd, mib, 300);
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(300ms);  // let the server read what it will
  const int64_t grown_kib = status_kib(getpid(), "VmRSS") - rss0;
  MESSAGE("200 peers announcing 64 MiB frames sent " << sent / 1024 << " KiB; the process grew by " << grown_kib
                                                     << " KiB");
  CHECK(grown_kib < 16 * 1024);
  int closed = 0;
  for (int fd : fds) {
    closed += wait_closed(fd, 1000);
    close(fd);
  }
  CHECK(closed == 200);
  CHECK(good.get_string("a") == "1");  // the client of the job is served throughout
  CHECK(good.add("n", 1) == 1);
}

TEST_CASE("store limits: out of file descriptors - each peer is refused with a reason and the loop does not spin") {
  comm::StoreServer server("127.0.0.1", 0, kToken);
  comm::StoreClient good("127.0.0.1", server.port(), kToken, 5s);
  good.set("a", std::string("1"));
  const int port = server.port();
  // exit code: how many of 40 peers read the store's refusal naming the descriptors
  auto [cpu, refused] = with_few_fds(3, 1500, [port] {
    static int fds[40];
    int n = 0;
    for (int& fd : fds) fd = connect_blocking(port);
    for (int fd : fds) {
      if (fd < 0) continue;
      timeval tv{0, 200000};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      static char hello[5 + 12] = {16, 0, 0, 0, 1, 12, 0, 0, 0, 'l', 'i', 'm', 'i', 't', 's', '-', 't'};
      (void)!send(fd, hello, sizeof hello, MSG_NOSIGNAL);  // a truncated hello: no reply unless refused
      static char buf[512];
      ssize_t k = recv(fd, buf, sizeof buf - 1, 0);
      if (k > 0) {
        buf[k] = 0;
        for (ssize_t i = 0; i + 16 <= k; ++i)
          if (memcmp(buf + i, "file descriptors", 16) == 0) {
            ++n;
            break;
          }
      }
    }
    return n;
  });
  MESSAGE("out of descriptors: " << refused << " of 40 peers read the refusal; the process used " << cpu
                                 << " s of CPU in 1.5 s");
  CHECK(refused >= 30);
  CHECK(cpu < 0.4);  // a loop spinning on EMFILE burns a core
  CHECK(good.get_string("a") == "1");
  comm::StoreClient later("127.0.0.1", port, kToken, 5s);  // descriptors back: new clients get in
  CHECK(later.add("n", 2) == 2);
}

TEST_CASE("http limits: a handler that throws gets a fixed 500 - the text goes to the log once and never to the peer") {
  std::string logf = std::string(DTRAIN_BUILD_DIR) + "/http_limits_" + std::to_string(getpid()) + ".log";
  std::filesystem::remove(logf);
  log::set_file(logf);
  int calls = 0;
  {
    HttpServer srv("127.0.0.1", 0, [&calls](const std::string& path) -> HttpResponse {
      if (++calls > 5 && path == "/other") throw 42;  // not even a std::exception
      throw RuntimeFault("cannot read /secret/run/dir/metrics.snapshot: token=s3cr3t");
    });
    for (int i = 0; i < 5; ++i) {
      std::string r = http_get(srv.port());
      CHECK(status_of(r) == 500);
      CHECK(r.find("s3cr3t") == std::string::npos);
      CHECK(r.find("/secret") == std::string::npos);
      CHECK(r.substr(r.find("\r\n\r\n") + 4) == "internal server error\n");
    }
    std::string r = http_get(srv.port(), "/other");
    CHECK(status_of(r) == 500);
    CHECK(status_of(http_get(srv.port())) == 500);  // still serving
  }
  log::set_file("");
  std::ifstream f(logf);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string text = ss.str();
  size_t lines = 0;
  for (size_t p = 0; (p = text.find("metrics server: ", p)) != std::string::npos; ++p) ++lines;
  INFO(text);
  // the first failure in full, the other 6 in one summary line (naming the latest)
  CHECK(lines == 2);
  CHECK(text.find("metrics server: a request failed (HTTP 500): GET /metrics from 127.0.0.1:") != std::string::npos);
  CHECK(text.find("token=s3cr3t (repeats: at most one line per 60 s)") != std::string::npos);
  CHECK(text.find("a request failed (HTTP 500): 6 more since the last report") != std::string::npos);
  std::filesystem::remove(logf);
}

TEST_CASE("http limits: 1000 idle connections neither lock out a scraper nor pile up") {
  raise_nofile(4096);
  MetricRegistry reg("flood", 0);
  reg.record_step({0.1, 0, 0, 0, 0, 0, 16, 0});
  reg.publish();
  HttpServer srv("127.0.0.1", 0, metrics_handler(reg));
  std::vector<int> idle;
  for (int i = 0; i < 1000; ++i) {
    int fd = connect_nb(srv.port());
    REQUIRE(fd >= 0);
    idle.push_back(fd);
  }
  int connected = 0;
  for (int fd : idle) {
    pollfd p{fd, POLLOUT, 0};
    connected += poll(&p, 1, 2000) == 1;
  }
  CHECK(connected == 1000);
  std::this_thread::sleep_for(450ms);  // older than the eviction grace (250 ms) now
  // a scraper retries as Prometheus does on its next scrape; here within a second
  std::string r;
  auto t0 = Clock::now();
  for (int i = 0; i < 4 && status_of(r) != 200; ++i) {
    if (i) std::this_thread::sleep_for(300ms);
    r = http_get(srv.port());
  }
  CHECK(status_of(r) == 200);
  CHECK(r.find("dtrain_samples_total{run=\"flood\"") != std::string::npos);
  CHECK(ms_since(t0) < 2000);
  int open = 0;
  for (int fd : idle) open += !closed_by_peer(fd);
  MESSAGE(open << " of 1000 idle connections still open after the scrape");
  CHECK(open <= int(HttpServer::kMaxConnections));
  for (int fd : idle) close(fd);
}

TEST_CASE("http limits: out of file descriptors - peers get a 503 and the loop does not spin") {
  MetricRegistry reg("fds", 0);
  reg.publish();
  HttpServer srv("127.0.0.1", 0, metrics_handler(reg));
  const int port = srv.port();
  auto [cpu, answered] = with_few_fds(3, 1500, [port] {
    static int fds[40];
    int n = 0;
    for (int& fd : fds) fd = connect_blocking(port);
    for (int fd : fds) {
      if (fd < 0) continue;
      timeval tv{0, 200000};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      static const char req[] = "GET /metrics HTTP/1.1\r\n";  // unfinished: no reply unless refused
      (void)!send(fd, req, sizeof req - 1, MSG_NOSIGNAL);
      static char buf[256];
      ssize_t k = recv(fd, buf, sizeof buf, 0);
      n += k >= 12 && memcmp(buf, "HTTP/1.1 503", 12) == 0;
    }
    return n;
  });
  MESSAGE("out of descriptors: " << answered << " of 40 peers got a 503; the process used " << cpu
                                 << " s of CPU in 1.5 s");
  CHECK(answered >= 30);
  CHECK(cpu < 0.4);
  CHECK(status_of(http_get(port)) == 200);  // descriptors back: served again
}

}  // TEST_SUITE

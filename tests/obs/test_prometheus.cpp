// The /metrics exposition against the real Prometheus tools (Debian package `prometheus`):
// `promtool check metrics` lints the text, and a real Prometheus server scrapes a live
// HttpServer every second while a thread plays the trainer. Skipped, with a message
// saying so, when the binaries are not installed.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "obs/http_server.h"
#include "obs/metrics.h"
#include "obs/prometheus.h"
#include "skip.h"
#include "free_port.h"

using namespace dtrain;
using Clock = std::chrono::steady_clock;

namespace {

std::string find_binary(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    std::string p = (dir.empty() ? "." : dir) + "/" + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

struct TmpDir {
  std::string path;
  TmpDir() {
    char tmpl[] = "/tmp/dtrain_prom_XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TmpDir() { std::filesystem::remove_all(path); }
};

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// GET http://127.0.0.1:port<target>; the body, or "" on any failure. Bounded by timeout_ms.
std::string http_get_body(int port, const std::string& target, int timeout_ms = 2000) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return "";
  }
  std::string req = "GET " + target + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) != ssize_t(req.size())) {
    close(fd);
    return "";
  }
  std::string out;
  auto end = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int left = int(std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count());
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, left) <= 0) break;
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  close(fd);
  size_t body = out.find("\r\n\r\n");
  if (out.rfind("HTTP/1.", 0) != 0 || out.compare(9, 3, "200") != 0 || body == std::string::npos) return "";
  return out.substr(body + 4);
}

// A child process killed (SIGTERM, then SIGKILL after 5 s) when this goes out of scope.
struct Child {
  pid_t pid = -1;
  ~Child() {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    auto end = Clock::now() + std::chrono::seconds(5);
    int st = 0;
    while (waitpid(pid, &st, WNOHANG) == 0) {
      if (Clock::now() > end) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
};

Snapshot busy_snapshot() {
  MetricRegistry reg("promtool \"check\"\\run", 0, 100);
  for (int i = 0; i < 50; i++) reg.record_step({0.1 + 0.001 * i, 0.01, 0.03, 0.04, 0.005, 0.01, 64, 0});
  reg.set_loss(0.5);
  reg.set_lr(1e-3);
  reg.set_eval(50, 0.7, "miou", 0.81);
  reg.set_eval_best(0.83);
  reg.set_mfu(0.31);
  reg.set_arena_high_water(123456789);
  reg.add_checkpoint(0.75);
  reg.set_gpus({{0, "NVIDIA H100 80GB HBM3", 0.9, 1e9, 8e10}, {1, "NVIDIA H100 80GB HBM3", 0.8, 2e9, 8e10}});
  reg.publish();
  return *reg.snapshot();
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("promtool check metrics accepts the exposition") {
    std::string promtool = find_binary("promtool");
    if (promtool.empty()) {
      SKIP_TEST("promtool not found in PATH (install the Debian package `prometheus`)");
    }
    TmpDir t;
    for (const Snapshot& s : {Snapshot{}, busy_snapshot()}) {
      std::string file = t.path + "/metrics.txt";
      std::ofstream(file) << render_prometheus(s);
      std::string cmd = promtool + " check metrics < " + file + " > " + t.path + "/out.txt 2>&1";
      int rc = std::system(cmd.c_str());
      std::string out = slurp(t.path + "/out.txt");
      INFO("promtool said: ", out);
      CHECK(WIFEXITED(rc));
      CHECK(WEXITSTATUS(rc) == 0);
      CHECK(out.find("error") == std::string::npos);
    }
  }

  TEST_CASE("a real Prometheus scrapes /metrics and sees dtrain_samples_total grow") {
    std::string prom = find_binary("prometheus");
    if (prom.empty()) {
      SKIP_TEST("prometheus not found in PATH (install the Debian package `prometheus`)");
    }
    auto deadline = Clock::now() + std::chrono::seconds(25);
    TmpDir t;
    MetricRegistry reg("scrape-test", 0);
    HttpServer srv("127.0.0.1", 0, metrics_handler(reg));
    std::atomic<bool> stop{false};
    std::thread trainer([&] {  // 100 steps/s of 8 samples, published every 10 steps
      for (int i = 0; !stop; i++) {
        reg.record_step({0.01, 0.001, 0.003, 0.005, 0, 0.001, 8, 0});
        if (i % 10 == 9) reg.publish();
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
    struct Join {
      std::atomic<bool>& stop;
      std::thread& t;
      ~Join() {
        stop = true;
        t.join();
      }
    } join{stop, trainer};

    int prom_port = free_port();
    std::string cfg = t.path + "/prometheus.yml";
    std::ofstream(cfg) << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                          "scrape_configs:\n  - job_name: dtrain\n    static_configs:\n      - targets: ['127.0.0.1:"
                       << srv.port() << "']\n";
    std::string log = t.path + "/prometheus.log";
    Child child;
    child.pid = fork();
    REQUIRE(child.pid >= 0);
    if (child.pid == 0) {
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      std::string a1 = "--config.file=" + cfg, a2 = "--storage.tsdb.path=" + t.path + "/data",
                  a3 = "--web.listen-address=127.0.0.1:" + std::to_string(prom_port);
      execl(prom.c_str(), prom.c_str(), a1.c_str(), a2.c_str(), a3.c_str(), "--log.level=warn", (char*)nullptr);
      _exit(127);
    }

    std::string query = "/api/v1/query?query=dtrain_samples_total";
    double first = -1, last = -1;
    std::string labels;
    while (Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      int st = 0;
      if (waitpid(child.pid, &st, WNOHANG) == child.pid) {
        child.pid = -1;
        FAIL("prometheus exited early: ", slurp(log));
      }
      std::string body = http_get_body(prom_port, query);
      if (body.empty()) continue;
      auto j = nlohmann::json::parse(body, nullptr, false);
      if (j.is_discarded() || j.value("status", "") != "success") continue;
      auto& res = j["data"]["result"];
      if (!res.is_array() || res.empty()) continue;
      double v = std::stod(res[0]["value"][1].get<std::string>());
      labels = res[0]["metric"].dump();
      if (first < 0) first = v;
      last = v;
      if (last > first) break;  // two different scrapes seen
    }
    INFO("prometheus log: ", slurp(log));
    INFO("labels: ", labels);
    CHECK(first >= 0);
    CHECK(last > first);
    CHECK(labels.find("\"job\":\"dtrain\"") != std::string::npos);
    CHECK(labels.find("\"run\":\"scrape-test\"") != std::string::npos);
    CHECK(labels.find("\"rank\":\"0\"") != std::string::npos);
    // the summary's quantiles arrive as well
    std::string q = http_get_body(prom_port, "/api/v1/query?query=dtrain_step_seconds%7Bquantile%3D%220.99%22%7D");
    CHECK(q.find("\"quantile\":\"0.99\"") != std::string::npos);
    MESSAGE("prometheus saw dtrain_samples_total go from ", first, " to ", last);
  }
}

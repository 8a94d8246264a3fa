// dtrain's c10d TCPStore client (dist/c10d_store.h) against real PyTorch TCPStore servers:
// tests/tcpstore_server.py run by /usr/bin/python3 (Debian's torch 1.13: the legacy
// dialect) and by every interpreter listed in DTRAIN_TEST_TORCH_PYTHONS (colon-separated,
// e.g. a venv with torch 2.x: the validate dialect, on both its libuv and classic servers).
// A python without torch makes the tests skip with a message.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/fsutil.h"
#include "core/sha256.h"
#include "comm/c10d_store.h"
#include "run_cmd.h"
#include "test_util.h"
#include "skip.h"

using namespace dtrain;
using namespace dtrain::comm;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kScript = std::string(DTRAIN_TEST_DIR) + "/tcpstore_server.py";

std::vector<std::string> pythons() {
  std::vector<std::string> out{"/usr/bin/python3"};
  if (const char* e = std::getenv("DTRAIN_TEST_TORCH_PYTHONS")) {
    std::stringstream ss(e);
    std::string p;
    while (std::getline(ss, p, ':'))
      if (!p.empty()) out.push_back(p);
  }
  return out;
}

std::string to_hex(const std::vector<uint8_t>& v) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t b : v) s += {d[b >> 4], d[b & 15]};
  return s;
}

// tests/tcpstore_server.py as a child process, talked to over its stdin/stdout. Its own
// lines start with '@'; anything else it prints after its banner is torch's log (`log`).
struct TorchServer {
  pid_t pid = -1;
  int to = -1, from = -1;
  std::string buf, banner, version, log;
  int port = 0;
  bool libuv = false;

  // Starts it; false (and *why) when it does not come up, e.g. no torch in that python.
  bool start(const std::string& python, const std::string& mode, std::string* why) {
    int in[2], out[2];
    REQUIRE(pipe(in) == 0);
    REQUIRE(pipe(out) == 0);
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      dup2(out[1], 2);
      close(in[1]);
      close(out[0]);
      execl(python.c_str(), python.c_str(), kScript.c_str(), mode.c_str(), (char*)nullptr);
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to = in[1];
    from = out[0];
    fcntl(to, F_SETFD, FD_CLOEXEC);
    fcntl(from, F_SETFD, FD_CLOEXEC);
    std::string all;
    while (true) {
      std::string line;
      if (!read_line(&line, 90s)) {
        *why = python + " " + kScript + " did not start: " + all + buf;
        stop();
        return false;
      }
      all += line + "\n";
      if (line.rfind("@PORT ", 0) == 0) {
        banner = line.substr(1);
        std::istringstream ls(line);
        std::string w;
        int lu = 0;
        ls >> w >> port >> w >> version >> w >> lu;
        libuv = lu != 0;
        return port > 0;
      }
    }
  }
  bool read_line(std::string* line, std::chrono::milliseconds timeout) {
    auto deadline = Clock::now() + timeout;
    while (true) {
      auto nl = buf.find('\n');
      if (nl != std::string::npos) {
        *line = buf.substr(0, nl);
        buf.erase(0, nl + 1);
        return true;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{from, POLLIN, 0};
      if (poll(&p, 1, int(left)) <= 0) continue;
      char tmp[65536];
      ssize_t k = read(from, tmp, sizeof tmp);
      if (k <= 0) return false;
      buf.append(tmp, size_t(k));
    }
  }
  // The next line of the script's own (without its '@'); other lines go to `log`.
  bool read_reply(std::string* line, std::chrono::milliseconds timeout) {
    while (read_line(line, timeout)) {
      if (!line->empty() && (*line)[0] == '@') {
        line->erase(0, 1);
        return true;
      }
      log += *line + "\n";
    }
    return false;
  }
  std::string cmd(const std::string& line) {
    std::string l = line + "\n";
    const char* p = l.data();
    size_t n = l.size();
    while (n) {
      ssize_t k = write(to, p, n);
      REQUIRE(k > 0);
      p += k;
      n -= size_t(k);
    }
    std::string reply;
    REQUIRE_MESSAGE(read_reply(&reply, 60s), "no reply from the torch server to: " << line.substr(0, 80));
    return reply;
  }
  void kill_now() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }
  void stop() {
    if (to >= 0) close(to);  // end of input: the script exits
    to = -1;
    if (pid > 0) {
      for (int i = 0; i < 100 && waitpid(pid, nullptr, WNOHANG) == 0; ++i) std::this_thread::sleep_for(20ms);
      kill_now();
    }
    if (from >= 0) close(from);
    from = -1;
  }
  ~TorchServer() { stop(); }
};

// Empty when some python in pythons() imports torch.distributed (a TCPStore server can run),
// else why none can (the test is then skipped).
std::string no_torch_python() {
  std::string why;
  for (const auto& py : pythons()) {
    const CmdResult r = run_cmd(shell_quote(py) + " -c 'import torch.distributed'");
    if (r.code == 0) return "";
    why += (why.empty() ? "" : "; ") + py + ": " + (r.code == 127 ? std::string("not found") : "no torch.distributed");
  }
  return "no python with torch to host a TCPStore (" + why + ")";
}

// Runs fn against a server of every python and mode available (the test case checked first
// that some python has torch: no_torch_python()).
template <class Fn>
void for_each_server(Fn fn) {
  int ran = 0;
  for (const auto& py : pythons()) {
    std::vector<std::string> modes{"default"};
    for (size_t m = 0; m < modes.size(); ++m) {
      TorchServer srv;
      std::string why;
      if (!srv.start(py, modes[m], &why)) {
        MESSAGE("no PyTorch TCPStore server from " << py << " (the others are tested): " << why);
        break;
      }
      // torch >= 2.4 serves with libuv by default: test its classic server too
      if (srv.libuv && m == 0) modes.push_back("classic");
      INFO("server: " << py << " " << modes[m] << " (" << srv.banner << ")");
      MESSAGE("c10d client vs " << py << " " << modes[m] << ": " << srv.banner);
      fn(srv);
      if (srv.pid > 0) {
        srv.cmd("numkeys");  // everything the server logged so far has arrived before this reply
        CHECK_MESSAGE(srv.log.empty(), "the torch server logged: " << srv.log);  // e.g. broken pipes
      }
      ++ran;
    }
  }
  CHECK_MESSAGE(ran > 0, "no python could host a TCPStore, though one imports torch.distributed");
}

C10dDialect expected_dialect(const TorchServer& s) {
  // the VALIDATE query arrived in torch 2.2
  int major = 0, minor = 0;
  char dot;
  std::istringstream(s.version) >> major >> dot >> minor;
  return (major > 2 || (major == 2 && minor >= 2)) ? C10dDialect::Validate : C10dDialect::Legacy;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
doctest::String ds(const std::string& s) { return doctest::String(s.c_str()); }

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("c10d store: set get add check wait remove and binary values against torch's TCPStore") {
  if (const std::string why = no_torch_python(); !why.empty()) SKIP_TEST(why);
  for_each_server([](TorchServer& srv) {
    C10dStore a("127.0.0.1", srv.port, "", 5s);
    CHECK(a.dialect() == expected_dialect(srv));
    CHECK(C10dStore::probe("127.0.0.1", srv.port, 5s) == a.dialect());
    C10dStore b("127.0.0.1", srv.port, "dtrain/0/", 5s);
    CHECK(srv.cmd("numkeys") == "NUMKEYS 0");  // the probes and connections left nothing behind

    // dtrain <-> dtrain
    a.set("k", std::string("hello"));
    CHECK(C10dStore("127.0.0.1", srv.port, "", 5s).get_string("k") == "hello");
    std::vector<uint8_t> bin{0, 1, 2, 255, 0, '\n', 0x80};
    b.set("bin", bin);
    CHECK(b.get("bin") == bin);
    CHECK(a.add("ctr", 5) == 5);
    CHECK(b.add("ctr", -2) == -2);  // another prefix, another key
    CHECK(a.add("ctr", -7) == -2);
    CHECK(a.get_string("ctr") == "-2");  // stored as decimal text, as torch does
    CHECK(a.check({"k", "ctr"}));
    CHECK_FALSE(a.check({"k", "nope"}));
    a.set("empty", std::vector<uint8_t>{});
    CHECK(a.get("empty").empty());
    CHECK(a.check({"empty"}));

    // dtrain <-> torch: the same keys (torch's client adds the same leading '/')
    CHECK(srv.cmd("get k") == "VALUE " + to_hex(bytes_of("hello")));
    CHECK(srv.cmd("get dtrain/0/bin") == "VALUE " + to_hex(bin));
    CHECK(srv.cmd("set fromtorch 00ff0a0d80") == "OK");
    CHECK(a.get("fromtorch") == std::vector<uint8_t>{0, 0xff, 0x0a, 0x0d, 0x80});
    CHECK(srv.cmd("set dtrain/0/x 7879") == "OK");
    CHECK(b.get_string("x") == "xy");

    // large values both ways (4 MiB; PyTorch's libuv server takes at most 8 MiB)
    std::vector<uint8_t> big(4u << 20);
    std::mt19937 rng(7);
    for (auto& v : big) v = uint8_t(rng());
    a.set("big", big);
    CHECK(srv.cmd("sha big") == "SHA " + std::to_string(big.size()) + " " + sha256_hex(big.data(), big.size()));
    std::string sha = srv.cmd("setrandom big2 3000001");
    auto got = a.get("big2");
    CHECK(got.size() == 3000001);
    CHECK(sha == "SHA " + sha256_hex(got.data(), got.size()));
    CHECK_THROWS_WITH_AS(a.set("huge", std::vector<uint8_t>(kC10dMaxValue + 1)), doctest::Contains("'huge'"),
                         RuntimeFault);

    // wait blocks until another client (torch's) sets the key
    std::thread setter([&] {
      std::this_thread::sleep_for(150ms);
      srv.cmd("set late 76");
    });
    auto t0 = Clock::now();
    a.wait({"late", "k"});
    CHECK(Clock::now() - t0 >= 100ms);
    setter.join();
    CHECK(a.get_string("late") == "v");

    // timeouts name the missing key(s) and the address; the store stays usable
    const std::string addr = "127.0.0.1:" + std::to_string(srv.port);
    t0 = Clock::now();
    try {
      a.wait({"k", "absent"}, 200ms);
      FAIL("wait for an absent key returned");
    } catch (const RuntimeFault& e) {
      std::string m = e.what();
      CHECK(m.find("timed out after 200 ms") != std::string::npos);
      CHECK(m.find("'absent'") != std::string::npos);
      CHECK(m.find("'k'") == std::string::npos);  // present: not named
      CHECK(m.find(addr) != std::string::npos);
    }
    CHECK(Clock::now() - t0 < 3s);
    CHECK_THROWS_WITH_AS(b.get("missing", 150ms), doctest::Contains("'missing'"), RuntimeFault);
    CHECK(a.get_string("k") == "hello");  // reconnected after the timeout
    CHECK(srv.cmd("set absent 01") == "OK");
    a.wait({"absent"});  // no stale wait of the closed connection in the way

    CHECK(a.remove("k"));
    CHECK_FALSE(a.remove("k"));
    CHECK_FALSE(a.check({"k"}));
    CHECK(a.num_keys() >= 8);
  });
}

TEST_CASE("c10d store: the server killed during a wait gives a clear error at once") {
  if (const std::string why = no_torch_python(); !why.empty()) SKIP_TEST(why);
  for_each_server([](TorchServer& srv) {
    C10dStore a("127.0.0.1", srv.port, "dtrain/", 60s);
    a.set("x", std::string("1"));
    const int port = srv.port;
    std::thread killer([&] {
      std::this_thread::sleep_for(300ms);
      srv.kill_now();
    });
    auto t0 = Clock::now();
    std::string msg;
    try {
      a.wait({"never"});
    } catch (const RuntimeFault& e) {
      msg = e.what();
    }
    killer.join();
    CHECK(Clock::now() - t0 < 10s);  // not the 60 s timeout
    CHECK(msg.find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
    CHECK(msg.find("closed") != std::string::npos);
    CHECK(msg.find("'never'") != std::string::npos);
    // and every later call fails at once, naming the address
    t0 = Clock::now();
    CHECK_THROWS_WITH_AS(a.get_string("x"), doctest::Contains(ds("127.0.0.1:" + std::to_string(port))), RuntimeFault);
    CHECK(Clock::now() - t0 < 5s);
  });
}

// The whole binary: a torchrun worker (TORCHELASTIC_USE_AGENT_STORE=True) whose agent store
// is gone fails like any runtime fault: exit 1, one line naming the address. A bad
// DTRAIN_TCPSTORE_PROTOCOL is a user error: exit 2, one line naming the variable.
TEST_CASE("c10d store: a torchrun worker without its agent store exits 1 naming the address") {
  test_util::TmpDir dir;
  const std::string rec = dir.path + "/tiny.toml";
  fs::write_file(rec, "[run]\nname = \"agent\"\nout_dir = \"" + dir.path + "/runs\"\ndevice = \"cpu\"\nthreads = 1\n"
                      "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\n"
                      "num_classes = 10\n[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
                      "[train]\nbatch_size = 4\nmax_steps = 2\n[optim]\nname = \"sgd\"\nlr = 0.05\n"
                      "[parallel]\ntimeout_s = 1\n");
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(s, (sockaddr*)&sa, sizeof sa) == 0);
  socklen_t len = sizeof sa;
  REQUIRE(getsockname(s, (sockaddr*)&sa, &len) == 0);
  const int port = ntohs(sa.sin_port);
  close(s);  // nothing listens there now
  const std::string env = "env -u DTRAIN_LAUNCHER -u DTRAIN_JOB_TOKEN -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK "
                          "RANK=1 WORLD_SIZE=2 TORCHELASTIC_USE_AGENT_STORE=True TORCHELASTIC_RESTART_COUNT=0 "
                          "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " ";
  auto r = run_cmd(env + dtrain_bin() + " train " + rec);
  INFO(r.all());
  CHECK(r.code == 1);
  CHECK(r.err.find("c10d store: cannot connect to 127.0.0.1:" + std::to_string(port)) != std::string::npos);
  CHECK(r.err_lines() == 1);
  auto u = run_cmd(env + "DTRAIN_TCPSTORE_PROTOCOL=v9 " + dtrain_bin() + " train " + rec);
  INFO(u.all());
  CHECK(u.code == 2);
  CHECK(u.err.find("DTRAIN_TCPSTORE_PROTOCOL='v9'") != std::string::npos);
  CHECK(u.err_lines() == 1);
}

}  // TEST_SUITE("integration")

TEST_SUITE("unit") {

TEST_CASE("c10d store: no server or a silent one is one clear error naming the address") {
  // nothing listens: the connect retries until the timeout
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(lfd >= 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(lfd, (sockaddr*)&sa, sizeof sa) == 0);
  socklen_t len = sizeof sa;
  REQUIRE(getsockname(lfd, (sockaddr*)&sa, &len) == 0);
  const int port = ntohs(sa.sin_port);
  const std::string addr = "127.0.0.1:" + std::to_string(port);
  auto t0 = Clock::now();
  CHECK_THROWS_WITH_AS(C10dStore("127.0.0.1", port, "", 300ms),
                       doctest::Contains(ds("cannot connect to " + addr + " within 300 ms")), RuntimeFault);
  CHECK(Clock::now() - t0 < 3s);
  // something listens but never answers the probe
  REQUIRE(listen(lfd, 4) == 0);
  t0 = Clock::now();
  CHECK_THROWS_WITH_AS(C10dStore("127.0.0.1", port, "", 300ms),
                       doctest::Contains(ds(addr + ": no answer to the protocol probe")), RuntimeFault);
  CHECK(Clock::now() - t0 < 3s);
  // the dialect given explicitly: the connection's own check fails just as clearly
  CHECK_THROWS_WITH_AS(C10dStore("127.0.0.1", port, "", 300ms, C10dDialect::Validate),
                       doctest::Contains(ds(addr + ": the server does not answer like a PyTorch TCPStore")),
                       RuntimeFault);
  close(lfd);
  CHECK(parse_dialect("legacy") == C10dDialect::Legacy);
  CHECK(parse_dialect("validate") == C10dDialect::Validate);
  CHECK_FALSE(parse_dialect("2.2").has_value());
}

}  // TEST_SUITE("unit")

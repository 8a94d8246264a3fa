// The store's limits with short settings (StoreLimits): handshake and frame deadlines,
// connection caps, eviction; and the throttled log both servers use. Attacks at the
// default settings: tests/comm/test_net_limits.cpp and tests/comm/test_net_fuzz.cpp.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm/communicator.h"
#include "comm/store.h"
#include "core/error.h"
#include "core/log.h"
#include "core/net_guard.h"
#include "net_fuzz.h"

using namespace dtrain;
using namespace dtrain::comm;
using namespace std::chrono_literals;
using namespace netfuzz;

namespace {

const char* kToken = "limits-token";

std::string hello_frame(const std::string& token) {
  std::string body = "\x01" + le32(uint32_t(token.size())) + token;
  return le32(uint32_t(body.size())) + body;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = 0; (p = text.find(what, p)) != std::string::npos; ++p) ++n;
  return n;
}

// A store that answers the hello and then nothing more: a store whose host was cut off after
// the job started (the client's requests are sent, no reply ever comes).
struct SilentStore {
  int listen_fd = -1, port = 0;
  std::atomic<bool> stop{false};
  std::thread th;
  SilentStore() {
    listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(listen_fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
    REQUIRE(listen(listen_fd, 4) == 0);
    socklen_t len = sizeof sa;
    getsockname(listen_fd, reinterpret_cast<sockaddr*>(&sa), &len);
    port = ntohs(sa.sin_port);
    th = std::thread([this] {
      int fd = accept(listen_fd, nullptr, nullptr);
      if (fd < 0) return;
      char hdr[4];
      if (recv(fd, hdr, 4, MSG_WAITALL) == 4) {
        std::string body(size_t(uint8_t(hdr[0])) | size_t(uint8_t(hdr[1])) << 8, '\0');
        if (recv(fd, body.data(), body.size(), MSG_WAITALL) == ssize_t(body.size())) {
          const std::string ok = le32(1) + std::string(1, '\0');
          (void)!send(fd, ok.data(), ok.size(), MSG_NOSIGNAL);
        }
      }
      while (!stop) std::this_thread::sleep_for(10ms);  // reads nothing, answers nothing
      close(fd);
    });
  }
  ~SilentStore() {
    stop = true;
    shutdown(listen_fd, SHUT_RDWR);
    th.join();
    close(listen_fd);
  }
};

}  // namespace

TEST_SUITE("unit") {

// Before StoreDeadline, the arrival report waited out the store's own timeout (here 10 s) in its
// first request, so a rank cut off from the store failed after timeout_s + timeout_s.
TEST_CASE("store deadline: the arrival report waits no longer than its grace for a store that stopped answering") {
  SilentStore silent;
  StoreClient c("127.0.0.1", silent.port, kToken, 10s);
  const auto t0 = Clock::now();
  const std::string m = report_arrivals(c, "g/", 7, 0, {0, 1}, 300ms);
  const auto took = ms_since(t0);
  INFO(m);
  CHECK(took < 2000);
  CHECK(took >= 300);
  CHECK(m.find("; arrivals unknown: the store is unreachable: store 127.0.0.1:" + std::to_string(silent.port) +
               ": set 'g/fail/0' failed: no reply within ") != std::string::npos);
}

TEST_CASE("store deadline: a StoreDeadline bounds every request of its thread only while it lives") {
  SilentStore silent;
  StoreClient c("127.0.0.1", silent.port, kToken, 10s);
  auto t0 = Clock::now();
  {
    StoreDeadline outer(Clock::now() + 5s);
    StoreDeadline inner(Clock::now() + 200ms);  // the earlier one wins
    CHECK_THROWS_WITH_AS(c.check({"k"}), doctest::Contains("check 'k' failed: no reply within"), RuntimeFault);
  }
  CHECK(ms_since(t0) < 2000);
  CHECK(StoreDeadline::cap(Clock::time_point::max()) == Clock::time_point::max());  // none left
  // a healthy store answers within the deadline as usual; another thread is not bounded
  StoreServer server("127.0.0.1", 0, kToken);
  StoreClient a("127.0.0.1", server.port(), kToken, 5s);
  StoreDeadline d(Clock::now() + 2s);
  a.set("k", std::string("v"));
  CHECK(a.get_string("k") == "v");
  std::thread([] { CHECK(StoreDeadline::cap(Clock::time_point::max()) == Clock::time_point::max()); }).join();
  CHECK(StoreDeadline::cap(Clock::time_point::max()) < Clock::time_point::max());
}


TEST_CASE("store limits: idle and trickling peers are cut at the handshake deadline - clients may idle and wait") {
  StoreLimits lim;
  lim.handshake_timeout = 300ms;
  lim.frame_timeout = 400ms;
  StoreServer server("127.0.0.1", 0, kToken, lim);
  StoreClient a("127.0.0.1", server.port(), kToken, 5s);
  StoreClient b("127.0.0.1", server.port(), kToken, 5s);
  auto t0 = Clock::now();
  int idle = connect_blocking(server.port());
  int slow = connect_blocking(server.port());
  REQUIRE((idle >= 0 && slow >= 0));
  std::atomic<int64_t> slow_cut_ms{-1};
  std::thread trickle([&] {  // a valid hello, one byte every 50 ms
    std::string h = hello_frame(kToken);
    for (char c : h) {
      if (send(slow, &c, 1, MSG_NOSIGNAL) != 1) break;
      std::this_thread::sleep_for(50ms);
      if (closed_by_peer(slow)) break;
    }
    slow_cut_ms = ms_since(t0);
  });
  CHECK(wait_closed(idle, 2000));
  const int64_t idle_ms = ms_since(t0);
  trickle.join();
  MESSAGE("idle peer closed after " << idle_ms << " ms, trickling peer after " << slow_cut_ms.load() << " ms");
  CHECK((idle_ms >= 250 && idle_ms < 1500));
  CHECK((slow_cut_ms >= 250 && slow_cut_ms < 1500));
  close(idle);
  close(slow);
  // authenticated clients: idle far beyond both deadlines, then a wait() that outlasts them
  std::this_thread::sleep_for(900ms);
  a.set("k", std::string("v"));
  CHECK(b.get_string("k") == "v");
  std::thread setter([&] {
    std::this_thread::sleep_for(900ms);
    b.set("late", std::string("1"));
  });
  a.wait({"late"}, 5s);
  setter.join();
  // an authenticated peer that stalls inside a frame is cut at the frame deadline
  int fd = connect_blocking(server.port());
  REQUIRE(fd >= 0);
  std::string h = hello_frame(kToken);
  REQUIRE(send(fd, h.data(), h.size(), MSG_NOSIGNAL) == ssize_t(h.size()));
  char ok[5];
  REQUIRE(recv(fd, ok, 5, MSG_WAITALL) == 5);  // u32 1 + status 0
  CHECK(ok[4] == 0);
  std::string part = le32(100) + "\x02";  // a SET of 100 bytes, 1 sent
  REQUIRE(send(fd, part.data(), part.size(), MSG_NOSIGNAL) == ssize_t(part.size()));
  auto t1 = Clock::now();
  CHECK(wait_closed(fd, 2000));
  CHECK(ms_since(t1) >= 350);
  close(fd);
  auto st = server.stats();
  CHECK(st.handshake_timeout == 2);
  CHECK(st.frame_timeout == 1);
  CHECK(st.authenticated == 2);
  CHECK(a.get_string("k") == "v");
}

TEST_CASE("store limits: a flood of unauthenticated peers is capped and evicted - clients still get in") {
  StoreLimits lim;
  lim.max_unauthenticated = 8;
  lim.evict_grace = 100ms;
  StoreServer server("127.0.0.1", 0, kToken, lim);
  std::vector<std::unique_ptr<StoreClient>> clients;
  for (int i = 0; i < 4; ++i) clients.push_back(std::make_unique<StoreClient>("127.0.0.1", server.port(), kToken, 5s));
  std::vector<int> flood;
  for (int i = 0; i < 100; ++i) flood.push_back(connect_nb(server.port()));
  std::this_thread::sleep_for(400ms);
  auto st = server.stats();
  CHECK(st.open - st.authenticated <= 8);
  CHECK(st.authenticated == 4);
  CHECK(st.buffered_bytes == 0);
  // a new client during the flood: accepted within a few eviction rounds
  auto t0 = Clock::now();
  StoreClient late("127.0.0.1", server.port(), kToken, 10s);
  late.set("x", std::string("y"));
  MESSAGE("a client joined during a flood of 100 idle peers in " << ms_since(t0) << " ms");
  CHECK(ms_since(t0) < 5000);
  CHECK(clients[0]->get_string("x") == "y");
  CHECK(server.stats().evicted > 0);
  for (int fd : flood) close(fd);

  // the total cap: the refused client is told why
  StoreLimits two;
  two.max_connections = 2;
  StoreServer small("127.0.0.1", 0, kToken, two);
  StoreClient c1("127.0.0.1", small.port(), kToken, 2s);
  StoreClient c2("127.0.0.1", small.port(), kToken, 2s);
  CHECK_THROWS_WITH_AS(StoreClient("127.0.0.1", small.port(), kToken, 2s),
                       doctest::Contains("too many connections to the store (2 open, the limit)"), RuntimeFault);
  CHECK(small.stats().over_limit == 1);
  c1.set("still", std::string("ok"));
  CHECK(c2.get_string("still") == "ok");
}

TEST_CASE("store limits: the job token fits in the hello frame - a longer one is a user error") {
  std::string tok(kMaxJobToken, 't');
  StoreServer server("127.0.0.1", 0, tok);
  StoreClient c("127.0.0.1", server.port(), tok, 2s);
  c.set("k", std::string("v"));
  CHECK_THROWS_WITH_AS(StoreClient("127.0.0.1", server.port(), tok + "t", 2s),
                       doctest::Contains("job token (DTRAIN_JOB_TOKEN or parallel.job_id) is 4092 bytes"),
                       UserError);
  // a value beyond the frame limit fails on the client, naming the key, and the connection stays usable
  CHECK_THROWS_WITH_AS(c.set("big", std::vector<uint8_t>(kMaxFrame, 0)), doctest::Contains("'big'"), RuntimeFault);
  CHECK(c.get_string("k") == "v");
}

TEST_CASE("net_guard: the throttled log writes the first event of a cause and then one summary per period") {
  std::string logf = std::string(DTRAIN_BUILD_DIR) + "/throttled_" + std::to_string(getpid()) + ".log";
  std::filesystem::remove(logf);
  log::set_file(logf);
  {
    net_guard::ThrottledLog tl("srv", {"cause A", "cause B"}, 200ms);
    auto t = net_guard::Clock::now();
    for (int i = 0; i < 1000; ++i) tl.note(0, "peer " + std::to_string(i), t);
    tl.note(1, "only one", t);
    tl.tick(t + 100ms);  // not due yet
    tl.tick(t + 250ms);  // 999 more of A
    for (int i = 0; i < 5; ++i) tl.note(0, "later " + std::to_string(i), t + 300ms);
    CHECK(tl.total(0) == 1005);
    CHECK(tl.total(1) == 1);
  }  // the destructor reports the 5 not yet reported
  log::set_file("");
  std::string text = read_file(logf);
  INFO(text);
  CHECK(count(text, "srv: cause A: peer 0 (repeats: at most one line per 0.2 s)") == 1);
  CHECK(count(text, "srv: cause A: 999 more since the last report; the latest: peer 999") == 1);
  CHECK(count(text, "srv: cause A: 5 more since the last report; the latest: later 4") == 1);
  CHECK(count(text, "srv: cause B: only one") == 1);
  CHECK(count(text, "srv: ") == 4);
  std::filesystem::remove(logf);
}

}  // TEST_SUITE

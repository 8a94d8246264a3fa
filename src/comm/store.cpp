#include "comm/store.h"

#include <unistd.h>

#include <algorithm>
#include <thread>

#include "core/error.h"
#include "comm/net.h"
#include "comm/store_wire.h"

namespace dtrain::comm {

using namespace wire;
using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------------- client ----

namespace {

// The innermost live StoreDeadline of this thread; time_point::max() when none.
thread_local Clock::time_point t_deadline = Clock::time_point::max();

}  // namespace

StoreDeadline::StoreDeadline(Clock::time_point deadline) : prev_(t_deadline) {
  t_deadline = std::min(prev_, deadline);
}

StoreDeadline::~StoreDeadline() { t_deadline = prev_; }

Clock::time_point StoreDeadline::cap(Clock::time_point d) { return std::min(d, t_deadline); }

StoreClient::StoreClient(std::string host, int port, std::string job_token,
                         std::chrono::milliseconds timeout)
    : TcpStore(std::move(host), port, timeout), token_(std::move(job_token)) {
  connect_and_hello();
}

StoreClient::~StoreClient() { close_fd(); }

void StoreClient::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void StoreClient::connect_and_hello() {
  if (token_.size() > kMaxJobToken)
    user_error("job token (DTRAIN_JOB_TOKEN or parallel.job_id) is {} bytes; dtrain's store accepts at most {}",
               token_.size(), kMaxJobToken);
  std::vector<uint8_t> b{HELLO};
  put_str(b, token_);
  const auto deadline = Clock::now() + timeout_;
  auto backoff = std::chrono::milliseconds(10);
  std::string err;
  std::vector<uint8_t> rep;
  while (true) {
    fd_ = net::connect_retry(host_, port_, deadline, &err);
    if (fd_ < 0) fault("store: cannot connect to {} within {} ms: {}", address(), timeout_.count(), err);
    if (exchange(b, rep, &err)) break;
    // No reply: the server dropped this connection before its HELLO (it was busy with a
    // flood of unauthenticated connections, or restarting). Try again.
    err = "no answer to the hello: " + err;
    if (Clock::now() + backoff > deadline) fault("store: cannot connect to {} within {} ms: {}", address(),
                                                 timeout_.count(), err);
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
  if (rep[0] != 0) {  // the server's refusal: another job's token, too many connections
    Reader r{rep.data() + 1, rep.size() - 1};
    std::string msg = r.str();
    close_fd();
    fault("store {}: {}", address(), msg);
  }
}

bool StoreClient::exchange(const std::vector<uint8_t>& body, std::vector<uint8_t>& rep, std::string* why) {
  const auto start = Clock::now();
  const auto deadline = request_deadline();
  auto f = frame(body);
  uint8_t hdr[4];
  net::Io r = net::io_all(fd_, f.data(), f.size(), true, deadline);
  if (r == net::Io::Ok) r = net::io_all(fd_, hdr, 4, false, deadline);
  uint32_t len = r == net::Io::Ok ? get_u32(hdr) : 0;
  if (r == net::Io::Ok && (len == 0 || len > kMaxFrame)) {
    close_fd();
    *why = fmt::format("malformed reply (frame of {} bytes)", len);
    return false;
  }
  if (r == net::Io::Ok) {
    rep.resize(len);
    r = net::io_all(fd_, rep.data(), len, false, deadline);
  }
  if (r == net::Io::Ok) return true;
  close_fd();
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  *why = r == net::Io::Closed    ? std::string("the store closed the connection (did its host exit?)")
         : r == net::Io::Timeout ? fmt::format("no reply within {} ms", waited)
                                 : fmt::format("socket error after {} ms", waited);
  return false;
}

std::vector<uint8_t> StoreClient::request(const std::vector<uint8_t>& body, const char* what,
                                          const std::string& key) {
  if (fd_ < 0) fault("store {}: connection closed", address());
  if (body.size() > kMaxFrame)
    fault("store {}: {} '{}': the request is {} bytes; the store takes at most {} bytes per request", address(),
          what, key, body.size(), kMaxFrame);
  std::vector<uint8_t> rep;
  std::string why;
  if (!exchange(body, rep, &why)) fault("store {}: {} '{}' failed: {}", address(), what, key, why);
  if (rep[0] != 0) {
    Reader r{rep.data() + 1, rep.size() - 1};
    std::string msg = r.str();
    close_fd();
    fault("store {}: {}", address(), msg);
  }
  rep.erase(rep.begin());
  return rep;
}

void StoreClient::do_set(const std::string& key, const std::vector<uint8_t>& value) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<uint8_t> b{SET};
  put_str(b, key);
  put_bytes(b, value.data(), value.size());
  request(b, "set", key);
}

std::vector<uint8_t> StoreClient::do_get(const std::string& key, std::chrono::milliseconds timeout) {
  auto deadline = StoreDeadline::cap(Clock::now() + timeout);
  auto backoff = std::chrono::milliseconds(1);
  while (true) {
    {
      std::lock_guard<std::mutex> g(mu_);
      std::vector<uint8_t> b{GET};
      put_str(b, key);
      auto rep = request(b, "get", key);
      Reader r{rep.data(), rep.size()};
      if (r.u8()) {
        std::string v = r.str();
        if (!r.done()) fault("store {}: malformed reply to get '{}'", address(), key);
        return std::vector<uint8_t>(v.begin(), v.end());
      }
    }
    if (Clock::now() >= deadline)
      fault("store {}: timed out after {} ms waiting for key '{}'", address(), timeout.count(), key);
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(20));
  }
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<uint8_t> b{ADD};
  put_str(b, key);
  put_i64(b, delta);
  auto rep = request(b, "add", key);
  Reader r{rep.data(), rep.size()};
  int64_t v = r.i64();
  if (!r.done()) fault("store {}: malformed reply to add '{}'", address(), key);
  return v;
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<uint8_t> b{CHECK};
  put_u32(b, uint32_t(keys.size()));
  for (auto& k : keys) put_str(b, k);
  auto rep = request(b, "check", keys.empty() ? "" : keys[0]);
  return rep.size() == 1 && rep[0] == 1;
}

void StoreClient::do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  auto deadline = StoreDeadline::cap(Clock::now() + timeout);
  auto backoff = std::chrono::milliseconds(1);
  while (!check(keys)) {
    if (Clock::now() >= deadline) {
      std::string missing;
      for (auto& k : keys)
        if (!check({k})) missing += (missing.empty() ? "'" : ", '") + k + "'";
      fault("store {}: timed out after {} ms waiting for key(s) {}", address(), timeout.count(),
            missing);
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(20));
  }
}

bool StoreClient::remove(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<uint8_t> b{DEL};
  put_str(b, key);
  auto rep = request(b, "delete", key);
  return rep.size() == 1 && rep[0] == 1;
}

}  // namespace dtrain::comm

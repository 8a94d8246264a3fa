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

bool io_all(int fd, void* p, size_t n, bool sending, Clock::time_point deadline) {
  return net::io_all(fd, p, n, sending, deadline) == net::Io::Ok;
}

}  // namespace

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
    if (exchange(b, rep)) break;
    // Closed before the reply: the server dropped this connection before its HELLO (it
    // was busy with a flood of unauthenticated connections, or restarting). Try again.
    err = "the server closed the connection before answering the hello";
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

bool StoreClient::exchange(const std::vector<uint8_t>& body, std::vector<uint8_t>& rep) {
  auto deadline = Clock::now() + std::max(timeout_, std::chrono::milliseconds(1000));
  auto f = frame(body);
  uint8_t hdr[4];
  bool ok = io_all(fd_, f.data(), f.size(), true, deadline) && io_all(fd_, hdr, 4, false, deadline);
  uint32_t len = ok ? get_u32(hdr) : 0;
  if (ok && (len == 0 || len > kMaxFrame)) ok = false;
  if (ok) {
    rep.resize(len);
    ok = io_all(fd_, rep.data(), len, false, deadline);
  }
  if (!ok) close_fd();
  return ok;
}

std::vector<uint8_t> StoreClient::request(const std::vector<uint8_t>& body, const char* what,
                                          const std::string& key) {
  if (fd_ < 0) fault("store {}: connection closed", address());
  if (body.size() > kMaxFrame)
    fault("store {}: {} '{}': the request is {} bytes; the store takes at most {} bytes per request", address(),
          what, key, body.size(), kMaxFrame);
  std::vector<uint8_t> rep;
  if (!exchange(body, rep)) fault("store {}: {} '{}' failed: connection lost or no reply", address(), what, key);
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
  auto deadline = Clock::now() + timeout;
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
  auto deadline = Clock::now() + timeout;
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

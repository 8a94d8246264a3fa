#include "comm/c10d_store.h"

#include <unistd.h>

#include <algorithm>

#include "core/error.h"
#include "comm/net.h"

namespace dtrain::comm {

using net::Clock;

namespace {

// Query types of the two dialects (see c10d_store.h).
struct Codes {
  uint8_t set, get, add, check, wait, num_keys, del;
};
constexpr Codes kLegacy{0, 2, 3, 4, 5, 6, 8};
constexpr Codes kValidate{1, 3, 4, 5, 6, 7, 8};
const Codes& codes(C10dDialect d) { return d == C10dDialect::Validate ? kValidate : kLegacy; }
constexpr uint8_t kValidateQuery = 0;
constexpr uint32_t kValidateMagic = 0x3C85F7CE;
constexpr uint8_t kReady = 0;        // CHECK reply
constexpr uint8_t kStopWaiting = 0;  // WAIT reply
constexpr uint64_t kMaxReply = 1ull << 30;  // a GET reply longer than this is not a TCPStore's

void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i)));
}
void put_u64(std::vector<uint8_t>& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(uint8_t(v >> (8 * i)));
}
void put_str(std::vector<uint8_t>& b, const void* p, size_t n) {
  put_u64(b, n);
  auto* c = static_cast<const uint8_t*>(p);
  b.insert(b.end(), c, c + n);
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

std::string quoted_list(const std::vector<std::string>& keys) {
  std::string s;
  for (auto& k : keys) s += (s.empty() ? "'" : ", '") + k + "'";
  return s;
}

std::string io_why(net::Io r) {
  switch (r) {
    case net::Io::Closed: return "the connection was closed (did the store's server exit?)";
    case net::Io::Timeout: return "no answer in time";
    default: return "socket error";
  }
}

}  // namespace

const char* dialect_name(C10dDialect d) {
  switch (d) {
    case C10dDialect::Legacy: return "legacy";
    case C10dDialect::Validate: return "validate";
    default: return "auto";
  }
}

std::optional<C10dDialect> parse_dialect(const std::string& s) {
  if (s == "auto") return C10dDialect::Auto;
  if (s == "legacy") return C10dDialect::Legacy;
  if (s == "validate") return C10dDialect::Validate;
  return std::nullopt;
}

C10dDialect C10dStore::probe(const std::string& host, int port, std::chrono::milliseconds timeout) {
  const std::string addr = host + ":" + std::to_string(port);
  auto deadline = Clock::now() + timeout;
  std::string err;
  int fd = net::connect_retry(host, port, deadline, &err);
  if (fd < 0) fault("c10d store: cannot connect to {} within {} ms: {}", addr, timeout.count(), err);
  std::vector<uint8_t> b{kValidateQuery};
  put_u32(b, kValidateMagic);
  b.insert(b.end(), {kValidate.num_keys, kValidate.num_keys, kValidate.num_keys, 0xFF});
  // All three answers are read before closing: a server still writing to a closed
  // connection would log a broken-pipe warning.
  uint8_t reply[24];
  size_t got = 0;
  net::Io r = net::io_all(fd, b.data(), b.size(), true, deadline);
  if (r == net::Io::Ok) r = net::io_all(fd, reply, sizeof reply, false, deadline, &got);
  ::close(fd);
  if (r == net::Io::Ok) return C10dDialect::Validate;
  if (r == net::Io::Closed && got == 0) return C10dDialect::Legacy;
  if (r == net::Io::Timeout)
    fault("c10d store {}: no answer to the protocol probe within {} ms; is a PyTorch TCPStore (torchrun's agent "
          "store) listening there? (DTRAIN_TCPSTORE_PROTOCOL=legacy|validate skips the probe)",
          addr, timeout.count());
  fault("c10d store {}: unexpected answer to the protocol probe ({} bytes, then {}); not a PyTorch TCPStore this "
        "dtrain understands (DTRAIN_TCPSTORE_PROTOCOL=legacy|validate skips the probe)",
        addr, got, io_why(r));
}

C10dStore::C10dStore(std::string host, int port, std::string key_prefix, std::chrono::milliseconds timeout,
                     C10dDialect dialect)
    : TcpStore(std::move(host), port, timeout), prefix_(std::move(key_prefix)), dialect_(dialect) {
  if (dialect_ == C10dDialect::Auto) dialect_ = probe(host_, port_, timeout_);
  connect(true);
}

C10dStore::~C10dStore() { close_fd(); }

void C10dStore::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

// Opens the connection and confirms the dialect: [VALIDATE + magic,] GETNUMKEYS -> i64.
void C10dStore::connect(bool retry) {
  std::string err;
  auto deadline = StoreDeadline::cap(Clock::now() + timeout_);
  fd_ = retry ? net::connect_retry(host_, port_, deadline, &err) : net::connect_once(host_, port_, &err);
  if (fd_ < 0) {
    if (retry) fault("c10d store: cannot connect to {} within {} ms: {}", address(), timeout_.count(), err);
    fault("c10d store: cannot reconnect to {}: {}", address(), err);
  }
  std::vector<uint8_t> b;
  if (dialect_ == C10dDialect::Validate) {
    b.push_back(kValidateQuery);
    put_u32(b, kValidateMagic);
  }
  b.push_back(codes(dialect_).num_keys);
  uint8_t reply[8];
  net::Io r = net::io_all(fd_, b.data(), b.size(), true, deadline);
  if (r == net::Io::Ok) r = net::io_all(fd_, reply, sizeof reply, false, deadline);
  if (r != net::Io::Ok) {
    close_fd();
    fault("c10d store {}: the server does not answer like a PyTorch TCPStore of the {} protocol ({}: {})", address(),
          dialect_name(dialect_), dialect_ == C10dDialect::Validate ? "torch >= 2.2" : "torch <= 2.1", io_why(r));
  }
}

void C10dStore::ensure_connected() {
  if (fd_ < 0) connect(false);
}

void C10dStore::lost(const char* what, const std::string& key, const std::string& why) {
  close_fd();
  fault("c10d store {}: {} '{}' failed: {}", address(), what, key, why);
}

void C10dStore::send(const std::vector<uint8_t>& b, const char* what, const std::string& key) {
  auto r = net::io_all(fd_, const_cast<uint8_t*>(b.data()), b.size(), true,
                       request_deadline());
  if (r != net::Io::Ok) lost(what, key, io_why(r));
}

void C10dStore::recv(void* p, size_t n, Clock::time_point deadline, const char* what, const std::string& key) {
  auto r = net::io_all(fd_, p, n, false, deadline);
  if (r != net::Io::Ok) lost(what, key, io_why(r));
}

int64_t C10dStore::recv_i64(const char* what, const std::string& key) {
  uint8_t b[8];
  recv(b, 8, request_deadline(), what, key);
  return int64_t(get_u64(b));
}

std::string C10dStore::wire_key(const std::string& key) const {
  std::string k = "/" + prefix_ + key;
  if (k.size() > kC10dMaxKey)
    fault("c10d store {}: key '{}' has {} bytes; PyTorch's TCPStore accepts at most {}", address(), key, k.size(),
          kC10dMaxKey);
  return k;
}

void C10dStore::do_set(const std::string& key, const std::vector<uint8_t>& value) {
  std::lock_guard<std::mutex> g(mu_);
  if (value.size() > kC10dMaxValue)
    fault("c10d store {}: value of key '{}' has {} bytes; PyTorch's TCPStore accepts at most {}", address(), key,
          value.size(), kC10dMaxValue);
  std::string k = wire_key(key);
  ensure_connected();
  std::vector<uint8_t> b{codes(dialect_).set};
  put_str(b, k.data(), k.size());
  put_str(b, value.data(), value.size());
  send(b, "set", key);
}

std::vector<uint8_t> C10dStore::do_get(const std::string& key, std::chrono::milliseconds timeout) {
  wait({key}, timeout);
  std::lock_guard<std::mutex> g(mu_);
  std::string k = wire_key(key);
  ensure_connected();
  std::vector<uint8_t> b{codes(dialect_).get};
  put_str(b, k.data(), k.size());
  send(b, "get", key);
  auto deadline = request_deadline();
  uint8_t hdr[8];
  recv(hdr, 8, deadline, "get", key);
  uint64_t n = get_u64(hdr);
  if (n > kMaxReply) lost("get", key, fmt::format("malformed reply (value length {})", n));
  std::vector<uint8_t> v(n);
  if (n) recv(v.data(), n, deadline, "get", key);
  return v;
}

int64_t C10dStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> g(mu_);
  std::string k = wire_key(key);
  ensure_connected();
  std::vector<uint8_t> b{codes(dialect_).add};
  put_str(b, k.data(), k.size());
  put_u64(b, uint64_t(delta));
  send(b, "add", key);
  return recv_i64("add", key);
}

void C10dStore::send_keys(uint8_t code, const std::vector<std::string>& keys, const char* what) {
  std::vector<uint8_t> b{code};
  put_u64(b, keys.size());
  for (auto& key : keys) {
    std::string k = wire_key(key);
    put_str(b, k.data(), k.size());
  }
  ensure_connected();
  send(b, what, keys.empty() ? "" : keys[0]);
}

bool C10dStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> g(mu_);
  const std::string first = keys.empty() ? "" : keys[0];
  send_keys(codes(dialect_).check, keys, "check");
  uint8_t r = 0;
  recv(&r, 1, request_deadline(), "check", first);
  if (r > 1) lost("check", first, fmt::format("malformed reply {}", int(r)));
  return r == kReady;
}

void C10dStore::do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> g(mu_);
    const std::string first = keys.empty() ? "" : keys[0];
    send_keys(codes(dialect_).wait, keys, "wait for");
    uint8_t r = 0;
    auto res = net::io_all(fd_, &r, 1, false, StoreDeadline::cap(Clock::now() + timeout));
    if (res == net::Io::Ok) {
      if (r != kStopWaiting) lost("wait for", first, fmt::format("malformed reply {}", int(r)));
      return;
    }
    close_fd();  // the server forgets this connection's waits; the next call reconnects
    if (res != net::Io::Timeout)
      fault("c10d store {}: wait for key(s) {} failed: {}", address(), quoted_list(keys), io_why(res));
  }
  // Timed out: name the keys still missing (best effort: the server may be gone by now).
  std::vector<std::string> missing;
  try {
    for (auto& k : keys)
      if (!check({k})) missing.push_back(k);
  } catch (const Error&) {
    missing = keys;
  }
  if (missing.empty()) missing = keys;
  fault("c10d store {}: timed out after {} ms waiting for key(s) {}", address(), timeout.count(),
        quoted_list(missing));
}

bool C10dStore::remove(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  std::string k = wire_key(key);
  ensure_connected();
  std::vector<uint8_t> b{codes(dialect_).del};
  put_str(b, k.data(), k.size());
  send(b, "delete", key);
  return recv_i64("delete", key) == 1;
}

int64_t C10dStore::num_keys() {
  std::lock_guard<std::mutex> g(mu_);
  ensure_connected();
  send({codes(dialect_).num_keys}, "count keys", "");
  return recv_i64("count keys", "");
}

}  // namespace dtrain::comm

#include "comm/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <unordered_map>

#include "core/error.h"
#include "comm/net.h"

namespace dtrain::comm {
namespace {

enum Op : uint8_t { HELLO = 1, SET = 2, GET = 3, ADD = 4, CHECK = 5, DEL = 6 };

using Clock = std::chrono::steady_clock;

void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i)));
}
void put_i64(std::vector<uint8_t>& b, int64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(uint8_t(uint64_t(v) >> (8 * i)));
}
void put_bytes(std::vector<uint8_t>& b, const void* p, size_t n) {
  put_u32(b, uint32_t(n));
  auto* c = static_cast<const uint8_t*>(p);
  b.insert(b.end(), c, c + n);
}
void put_str(std::vector<uint8_t>& b, const std::string& s) { put_bytes(b, s.data(), s.size()); }

// Bounds-checked reader over a frame body; `ok` turns false on any overrun.
struct Reader {
  const uint8_t* p;
  size_t n, i = 0;
  bool ok = true;
  bool need(size_t k) {
    if (!ok || n - i < k) ok = false;
    return ok;
  }
  uint8_t u8() { return need(1) ? p[i++] : 0; }
  uint32_t u32() {
    if (!need(4)) return 0;
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v |= uint32_t(p[i + k]) << (8 * k);
    i += 4;
    return v;
  }
  int64_t i64() {
    if (!need(8)) return 0;
    uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v |= uint64_t(p[i + k]) << (8 * k);
    i += 8;
    return int64_t(v);
  }
  std::string str() {
    uint32_t len = u32();
    if (!need(len)) return {};
    std::string s(reinterpret_cast<const char*>(p + i), len);
    i += len;
    return s;
  }
  bool done() const { return ok && i == n; }
};

std::vector<uint8_t> frame(const std::vector<uint8_t>& body) {
  std::vector<uint8_t> f;
  f.reserve(body.size() + 4);
  put_u32(f, uint32_t(body.size()));
  f.insert(f.end(), body.begin(), body.end());
  return f;
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

}  // namespace

// ------------------------------------------------------------------------- server ----

struct StoreServer::Impl {
  struct Conn {
    int fd = -1;
    bool authed = false;
    bool closing = false;  // close once `out` is flushed
    std::vector<uint8_t> in, out;
  };
  std::string token;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  std::atomic<bool> stop{false};
  std::atomic<int64_t> rejected{0};
  std::map<std::string, std::string> kv;
  std::unordered_map<int, Conn> conns;

  void reject(Conn& c, const std::string& msg) {
    std::vector<uint8_t> r{1};
    put_str(r, msg);
    auto f = frame(r);
    c.out.insert(c.out.end(), f.begin(), f.end());
    c.closing = true;
    ++rejected;
  }

  // Handles one request; returns false when the connection must be dropped at once.
  bool handle(Conn& c, const uint8_t* body, size_t n) {
    Reader r{body, n};
    uint8_t op = r.u8();
    std::vector<uint8_t> rep{0};
    if (!c.authed) {
      if (op != HELLO) return false;
      std::string tok = r.str();
      if (!r.done()) return false;
      if (tok != token) {
        reject(c, "job token rejected by the store (another job's store on this port?)");
        return true;
      }
      c.authed = true;
    } else if (op == SET) {
      std::string k = r.str(), v = r.str();
      if (!r.done()) return false;
      kv[k] = std::move(v);
    } else if (op == GET) {
      std::string k = r.str();
      if (!r.done()) return false;
      auto it = kv.find(k);
      rep.push_back(it != kv.end());
      if (it != kv.end()) put_str(rep, it->second);
    } else if (op == ADD) {
      std::string k = r.str();
      int64_t d = r.i64();
      if (!r.done()) return false;
      int64_t v = 0;
      auto it = kv.find(k);
      if (it != kv.end()) {
        try {
          v = std::stoll(it->second);
        } catch (const std::exception&) {
          v = 0;  // not an integer: treated as 0 and overwritten
        }
      }
      v += d;
      kv[k] = std::to_string(v);
      put_i64(rep, v);
    } else if (op == CHECK) {
      uint32_t cnt = r.u32();
      bool all = true;
      for (uint32_t i = 0; i < cnt && r.ok; ++i) all = kv.count(r.str()) && all;
      if (!r.done()) return false;
      rep.push_back(all);
    } else if (op == DEL) {
      std::string k = r.str();
      if (!r.done()) return false;
      rep.push_back(kv.erase(k) > 0);
    } else {
      return false;
    }
    auto f = frame(rep);
    c.out.insert(c.out.end(), f.begin(), f.end());
    return true;
  }

  // Parses every complete frame in c.in; false = drop the connection.
  bool parse(Conn& c) {
    size_t pos = 0;
    while (!c.closing && c.in.size() - pos >= 4) {
      uint32_t len = 0;
      for (int k = 0; k < 4; ++k) len |= uint32_t(c.in[pos + k]) << (8 * k);
      if (len == 0 || len > kMaxFrame) return false;
      if (c.in.size() - pos - 4 < len) break;
      if (!handle(c, c.in.data() + pos + 4, len)) return false;
      pos += 4 + size_t(len);
    }
    c.in.erase(c.in.begin(), c.in.begin() + std::ptrdiff_t(pos));
    return true;
  }

  void drop(int fd) {
    ::close(fd);
    conns.erase(fd);
  }

  void loop() {
    std::vector<pollfd> pfds;
    std::vector<uint8_t> buf(1 << 16);
    while (!stop) {
      pfds.clear();
      pfds.push_back({wake[0], POLLIN, 0});
      pfds.push_back({listen_fd, POLLIN, 0});
      for (auto& [fd, c] : conns)
        pfds.push_back({fd, short((c.closing ? 0 : POLLIN) | (c.out.empty() ? 0 : POLLOUT)), 0});
      if (::poll(pfds.data(), pfds.size(), 1000) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (pfds[0].revents) return;
      if (pfds[1].revents & POLLIN) {
        int fd = ::accept(listen_fd, nullptr, nullptr);
        if (fd >= 0) {
          set_nonblocking(fd);
          int one = 1;
          setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          Conn c;
          c.fd = fd;
          conns.emplace(fd, std::move(c));
        }
      }
      for (size_t i = 2; i < pfds.size(); ++i) {
        int fd = pfds[i].fd;
        auto it = conns.find(fd);
        if (it == conns.end()) continue;
        Conn& c = it->second;
        short ev = pfds[i].revents;
        bool keep = true;
        if (ev & POLLIN) {
          ssize_t k = ::recv(fd, buf.data(), buf.size(), 0);
          if (k <= 0) {
            keep = !(k == 0 || (errno != EAGAIN && errno != EINTR));
          } else {
            c.in.insert(c.in.end(), buf.data(), buf.data() + k);
            if (!parse(c)) {
              ++rejected;
              keep = false;
            }
          }
        } else if (ev & (POLLERR | POLLHUP | POLLNVAL)) {
          keep = false;
        }
        if (keep && !c.out.empty()) {
          ssize_t k = ::send(fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
          if (k > 0) c.out.erase(c.out.begin(), c.out.begin() + k);
          else if (k < 0 && errno != EAGAIN && errno != EINTR) keep = false;
        }
        if (keep && c.closing && c.out.empty()) keep = false;
        if (!keep) drop(fd);
      }
    }
  }
};

StoreServer::StoreServer(const std::string& host, int port, std::string job_token)
    : impl_(std::make_unique<Impl>()) {
  impl_->token = std::move(job_token);
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  const char* h = (host.empty() || host == "0.0.0.0") ? nullptr : host.c_str();
  if (int e = getaddrinfo(h, std::to_string(port).c_str(), &hints, &res))
    fault("store: cannot resolve {}:{}: {}", host, port, gai_strerror(e));
  int fd = -1;
  std::string err = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 256) == 0) break;
    err = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) fault("store: cannot listen on {}:{}: {}", host, port, err);
  sockaddr_storage ss{};
  socklen_t sl = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl);
  port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                   : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  set_nonblocking(fd);
  impl_->listen_fd = fd;
  if (::pipe(impl_->wake) != 0) {
    ::close(fd);
    fault("store: pipe: {}", std::strerror(errno));
  }
  thread_ = std::thread([this] { impl_->loop(); });
}

StoreServer::~StoreServer() {
  impl_->stop = true;
  char c = 1;
  (void)!::write(impl_->wake[1], &c, 1);
  if (thread_.joinable()) thread_.join();
  for (auto& [fd, c] : impl_->conns) ::close(fd);
  ::close(impl_->listen_fd);
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

int64_t StoreServer::rejected_connections() const { return impl_->rejected; }

// ------------------------------------------------------------------------- client ----

namespace {

bool io_all(int fd, void* p, size_t n, bool sending, Clock::time_point deadline) {
  return net::io_all(fd, p, n, sending, deadline) == net::Io::Ok;
}

}  // namespace

StoreClient::StoreClient(std::string host, int port, std::string job_token,
                         std::chrono::milliseconds timeout)
    : host_(std::move(host)), port_(port), token_(std::move(job_token)), timeout_(timeout) {
  connect_and_hello();
}

StoreClient::~StoreClient() { close_fd(); }

void StoreClient::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void StoreClient::connect_and_hello() {
  std::string err;
  fd_ = net::connect_retry(host_, port_, Clock::now() + timeout_, &err);
  if (fd_ < 0) fault("store: cannot connect to {} within {} ms: {}", address(), timeout_.count(), err);
  std::vector<uint8_t> b{HELLO};
  put_str(b, token_);
  request(b, "hello", "");
}

std::vector<uint8_t> StoreClient::request(const std::vector<uint8_t>& body, const char* what,
                                          const std::string& key) {
  if (fd_ < 0) fault("store {}: connection closed", address());
  auto deadline = Clock::now() + std::max(timeout_, std::chrono::milliseconds(1000));
  auto f = frame(body);
  uint8_t hdr[4];
  bool ok = io_all(fd_, f.data(), f.size(), true, deadline) && io_all(fd_, hdr, 4, false, deadline);
  uint32_t len = 0;
  for (int k = 0; ok && k < 4; ++k) len |= uint32_t(hdr[k]) << (8 * k);
  std::vector<uint8_t> rep;
  if (ok && (len == 0 || len > kMaxFrame)) ok = false;
  if (ok) {
    rep.resize(len);
    ok = io_all(fd_, rep.data(), len, false, deadline);
  }
  if (!ok) {
    close_fd();
    fault("store {}: {} '{}' failed: connection lost or no reply", address(), what, key);
  }
  if (rep[0] != 0) {
    Reader r{rep.data() + 1, rep.size() - 1};
    std::string msg = r.str();
    close_fd();
    fault("store {}: {}", address(), msg);
  }
  rep.erase(rep.begin());
  return rep;
}

void StoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<uint8_t> b{SET};
  put_str(b, key);
  put_bytes(b, value.data(), value.size());
  request(b, "set", key);
}

std::vector<uint8_t> StoreClient::get(const std::string& key, std::chrono::milliseconds timeout) {
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

void StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
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

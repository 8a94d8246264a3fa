// dtrain's store server: one thread multiplexes the listening socket and every connection
// with poll(). Its port is reachable by anyone on the network, so what a peer may cost the
// server is bounded before the peer has shown the job token (see StoreLimits in store.h):
// a few KiB of buffer, a few seconds, and a place in a bounded set that newer peers evict.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <unordered_map>

#include "comm/store.h"
#include "comm/store_wire.h"
#include "core/error.h"
#include "core/net_guard.h"

namespace dtrain::comm {

using namespace wire;
using Clock = std::chrono::steady_clock;

namespace {

enum Cause : size_t { BadToken, Malformed, Oversized, HandshakeTimeout, FrameTimeout, Evicted, OverLimit, OutOfFds, kCauses };

// Stop reading a connection while this many reply bytes wait for it (a client that sends
// requests without reading the replies).
constexpr size_t kOutHighWater = 1u << 20;
// Connections accepted per loop turn, so a flood of connects cannot starve the clients.
constexpr int kAcceptBatch = 64;

}  // namespace

struct StoreServer::Impl {
  struct Conn {
    int fd = -1;
    uint64_t serial = 0;
    bool authed = false;
    bool closing = false;  // close once `out` is flushed
    std::vector<uint8_t> in, out;
    Clock::time_point accepted, frame_start, out_since;
  };
  std::string token;
  StoreLimits lim;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  std::atomic<bool> stop{false};
  std::map<std::string, std::string> kv;
  std::unordered_map<int, Conn> conns;
  // Unauthenticated connections in accept order (fd, serial); entries of connections that
  // have since authenticated or closed are skipped when met.
  std::deque<std::pair<int, uint64_t>> unauth_order;
  size_t n_unauth = 0;
  uint64_t next_serial = 1;
  net_guard::Acceptor acceptor;
  net_guard::ThrottledLog rlog{"store",
                               {"closed a connection: another job's token", "closed a connection: malformed request",
                                "closed a connection: frame over the size limit", "closed a connection: no hello in time",
                                "closed a connection: frame or reply stalled", "evicted a connection before its hello",
                                "refused a connection: too many connections",
                                "refused a connection: out of file descriptors"}};
  std::atomic<int64_t> n_open{0}, n_authed{0}, n_buffered{0};
  std::array<std::atomic<int64_t>, kCauses> counts{};

  void note(Cause c, int fd, const std::string& why) {
    ++counts[c];
    rlog.note(c, net_guard::peer_of(fd) + ": " + why);
  }

  uint32_t frame_limit(const Conn& c) const { return c.authed ? kMaxFrame : kMaxHelloFrame; }

  void reply(Conn& c, const std::vector<uint8_t>& f) {
    if (c.out.empty()) c.out_since = Clock::now();
    c.out.insert(c.out.end(), f.begin(), f.end());
  }

  // Handles one request; false = drop the connection at once (malformed).
  bool handle(Conn& c, const uint8_t* body, size_t n) {
    Reader r{body, n};
    uint8_t op = r.u8();
    std::vector<uint8_t> rep{0};
    if (!c.authed) {
      if (op != HELLO) return false;
      std::string tok = r.str();
      if (!r.done()) return false;
      if (tok != token) {
        reply(c, error_frame("job token rejected by the store (another job's store on this port?)"));
        c.closing = true;
        note(BadToken, c.fd, "HELLO with another token");
        return true;
      }
      c.authed = true;
      --n_unauth;
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
    reply(c, frame(rep));
    return true;
  }

  // Parses every complete frame in c.in; false = drop the connection (cause noted).
  bool parse(Conn& c, Clock::time_point now) {
    size_t pos = 0;
    bool consumed = false;
    while (!c.closing && c.in.size() - pos >= 4) {
      uint32_t len = get_u32(c.in.data() + pos);
      if (len > frame_limit(c)) {
        note(Oversized, c.fd,
             fmt::format("frame of {} bytes (limit {} {} the hello)", len, frame_limit(c), c.authed ? "after" : "before"));
        return false;
      }
      if (len == 0) {
        note(Malformed, c.fd, "empty frame");
        return false;
      }
      if (c.in.size() - pos - 4 < len) break;
      if (!handle(c, c.in.data() + pos + 4, len)) {
        note(Malformed, c.fd, c.authed ? "malformed request" : "first request is not a well-formed HELLO");
        return false;
      }
      pos += 4 + size_t(len);
      consumed = true;
    }
    c.in.erase(c.in.begin(), c.in.begin() + std::ptrdiff_t(pos));
    if (c.in.empty() && c.in.capacity() > (1u << 20)) c.in.shrink_to_fit();  // after a large set
    if (consumed && !c.in.empty()) c.frame_start = now;  // a pipelined request has begun
    return true;
  }

  void drop(int fd) {
    auto it = conns.find(fd);
    if (it != conns.end() && !it->second.authed) --n_unauth;
    ::close(fd);
    conns.erase(fd);
  }

  Clock::time_point deadline(const Conn& c) const {
    if (!c.authed) return c.accepted + lim.handshake_timeout;
    auto d = Clock::time_point::max();
    if (!c.in.empty()) d = c.frame_start + lim.frame_timeout;
    if (!c.out.empty()) d = std::min(d, c.out_since + lim.frame_timeout);
    return d;
  }

  // Reads what the socket holds; false = drop (peer closed, error, or a rejected frame).
  bool read(Conn& c, std::vector<uint8_t>& buf, Clock::time_point now) {
    // Before the hello, never hold more than one hello frame.
    size_t want = c.authed ? buf.size() : std::max<size_t>(1, 4 + kMaxHelloFrame - c.in.size());
    ssize_t k = ::recv(c.fd, buf.data(), std::min(want, buf.size()), 0);
    if (k == 0) return false;
    if (k < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    if (c.in.empty()) c.frame_start = now;
    c.in.insert(c.in.end(), buf.data(), buf.data() + k);
    return parse(c, now);
  }

  // Refuses a connection at accept with a reply the client shows, then closes it.
  static void refuse(int fd, const std::string& msg) {
    auto f = error_frame(msg);
    (void)!::send(fd, f.data(), f.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }

  bool stale(const std::pair<int, uint64_t>& e) const {
    auto it = conns.find(e.first);
    return it == conns.end() || it->second.serial != e.second || it->second.authed;
  }

  // Forgets the entries of connections that have authenticated or closed since: the
  // queue stays as long as the connections accepted within one handshake deadline.
  void trim_unauth_order() {
    while (!unauth_order.empty() && stale(unauth_order.front())) unauth_order.pop_front();
  }

  // Drops the oldest unauthenticated connection that has waited at least evict_grace;
  // false when there is none (every one is younger).
  bool evict_oldest(Clock::time_point now) {
    trim_unauth_order();
    if (!unauth_order.empty()) {
      int fd = unauth_order.front().first;
      if (now - conns[fd].accepted < lim.evict_grace) return false;
      unauth_order.pop_front();
      note(Evicted, fd, fmt::format("no hello yet, and {} unauthenticated connections is the limit", lim.max_unauthenticated));
      drop(fd);
      return true;
    }
    return false;
  }

  // When accepting pauses: out of descriptors with no spare (until fd_pause), and every
  // unauthenticated connection too young to evict (until evict_wait, or one authenticates).
  Clock::time_point fd_pause{}, evict_wait{};
  bool may_accept(Clock::time_point now) const {
    return now >= fd_pause && (n_unauth < lim.max_unauthenticated || now >= evict_wait);
  }

  // Accepts up to kAcceptBatch connections.
  void accept_some(Clock::time_point now, std::vector<uint8_t>& buf) {
    for (int i = 0; i < kAcceptBatch; ++i) {
      if (n_unauth >= lim.max_unauthenticated && !evict_oldest(now)) {
        // Every unauthenticated connection is young: leave the newcomers in the backlog
        // until the oldest may be evicted (evict_oldest trimmed the queue's front).
        if (!unauth_order.empty()) evict_wait = conns[unauth_order.front().first].accepted + lim.evict_grace;
        return;
      }
      int fd = -1;
      auto r = acceptor.accept(listen_fd, &fd, [&](int s) {
        note(OutOfFds, s, "accept failed with EMFILE/ENFILE");
        refuse(s, fmt::format("the store's host is out of file descriptors (RLIMIT_NOFILE {}); raise `ulimit -n` "
                              "where the store runs",
                              nofile_limit()));
      });
      if (r == net_guard::Acceptor::Result::Empty) return;
      if (r == net_guard::Acceptor::Result::Shed) continue;
      if (r == net_guard::Acceptor::Result::Exhausted) {
        fd_pause = now + std::chrono::milliseconds(100);
        return;
      }
      if (conns.size() >= lim.max_connections) {
        note(OverLimit, fd, fmt::format("{} connections are open, the limit", conns.size()));
        refuse(fd, fmt::format("too many connections to the store ({} open, the limit)", conns.size()));
        ::close(fd);
        continue;
      }
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      Conn c;
      c.fd = fd;
      c.serial = next_serial++;
      c.accepted = now;
      unauth_order.emplace_back(fd, c.serial);
      ++n_unauth;
      // A client sends its hello right after connecting: read it now, so that it leaves
      // the unauthenticated set before the next newcomer may evict it.
      Conn& added = conns.emplace(fd, std::move(c)).first->second;
      if (!read(added, buf, now)) drop(fd);
    }
  }

  static uint64_t nofile_limit() {
    rlimit rl{};
    return getrlimit(RLIMIT_NOFILE, &rl) == 0 ? uint64_t(rl.rlim_cur) : 0;
  }

  void publish() {
    int64_t authed = 0, buffered = 0;
    for (auto& [fd, c] : conns) {
      authed += c.authed;
      buffered += int64_t(c.in.size() + c.out.size());
    }
    n_open = int64_t(conns.size());
    n_authed = authed;
    n_buffered = buffered;
  }

  void loop() {
    std::vector<pollfd> pfds;
    std::vector<uint8_t> buf(1 << 16);
    while (!stop) {
      auto now = Clock::now();
      auto next = now + std::chrono::seconds(1);
      const bool listening = may_accept(now);
      pfds.clear();
      pfds.push_back({wake[0], POLLIN, 0});
      pfds.push_back({listening ? listen_fd : -1, POLLIN, 0});  // poll ignores fd -1
      if (!listening)
        next = std::min(next, n_unauth >= lim.max_unauthenticated ? std::max(fd_pause, evict_wait) : fd_pause);
      for (auto& [fd, c] : conns) {
        short ev = short((c.closing || c.out.size() >= kOutHighWater ? 0 : POLLIN) | (c.out.empty() ? 0 : POLLOUT));
        pfds.push_back({fd, ev, 0});
        next = std::min(next, deadline(c));
      }
      publish();
      auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
      if (::poll(pfds.data(), pfds.size(), int(std::clamp<int64_t>(wait_ms, 0, 1000))) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (pfds[0].revents) return;
      now = Clock::now();
      for (size_t i = 2; i < pfds.size(); ++i) {
        int fd = pfds[i].fd;
        short ev = pfds[i].revents;
        if (!ev) continue;
        auto it = conns.find(fd);
        if (it == conns.end()) continue;
        Conn& c = it->second;
        bool keep = true;
        if (ev & POLLIN) keep = read(c, buf, now);
        else if (ev & (POLLERR | POLLHUP | POLLNVAL)) keep = false;
        if (keep && !c.out.empty()) {
          ssize_t k = ::send(fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
          if (k > 0) {
            c.out.erase(c.out.begin(), c.out.begin() + k);
            c.out_since = now;
            if (c.out.empty() && c.out.capacity() > (1u << 20)) c.out.shrink_to_fit();
          } else if (k < 0 && errno != EAGAIN && errno != EINTR) {
            keep = false;
          }
        }
        if (keep && c.closing && c.out.empty()) keep = false;
        if (!keep) drop(fd);
      }
      // Deadlines: no hello in time (idle or trickling), or a stalled frame or reply.
      std::vector<int> late;
      for (auto& [fd, c] : conns)
        if (now >= deadline(c)) late.push_back(fd);
      for (int fd : late) {
        Conn& c = conns[fd];
        if (!c.authed)
          note(HandshakeTimeout, fd, fmt::format("no hello within {} ms ({} bytes received)", lim.handshake_timeout.count(), c.in.size()));
        else
          note(FrameTimeout, fd, fmt::format("a {} stalled for {} ms", c.in.empty() ? "reply" : "request",
                                             lim.frame_timeout.count()));
        drop(fd);
      }
      if (listening && (pfds[1].revents & POLLIN)) accept_some(now, buf);
      trim_unauth_order();
      rlog.tick(now);
    }
  }
};

StoreServer::StoreServer(const std::string& host, int port, std::string job_token, StoreLimits limits)
    : impl_(std::make_unique<Impl>()) {
  impl_->token = std::move(job_token);
  impl_->lim = limits;
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
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) break;
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
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  impl_->listen_fd = fd;
  if (::pipe2(impl_->wake, O_CLOEXEC) != 0) {
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

StoreServerStats StoreServer::stats() const {
  StoreServerStats s;
  s.open = impl_->n_open;
  s.authenticated = impl_->n_authed;
  s.buffered_bytes = impl_->n_buffered;
  auto& n = impl_->counts;
  s.bad_token = n[BadToken];
  s.malformed = n[Malformed];
  s.oversized = n[Oversized];
  s.handshake_timeout = n[HandshakeTimeout];
  s.frame_timeout = n[FrameTimeout];
  s.evicted = n[Evicted];
  s.over_limit = n[OverLimit];
  s.out_of_fds = n[OutOfFds];
  return s;
}

}  // namespace dtrain::comm

#include "obs/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "core/net_guard.h"
#include "obs/metrics.h"
#include "obs/prometheus.h"

namespace dtrain {

namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

const char* reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Unknown";
  }
}

std::string render_response(const HttpResponse& r, bool head_only) {
  std::string out = fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n", r.status,
                                reason(r.status), r.content_type, r.body.size());
  if (r.status == 405) out += "Allow: GET, HEAD\r\n";
  out += "Connection: close\r\n\r\n";
  if (!head_only) out += r.body;
  return out;
}

HttpResponse plain(int status, const std::string& msg) { return {status, "text/plain; charset=utf-8", msg + "\n"}; }

bool is_token_char(char c) { return c >= 'A' && c <= 'Z'; }

enum class State { Reading, Writing, Draining };

struct Conn {
  int fd = -1;
  State state = State::Reading;
  std::string in, out;
  size_t off = 0;
  int64_t deadline = 0;
  int64_t accepted = 0;
};

enum Cause : size_t { HandlerError, Evicted, OverLimit, OutOfFds };

}  // namespace

bool parse_request_line(const std::string& head, HttpRequestLine& out) {
  size_t eol = head.find('\n');
  std::string line = head.substr(0, eol);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  size_t a = line.find(' ');
  if (a == std::string::npos || a == 0) return false;
  size_t b = line.find(' ', a + 1);
  if (b == std::string::npos || b == a + 1 || line.find(' ', b + 1) != std::string::npos) return false;
  out.method = line.substr(0, a);
  out.path = line.substr(a + 1, b - a - 1);
  out.version = line.substr(b + 1);
  if (!std::all_of(out.method.begin(), out.method.end(), is_token_char)) return false;
  if (out.path[0] != '/') return false;
  for (char c : out.path)
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) return false;
  return out.version == "HTTP/1.1" || out.version == "HTTP/1.0";
}

HttpServer::HttpServer(const std::string& bind, int port, HttpHandler handler)
    : bind_(bind), handler_(std::move(handler)) {
  if (port < 0 || port > 65535)
    user_error("observability.prometheus_port: {} is out of range (expected 1..65535)", port);
  if (bind.empty())
    user_error("observability.bind: empty address (expected an IP address such as 127.0.0.1 or 0.0.0.0)");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_s = std::to_string(port);
  int gai = getaddrinfo(bind.c_str(), port_s.c_str(), &hints, &res);
  if (gai != 0 || !res)
    user_error("observability.bind: \"{}\" is not a usable address ({}); expected an IP address such as 127.0.0.1 or 0.0.0.0",
               bind, gai_strerror(gai));
  int fd = socket(res->ai_family, res->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, res->ai_protocol);
  if (fd < 0) {
    int e = errno;
    freeaddrinfo(res);
    fault("cannot create a socket for the metrics server: {}", std::strerror(e));
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // TIME_WAIT only; a live listener still conflicts
  int rc = ::bind(fd, res->ai_addr, res->ai_addrlen);
  int e = errno;
  freeaddrinfo(res);
  if (rc != 0) {
    ::close(fd);
    if (e == EADDRINUSE) user_error("observability.prometheus_port: port {} on {} is already in use", port, bind);
    if (e == EADDRNOTAVAIL)
      user_error("observability.bind: \"{}\" is not an address of this machine (use 127.0.0.1 or 0.0.0.0)", bind);
    if (e == EACCES)
      user_error("observability.prometheus_port: port {} on {} needs privileges (use a port of 1024 or above)", port,
                 bind);
    fault("cannot bind the metrics server to {}:{}: {}", bind, port, std::strerror(e));
  }
  if (::listen(fd, SOMAXCONN) != 0) {  // the loop decides whom to refuse, not the backlog
    e = errno;
    ::close(fd);
    if (e == EADDRINUSE) user_error("observability.prometheus_port: port {} on {} is already in use", port, bind);
    fault("cannot listen on {}:{}: {}", bind, port, std::strerror(e));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                   : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    e = errno;
    ::close(fd);
    fault("cannot create the metrics server's wake pipe: {}", std::strerror(e));
  }
  listen_fd_ = fd;
  thread_ = std::thread([this] { loop(); });
}

HttpServer::~HttpServer() {
  if (thread_.joinable()) {
    char b = 1;
    (void)!::write(wake_[1], &b, 1);
    thread_.join();
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  for (int f : wake_)
    if (f >= 0) ::close(f);
}

void HttpServer::loop() {
  std::vector<Conn> conns;
  std::vector<pollfd> pfds;
  net_guard::ThrottledLog tlog{"metrics server",
                               {"a request failed (HTTP 500)", "evicted an idle connection",
                                "refused a connection: too many connections",
                                "refused a connection: out of file descriptors"}};
  int64_t fd_pause = 0;  // out of descriptors with no spare: accept again after this
  auto respond = [&](Conn& c, const HttpResponse& r, bool head_only) {
    c.out = render_response(r, head_only);
    c.off = 0;
    c.state = State::Writing;
    c.deadline = now_ms() + kConnTimeoutMs;
  };
  auto try_request = [&](Conn& c) {
    size_t eol = c.in.find('\n');
    if (eol == std::string::npos) {
      if (c.in.size() > kMaxHeaderBytes) respond(c, plain(400, "bad request: no request line"), false);
      return;
    }
    HttpRequestLine rl;
    if (!parse_request_line(c.in, rl)) return respond(c, plain(400, "bad request"), false);
    size_t end = c.in.find("\r\n\r\n");
    if (end == std::string::npos) end = c.in.find("\n\n");
    if (end == std::string::npos ? c.in.size() > kMaxHeaderBytes : end > kMaxHeaderBytes)
      return respond(c, plain(431, "request header too large"), false);
    if (end == std::string::npos) return;
    bool head = rl.method == "HEAD";
    if (rl.method != "GET" && !head) return respond(c, plain(405, "method not allowed"), false);
    std::string path = rl.path.substr(0, rl.path.find('?'));
    HttpResponse r;
    try {
      r = handler_(path);
    } catch (const std::exception& ex) {
      // Never the exception's text to the peer: it may name files, hosts or internals.
      r = plain(500, "internal server error");
      handler_errors_++;
      tlog.note(HandlerError, fmt::format("GET {} from {}: {}", path, net_guard::peer_of(c.fd), ex.what()));
    } catch (...) {
      r = plain(500, "internal server error");
      handler_errors_++;
      tlog.note(HandlerError, fmt::format("GET {} from {}: unknown exception", path, net_guard::peer_of(c.fd)));
    }
    served_++;
    respond(c, r, head);
  };

  for (;;) {
    pfds.clear();
    pfds.push_back({wake_[0], POLLIN, 0});
    int64_t now = now_ms();
    int64_t next = now + 1000;
    const bool listening = now >= fd_pause;
    pfds.push_back({listening ? listen_fd_ : -1, POLLIN, 0});  // poll ignores fd -1
    if (!listening) next = std::min(next, fd_pause);
    for (auto& c : conns) {
      short ev = c.state == State::Writing ? POLLOUT : POLLIN;
      pfds.push_back({c.fd, ev, 0});
      next = std::min(next, c.deadline);
    }
    int rc = ::poll(pfds.data(), pfds.size(), int(std::max<int64_t>(0, next - now)));
    if (rc < 0 && errno != EINTR) {
      log::error("metrics server: poll failed: {}; the endpoint stops", std::strerror(errno));
      break;
    }
    if (pfds[0].revents) break;
    // pfds[2 + i] belongs to conns[i]; connections are accepted after this loop.
    now = now_ms();
    for (size_t i = 0; i < conns.size(); i++) {
      Conn& c = conns[i];
      short re = pfds[2 + i].revents;
      bool done = false;
      if (c.state == State::Reading && (re & (POLLIN | POLLHUP | POLLERR))) {
        char buf[4096];
        bool eof = false;
        for (;;) {
          ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
          if (n > 0) {
            c.in.append(buf, size_t(n));
            if (c.in.size() > 2 * kMaxHeaderBytes) break;
            continue;
          }
          if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) eof = true;
          break;
        }
        try_request(c);  // a client may send its request and half-close at once
        if (eof && c.state == State::Reading) done = true;
      } else if (c.state == State::Writing && (re & (POLLOUT | POLLHUP | POLLERR))) {
        while (c.off < c.out.size()) {
          ssize_t n = ::send(c.fd, c.out.data() + c.off, c.out.size() - c.off, MSG_NOSIGNAL);
          if (n > 0) {
            c.off += size_t(n);
            continue;
          }
          if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
          done = true;
          break;
        }
        if (!done && c.off == c.out.size()) {
          // Half-close and read what the client still sends, so closing does not turn
          // into a reset that could destroy the response before the client reads it.
          ::shutdown(c.fd, SHUT_WR);
          c.state = State::Draining;
          c.deadline = now + 1000;
        }
      } else if (c.state == State::Draining && (re & (POLLIN | POLLHUP | POLLERR))) {
        char buf[4096];
        for (;;) {
          ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
          if (n > 0) continue;
          if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) done = true;
          break;
        }
      }
      if (!done && now >= c.deadline) {
        if (c.state == State::Reading && !c.in.empty()) {
          respond(c, plain(408, "request timeout"), false);  // one more chance to say why
          c.deadline = now + 200;
        } else {
          done = true;
        }
      }
      if (done) {
        ::close(c.fd);
        c.fd = -1;
      }
    }
    conns.erase(std::remove_if(conns.begin(), conns.end(), [](const Conn& c) { return c.fd < 0; }), conns.end());
    if (listening && (pfds[1].revents & POLLIN)) {
      for (int batch = 0; batch < 256; batch++) {
        int cfd = -1;
        auto r = acceptor_.accept(listen_fd_, &cfd, [&](int s) {
          refused_++;
          tlog.note(OutOfFds, fmt::format("from {}: accept failed with EMFILE/ENFILE", net_guard::peer_of(s)));
          std::string resp = render_response(plain(503, "server out of file descriptors"), false);
          (void)!::send(s, resp.data(), resp.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        });
        if (r == net_guard::Acceptor::Result::Empty) break;
        if (r == net_guard::Acceptor::Result::Shed) continue;
        if (r == net_guard::Acceptor::Result::Exhausted) {
          fd_pause = now_ms() + 100;
          break;
        }
        int64_t t = now_ms();
        if (conns.size() >= kMaxConnections) {
          // Make way by closing the oldest connection still reading (accepted conns
          // are in accept order), unless every one is younger than the grace.
          auto old = std::find_if(conns.begin(), conns.end(), [&](const Conn& o) {
            return o.fd >= 0 && o.state == State::Reading && t - o.accepted >= kEvictGraceMs;
          });
          if (old == conns.end()) {
            refused_++;
            tlog.note(OverLimit, fmt::format("from {}: {} connections open", net_guard::peer_of(cfd), conns.size()));
            ::close(cfd);
            continue;
          }
          evicted_++;
          tlog.note(Evicted, fmt::format("from {}: idle or unfinished for {} ms, {} connections open",
                                         net_guard::peer_of(old->fd), t - old->accepted, conns.size()));
          ::close(old->fd);
          conns.erase(old);
        }
        Conn c;
        c.fd = cfd;
        c.accepted = t;
        c.deadline = t + kConnTimeoutMs;
        conns.push_back(std::move(c));
      }
    }
    tlog.tick();
  }
  for (auto& c : conns) ::close(c.fd);
}

HttpHandler metrics_handler(const MetricRegistry& reg) {
  return [&reg](const std::string& path) -> HttpResponse {
    if (path != "/metrics") return plain(404, "not found: dtrain serves /metrics only");
    auto snap = reg.snapshot();
    return {200, kPrometheusContentType, render_prometheus(*snap)};
  };
}

}  // namespace dtrain

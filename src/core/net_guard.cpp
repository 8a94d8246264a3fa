#include "core/net_guard.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "core/log.h"

namespace dtrain::net_guard {

ThrottledLog::ThrottledLog(std::string who, std::vector<std::string> causes, std::chrono::milliseconds period)
    : who_(std::move(who)), period_(period) {
  for (auto& n : causes) {
    causes_.emplace_back();
    causes_.back().name = std::move(n);
  }
}

ThrottledLog::~ThrottledLog() {
  for (auto& c : causes_)
    if (c.pending) summarise(c);
}

void ThrottledLog::summarise(Cause& c) {
  log::warn("{}: {}: {} more since the last report; the latest: {}", who_, c.name, c.pending, c.last_detail);
  c.pending = 0;
}

void ThrottledLog::note(size_t cause, const std::string& detail, Clock::time_point now) {
  Cause& c = causes_[cause];
  ++c.total;
  c.last_detail = detail;
  if (!c.logged) {
    log::warn("{}: {}: {} (repeats: at most one line per {:g} s)", who_, c.name, detail,
              double(period_.count()) / 1000.0);
    c.logged = true;
    c.last_line = now;
    return;
  }
  ++c.pending;
  if (now - c.last_line >= period_) {
    summarise(c);
    c.last_line = now;
  }
}

void ThrottledLog::tick(Clock::time_point now) {
  for (auto& c : causes_)
    if (c.pending && now - c.last_line >= period_) {
      summarise(c);
      c.last_line = now;
    }
}

namespace {
int open_spare() { return ::open("/dev/null", O_RDONLY | O_CLOEXEC); }
}  // namespace

Acceptor::Acceptor() : spare_(open_spare()) {}

Acceptor::~Acceptor() {
  if (spare_ >= 0) ::close(spare_);
}

Acceptor::Result Acceptor::accept_raw(int listen_fd, int* fd, int* shed_fd) {
  for (;;) {
    int s = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (s >= 0) {
      if (spare_ < 0) spare_ = open_spare();  // taken back once descriptors are free again
      *fd = s;
      return Result::Accepted;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EMFILE && errno != ENFILE) return Result::Empty;  // EAGAIN, or an error poll will show again
    if (spare_ < 0) return Result::Exhausted;
    ::close(spare_);
    spare_ = -1;
    s = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (s < 0) {
      spare_ = open_spare();
      return spare_ < 0 ? Result::Exhausted : Result::Empty;
    }
    *shed_fd = s;
    return Result::Shed;
  }
}

void Acceptor::release_shed(int fd) {
  ::close(fd);
  spare_ = open_spare();
}

std::string peer_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
    return fmt::format("{}:{}", host, port);
  }
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
    return fmt::format("[{}]:{}", host, port);
  }
  return "?";
}

}  // namespace dtrain::net_guard

#include "comm/net.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <thread>

namespace dtrain::comm::net {

int connect_once(const std::string& host, int port, std::string* err) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (int e = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res)) {
    *err = gai_strerror(e);
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    *err = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd >= 0) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}

int connect_retry(const std::string& host, int port, Clock::time_point deadline, std::string* err) {
  auto backoff = std::chrono::milliseconds(10);
  *err = "timed out";
  while (true) {
    int fd = connect_once(host, port, err);
    if (fd >= 0) return fd;
    if (Clock::now() + backoff > deadline) return -1;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

Io io_all(int fd, void* p, size_t n, bool sending, Clock::time_point deadline, size_t* done) {
  auto* c = static_cast<uint8_t*>(p);
  size_t got = 0;
  auto finish = [&](Io r) {
    if (done) *done = got;
    return r;
  };
  while (got < n) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return finish(Io::Timeout);
    pollfd pf{fd, short(sending ? POLLOUT : POLLIN), 0};
    int pr = ::poll(&pf, 1, int(std::min<int64_t>(left.count(), 1000)));
    if (pr < 0 && errno != EINTR) return finish(Io::Error);
    if (pr <= 0) continue;
    ssize_t k = sending ? ::send(fd, c + got, n - got, MSG_NOSIGNAL) : ::recv(fd, c + got, n - got, 0);
    if (k == 0) return finish(Io::Closed);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return finish(errno == ECONNRESET || errno == EPIPE ? Io::Closed : Io::Error);
    }
    got += size_t(k);
  }
  return finish(Io::Ok);
}

}  // namespace dtrain::comm::net

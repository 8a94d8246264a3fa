#pragma once
// Hostile peers for dtrain's servers that face the network (the rendezvous store and the
// /metrics endpoint), shared by tests/comm/test_net_limits.cpp and tests/comm/test_net_fuzz.cpp:
// raw loopback connections, /proc readers for a process's memory, RLIMIT_NOFILE.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace netfuzz {

using Clock = std::chrono::steady_clock;

inline int64_t ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// A non-blocking socket connecting to 127.0.0.1:port (the connect may still be in
// progress); -1 when no socket could be made.
inline int connect_nb(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(uint16_t(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 && errno != EINPROGRESS) {
    close(fd);
    return -1;
  }
  return fd;
}

// A blocking connection, or -1.
inline int connect_blocking(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(uint16_t(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the peer has closed the connection (EOF or reset), reading and discarding what
// it sent first; never blocks.
inline bool closed_by_peer(int fd) {
  char buf[4096];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) continue;
    if (n == 0) return true;
    return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ENOTCONN;
  }
}

// Waits up to timeout_ms for the peer to close; true if it did.
inline bool wait_closed(int fd, int timeout_ms) {
  auto t0 = Clock::now();
  while (ms_since(t0) < timeout_ms) {
    if (closed_by_peer(fd)) return true;
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 50);
  }
  return closed_by_peer(fd);
}

// Sends as much of `bytes` as the peer takes before `timeout_ms` (non-blocking socket);
// returns the number of bytes sent.
inline size_t send_some(int fd, const std::string& bytes, int timeout_ms) {
  size_t off = 0;
  auto t0 = Clock::now();
  while (off < bytes.size() && ms_since(t0) < timeout_ms) {
    ssize_t n = send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      off += size_t(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) break;
    pollfd p{fd, POLLOUT, 0};
    poll(&p, 1, 20);
  }
  return off;
}

// Connects, sends `bytes`, half-closes and reads until EOF or timeout: the reply ("" when
// the connection failed or the peer said nothing).
inline std::string exchange(int port, const std::string& bytes, int timeout_ms = 3000) {
  int fd = connect_blocking(port);
  if (fd < 0) return "";
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;
    off += size_t(n);
  }
  shutdown(fd, SHUT_WR);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof buf, 0)) > 0) out.append(buf, size_t(n));
  close(fd);
  return out;
}

// A field of /proc/PID/status in KiB ("VmRSS", "VmHWM"); -1 when absent.
inline int64_t status_kib(pid_t pid, const std::string& field) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

// The pids of PID's children (Linux /proc/PID/task/*/children).
inline std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  std::ifstream f("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  pid_t c;
  while (f >> c) out.push_back(c);
  return out;
}

// The value of VAR in the environment of PID ("" when absent).
inline std::string environ_of(pid_t pid, const std::string& var) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string e;
  while (std::getline(f, e, '\0'))
    if (e.rfind(var + "=", 0) == 0) return e.substr(var.size() + 1);
  return "";
}

// Raises this process's soft RLIMIT_NOFILE to at least n (within the hard limit); the
// resulting soft limit.
inline rlim_t raise_nofile(rlim_t n) {
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < n) {
    rl.rlim_cur = std::min(n, rl.rlim_max);
    setrlimit(RLIMIT_NOFILE, &rl);
    getrlimit(RLIMIT_NOFILE, &rl);
  }
  return rl.rlim_cur;
}

// Deterministic pseudo-random bytes.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  std::string bytes(size_t n) {
    std::string b(n, '\0');
    for (auto& c : b) c = char(next() >> 56);
    return b;
  }
};

// A store frame header: u32 little-endian length.
inline std::string le32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[size_t(i)] = char(v >> (8 * i));
  return s;
}

}  // namespace netfuzz

#pragma once
// Helpers for dtrain's two servers that face the network, the rendezvous store
// (comm/store_server.cpp) and the /metrics endpoint (obs/http_server.cpp): peers they
// reject are logged without flooding the log, and accepting survives running out of file
// descriptors instead of spinning on EMFILE.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::net_guard {

using Clock = std::chrono::steady_clock;

// Logs the first event of each cause at once (log::warn, with its detail), then at most
// one line per cause and period with the number of events since the last line, so a peer
// that misbehaves a million times cannot flood the log. Used by one thread (a server's loop).
class ThrottledLog {
 public:
  // `who` prefixes every line ("store", "metrics server"); `causes` name the events
  // ("closed a connection: no hello in time"), indexed by the `cause` argument of note().
  ThrottledLog(std::string who, std::vector<std::string> causes,
               std::chrono::milliseconds period = std::chrono::seconds(60));
  ~ThrottledLog();  // logs the counts not yet reported
  void note(size_t cause, const std::string& detail, Clock::time_point now = Clock::now());
  void tick(Clock::time_point now = Clock::now());  // logs the summaries that are due
  int64_t total(size_t cause) const { return causes_[cause].total; }

 private:
  struct Cause {
    std::string name;
    int64_t total = 0, pending = 0;  // pending: since the last line
    Clock::time_point last_line{};
    bool logged = false;
    std::string last_detail;
  };
  void summarise(Cause& c);
  std::string who_;
  std::vector<Cause> causes_;
  std::chrono::milliseconds period_;
};

// accept4() for a non-blocking listening socket that keeps working when the process runs
// out of file descriptors: it holds one spare descriptor, and on EMFILE/ENFILE it frees
// it, accepts the waiting peer, hands it to `shed` (to write a short refusal), closes it
// and takes the spare again. So the peer is told and closed rather than left in the
// backlog with the listening socket readable forever (a busy loop).
class Acceptor {
 public:
  Acceptor();
  ~Acceptor();
  Acceptor(const Acceptor&) = delete;
  Acceptor& operator=(const Acceptor&) = delete;

  enum class Result {
    Accepted,   // *fd is the new connection (non-blocking, close-on-exec)
    Empty,      // nobody waits
    Shed,       // out of descriptors: one peer was refused and closed
    Exhausted,  // out of descriptors and no spare to shed with: stop polling for a while
  };
  template <typename Shed>
  Result accept(int listen_fd, int* fd, Shed&& shed) {
    int s = -1;
    Result r = accept_raw(listen_fd, fd, &s);
    if (r == Result::Shed) {
      shed(s);
      release_shed(s);
    }
    return r;
  }

 private:
  Result accept_raw(int listen_fd, int* fd, int* shed_fd);
  void release_shed(int fd);
  int spare_ = -1;
};

// "host:port" of the peer of a connected socket ("?" when unknown), for log lines.
std::string peer_of(int fd);

}  // namespace dtrain::net_guard

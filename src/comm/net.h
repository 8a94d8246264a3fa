#pragma once
// Blocking TCP helpers shared by the store clients (dtrain's own and c10d's).
#include <chrono>
#include <string>

namespace dtrain::comm::net {

using Clock = std::chrono::steady_clock;

// One connection attempt to host:port (any address family getaddrinfo returns), with
// TCP_NODELAY; -1 and *err set on failure.
int connect_once(const std::string& host, int port, std::string* err);

// Connects, retrying with a growing back-off until `deadline` (the server may start later);
// -1 and *err (the last failure) when the deadline passed.
int connect_retry(const std::string& host, int port, Clock::time_point deadline, std::string* err);

enum class Io { Ok, Closed, Timeout, Error };  // Closed: EOF or reset by the peer

// Sends (sending = true) or receives exactly n bytes before the deadline. Receiving: on
// Closed/Timeout/Error, *done (if given) holds how many bytes arrived.
Io io_all(int fd, void* p, size_t n, bool sending, Clock::time_point deadline, size_t* done = nullptr);

}  // namespace dtrain::comm::net

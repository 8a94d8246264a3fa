#pragma once
// Rendezvous: a TCP key-value store (like c10d's TCPStore) hosted by the launcher or by
// rank 0. It carries Gloo's pair addresses and NCCL's unique id.
//
// `Store` is what the layers above use (Gloo's adapter, NCCL's id exchange, the trainer's
// checks). Two clients implement it: StoreClient (below: dtrain's own protocol, talking to
// a StoreServer) and C10dStore (c10d_store.h: PyTorch's TCPStore protocol, talking to the
// store torchrun's agent hosts).
//
// Protocol (dtrain's own, little-endian): every message is a frame
//   u32 length | body[length]     (length <= the frame limit, else the connection is closed)
// A request body is u8 opcode followed by fields; strings/bytes are u32 length + bytes,
// integers are i64. The first request of a connection must be HELLO(job token); a wrong
// token is answered with an error reply and the connection is closed. Replies start with
// u8 status (0 ok, 1 error + message string). Blocking operations (get, wait) poll the
// server with a short back-off, so the server never holds a request open.
//
// The store's port is open to whoever can reach it, so the server trusts nobody before the
// HELLO: until then a frame may hold kMaxHelloFrame bytes, the HELLO must arrive within
// StoreLimits::handshake_timeout of the accept, and only max_unauthenticated such
// connections are kept (a new one evicts the oldest that has waited more than evict_grace).
// After it, frames may hold kMaxFrame bytes, each must arrive within frame_timeout of its
// first byte, and an idle connection is kept for as long as the client wants (ranks sit in
// wait() and between requests for hours). See docs/distributed.md, "Limits of the store".
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dtrain::comm {

constexpr uint32_t kMaxFrame = 64u << 20;     // a frame after the HELLO: 64 MiB
constexpr uint32_t kMaxHelloFrame = 4096;     // a frame before it (HELLO = 5 bytes + the token)
constexpr size_t kMaxJobToken = kMaxHelloFrame - 5;

// A key-value rendezvous store. Values are bytes; `timeout()` is the default deadline of
// get()/wait(). Every failure and timeout is a RuntimeFault naming the key and address().
class Store {
 public:
  virtual ~Store() = default;
  void set(const std::string& key, const std::vector<uint8_t>& value) { do_set(key, value); }
  void set(const std::string& key, const std::string& value) {
    do_set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  // Blocks until the key exists; RuntimeFault naming key and address on timeout.
  std::vector<uint8_t> get(const std::string& key) { return do_get(key, timeout()); }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) { return do_get(key, timeout); }
  std::string get_string(const std::string& key) {
    auto v = get(key);
    return std::string(v.begin(), v.end());
  }
  // Atomically adds delta to the integer stored at key (absent = 0); returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual bool check(const std::vector<std::string>& keys) = 0;  // all present?
  void wait(const std::vector<std::string>& keys) { do_wait(keys, timeout()); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) { do_wait(keys, timeout); }
  virtual bool remove(const std::string& key) = 0;  // true if the key existed

  virtual std::string address() const = 0;  // "host:port", for messages
  virtual std::chrono::milliseconds timeout() const = 0;

 protected:
  // What the overloads above call: one virtual per operation, so an implementation hides none.
  virtual void do_set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  virtual std::vector<uint8_t> do_get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  virtual void do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
};

// Bounds the store requests of the calling thread: while one lives, every request this
// thread makes to a TcpStore (either client) ends by `deadline` (the earliest of nested ones),
// failing with "no reply within N ms" when the store has not answered, instead of waiting out
// the store's own timeout. For callers that must not block for long, such as the arrival report
// after a failed collective, whose store may be cut off or gone without a word. A request cut
// short this way closes the client's connection, like any lost reply.
class StoreDeadline {
 public:
  explicit StoreDeadline(std::chrono::steady_clock::time_point deadline);
  ~StoreDeadline();
  StoreDeadline(const StoreDeadline&) = delete;
  StoreDeadline& operator=(const StoreDeadline&) = delete;
  // `d`, or this thread's innermost live deadline when that comes first.
  static std::chrono::steady_clock::time_point cap(std::chrono::steady_clock::time_point d);

 private:
  std::chrono::steady_clock::time_point prev_;
};

// A Store reached over TCP at host:port, with a default timeout for get() and wait() (the
// two clients: dtrain's StoreClient and the c10d TCPStore client).
class TcpStore : public Store {
 public:
  std::string address() const override { return host_ + ":" + std::to_string(port_); }
  std::chrono::milliseconds timeout() const override { return timeout_; }
  TcpStore(const TcpStore&) = delete;  // one connection each
  TcpStore& operator=(const TcpStore&) = delete;

 protected:
  TcpStore(std::string host, int port, std::chrono::milliseconds timeout)
      : host_(std::move(host)), port_(port), timeout_(timeout) {}
  // When one request must have its reply: the store's timeout (at least 1 s) from now, or
  // this thread's StoreDeadline when that comes first.
  std::chrono::steady_clock::time_point request_deadline() const {
    return StoreDeadline::cap(std::chrono::steady_clock::now() + std::max(timeout_, std::chrono::milliseconds(1000)));
  }
  std::string host_;
  int port_;
  std::chrono::milliseconds timeout_;
};

// The server's limits against peers that are not (yet) clients of this job. The defaults
// admit jobs of tens of thousands of ranks (each rank holds one connection); tests lower them.
struct StoreLimits {
  size_t max_connections = 65536;     // open connections of every kind; beyond: refused
  size_t max_unauthenticated = 256;   // connections still before their HELLO
  std::chrono::milliseconds handshake_timeout{10000};  // accept -> HELLO received
  std::chrono::milliseconds frame_timeout{60000};      // first -> last byte of a frame, and a
                                                        // reply the client does not read
  std::chrono::milliseconds evict_grace{250};  // an unauthenticated connection this young
                                               // is never evicted (the backlog waits)
};

// What the server has done, for tests and logs (a snapshot; counters only grow).
struct StoreServerStats {
  int64_t open = 0;            // connections open now
  int64_t authenticated = 0;   // of which past the HELLO
  int64_t buffered_bytes = 0;  // request and reply bytes held for the open connections
  // connections the server closed, by cause:
  int64_t bad_token = 0;          // HELLO with another job's token
  int64_t malformed = 0;          // bad frame, unknown opcode, or a first request that is no HELLO
  int64_t oversized = 0;          // a length above the frame limit (kMaxHelloFrame before the HELLO)
  int64_t handshake_timeout = 0;  // no HELLO within StoreLimits::handshake_timeout
  int64_t frame_timeout = 0;      // a frame or a reply stalled for StoreLimits::frame_timeout
  int64_t evicted = 0;            // an unauthenticated connection made way for a newer one
  int64_t over_limit = 0;         // refused at accept: max_connections reached
  int64_t out_of_fds = 0;         // refused at accept: the process is out of file descriptors
  int64_t rejected() const {
    return bad_token + malformed + oversized + handshake_timeout + frame_timeout + evicted + over_limit +
           out_of_fds;
  }
};

class StoreServer {
 public:
  // Binds host:port (port 0 picks a free port; see port()) and serves in a thread.
  // host "" or "0.0.0.0" listens on every interface. Throws RuntimeFault if it cannot bind.
  StoreServer(const std::string& host, int port, std::string job_token, StoreLimits limits = {});
  ~StoreServer();  // stops the thread and closes every connection
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }
  int64_t rejected_connections() const { return stats().rejected(); }
  StoreServerStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  std::thread thread_;
};

class StoreClient : public TcpStore {
 public:
  // Connects (retrying until `timeout`: the server may start later, or may have dropped
  // the connection before the HELLO) and authenticates. RuntimeFault naming the address on
  // timeout; RuntimeFault "job token rejected" when the server refuses the token (or the
  // server's refusal, e.g. too many connections). UserError for a token longer than
  // kMaxJobToken. `timeout` is also the default for get()/wait().
  StoreClient(std::string host, int port, std::string job_token,
              std::chrono::milliseconds timeout = std::chrono::seconds(300));
  ~StoreClient() override;

  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool remove(const std::string& key) override;

 protected:
  void do_set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> do_get(const std::string& key, std::chrono::milliseconds timeout) override;
  void do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;

 private:
  std::vector<uint8_t> request(const std::vector<uint8_t>& body, const char* what,
                               const std::string& key);
  // One round trip; false when the connection was lost or the reply did not come in time (then
  // fd_ is closed and *why says which).
  bool exchange(const std::vector<uint8_t>& body, std::vector<uint8_t>& rep, std::string* why);
  void connect_and_hello();
  void close_fd();

  std::string token_;
  int fd_ = -1;
  std::mutex mu_;
};

}  // namespace dtrain::comm

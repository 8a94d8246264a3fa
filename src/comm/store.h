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
//   u32 length | body[length]     (length <= kMaxFrame, else the connection is closed)
// A request body is u8 opcode followed by fields; strings/bytes are u32 length + bytes,
// integers are i64. The first request of a connection must be HELLO(job token); a wrong
// token is answered with an error reply and the connection is closed. Replies start with
// u8 status (0 ok, 1 error + message string). Blocking operations (get, wait) poll the
// server with a short back-off, so the server never holds a request open.
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dtrain::comm {

constexpr uint32_t kMaxFrame = 64u << 20;  // 64 MiB

// A key-value rendezvous store. Values are bytes; `timeout()` is the default deadline of
// get()/wait(). Every failure and timeout is a RuntimeFault naming the key and address().
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  void set(const std::string& key, const std::string& value) {
    set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  // Blocks until the key exists; RuntimeFault naming key and address on timeout.
  std::vector<uint8_t> get(const std::string& key) { return get(key, timeout()); }
  virtual std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  std::string get_string(const std::string& key) {
    auto v = get(key);
    return std::string(v.begin(), v.end());
  }
  // Atomically adds delta to the integer stored at key (absent = 0); returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual bool check(const std::vector<std::string>& keys) = 0;  // all present?
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  virtual bool remove(const std::string& key) = 0;  // true if the key existed

  virtual std::string address() const = 0;  // "host:port", for messages
  virtual std::chrono::milliseconds timeout() const = 0;
};

class StoreServer {
 public:
  // Binds host:port (port 0 picks a free port; see port()) and serves in a thread.
  // host "" or "0.0.0.0" listens on every interface. Throws RuntimeFault if it cannot bind.
  StoreServer(const std::string& host, int port, std::string job_token);
  ~StoreServer();  // stops the thread and closes every connection
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }
  int64_t rejected_connections() const;  // bad token, malformed or oversized frames

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  std::thread thread_;
};

class StoreClient : public Store {
 public:
  // Connects (retrying until `timeout`: the server may start later) and authenticates.
  // RuntimeFault naming the address on timeout; RuntimeFault "job token rejected" when the
  // server refuses the token. `timeout` is also the default for get()/wait().
  StoreClient(std::string host, int port, std::string job_token,
              std::chrono::milliseconds timeout = std::chrono::seconds(300));
  ~StoreClient() override;
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  using Store::get;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool remove(const std::string& key) override;

  std::string address() const override { return host_ + ":" + std::to_string(port_); }
  std::chrono::milliseconds timeout() const override { return timeout_; }

 private:
  std::vector<uint8_t> request(const std::vector<uint8_t>& body, const char* what,
                               const std::string& key);
  void connect_and_hello();
  void close_fd();

  std::string host_;
  int port_;
  std::string token_;
  std::chrono::milliseconds timeout_;
  int fd_ = -1;
  std::mutex mu_;
};

}  // namespace dtrain::comm

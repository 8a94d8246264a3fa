#pragma once
// A client of PyTorch's c10d TCPStore: the store torchrun's elastic agent hosts at
// MASTER_ADDR:MASTER_PORT when it sets TORCHELASTIC_USE_AGENT_STORE=True. dtrain's workers
// rendezvous on it exactly as PyTorch workers do (see dist_env / open_store).
//
// Wire format (what torch's TCPStore client sends; integers little-endian, as torch writes
// them from memory on x86/ARM):
//   query   = u8 type, then arguments
//   string  = u64 length + bytes          (keys and values alike)
//   SET     key value                     no reply
//   GET     key                           reply: u64 length + bytes (the key must exist:
//                                         torch <= 2.1 drops the connection otherwise, so
//                                         get() waits first, as torch's own client does)
//   ADD     key i64                       reply: i64 new value (stored as decimal text)
//   CHECK   u64 n, n keys                 reply: u8 0 = all present, 1 = not all
//   WAIT    u64 n, n keys                 reply: u8 0, sent when every key exists
//   GETNUMKEYS                            reply: i64
//   DELETE_KEY key                        reply: i64 number deleted
// torch's client puts "/" before every key; so does this one, so a torch client and dtrain
// see the same keys. Keys then start with this store's key_prefix.
//
// Two dialects (query-type numbering), decided once per store:
//   Legacy   (torch 1.x to 2.1): SET 0, GET 2, ADD 3, CHECK 4, WAIT 5, GETNUMKEYS 6,
//            DELETE_KEY 8.
//   Validate (torch 2.2 and later): a VALIDATE query was put first (value 0) and every
//            connection must start with VALIDATE + u32 0x3C85F7CE; WATCH_KEY was dropped, so
//            SET 1, GET 3, ADD 4, CHECK 5, WAIT 6, GETNUMKEYS 7, DELETE_KEY 8. Later
//            additions (PING, queues, ...) are appended after CANCEL_WAIT (12) and unused here.
//
// Detection (C10dDialect::Auto): one throw-away connection sends the 9 bytes
//   00 | CE F7 85 3C | 07 07 07 FF
// A Validate server reads VALIDATE + magic, answers three GETNUMKEYS (07) with 8 bytes each
// and closes on the unknown type FF. A Legacy server reads SET (00) with a u64 key length
// of 0xFF070707'3C85F7CE > PTRDIFF_MAX: allocating the key fails at once and it closes the
// connection without replying (no allocation, no blocking read that would stall its
// single-threaded loop). So: the 24 bytes = Validate, a close with 0 bytes = Legacy,
// anything else is a RuntimeFault naming the address. Neither server logs anything. Every connection then confirms its dialect
// with GETNUMKEYS, so a server that is not a TCPStore of that dialect fails at once.
// DTRAIN_TCPSTORE_PROTOCOL=legacy|validate skips the probe.
//
// Timeouts: wait()/get() block on the server's WAIT reply until their timeout, then close
// the connection (the server forgets a closed connection's waits; a fresh one is opened by
// the next call) and throw a RuntimeFault naming the missing keys and the address. A server
// that dies mid-call is a RuntimeFault at once (connection closed), never a hang.
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/store.h"

namespace dtrain::comm {

enum class C10dDialect { Auto, Legacy, Validate };

const char* dialect_name(C10dDialect d);  // "auto" | "legacy" | "validate"
std::optional<C10dDialect> parse_dialect(const std::string& s);

// Limits of PyTorch's libuv server (the default since 2.4): longer keys or values make it
// drop the connection, so set() refuses them with a clear error instead.
constexpr size_t kC10dMaxKey = 8 * 1024;
constexpr size_t kC10dMaxValue = 8u << 20;

class C10dStore : public TcpStore {
 public:
  // Connects to host:port, retrying until `timeout` (also the default for get()/wait()),
  // and settles the dialect (probing when Auto). RuntimeFault naming the address when
  // nothing accepts the connection in time or the server does not answer like a TCPStore.
  C10dStore(std::string host, int port, std::string key_prefix, std::chrono::milliseconds timeout,
            C10dDialect dialect = C10dDialect::Auto);
  ~C10dStore() override;

  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool remove(const std::string& key) override;
  int64_t num_keys();  // every key in the store, torch's own included

  C10dDialect dialect() const { return dialect_; }
  const std::string& key_prefix() const { return prefix_; }

  // The detection described above, on its own connection (retrying the connect until
  // `timeout`). Never returns Auto.
  static C10dDialect probe(const std::string& host, int port, std::chrono::milliseconds timeout);

 protected:
  void do_set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> do_get(const std::string& key, std::chrono::milliseconds timeout) override;
  void do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;

 private:
  void connect(bool retry);
  void close_fd();
  void ensure_connected();
  void send(const std::vector<uint8_t>& b, const char* what, const std::string& key);
  void recv(void* p, size_t n, std::chrono::steady_clock::time_point deadline, const char* what,
            const std::string& key);
  int64_t recv_i64(const char* what, const std::string& key);
  std::string wire_key(const std::string& key) const;
  // The request `code` (check or wait) over `keys`, sent on the connection (connecting first).
  void send_keys(uint8_t code, const std::vector<std::string>& keys, const char* what);
  [[noreturn]] void lost(const char* what, const std::string& key, const std::string& why);

  std::string prefix_;
  C10dDialect dialect_;
  int fd_ = -1;
  std::mutex mu_;
};

}  // namespace dtrain::comm

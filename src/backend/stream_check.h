#pragma once
// The stream-order checker (DTRAIN_STREAM_CHECK=1; docs/distributed.md, "The ordering
// contract"): CUDA's ordering rules applied to the work a process issues, on any device, in
// the spirit of PyTorch's CUDA sanitizer.
//
// Logical streams: the host (id 0), the backend's compute stream, its copy streams and each
// communicator's stream. Every op, collective, point-to-point operation and copy declares,
// when it is issued, the byte ranges it reads and writes on its stream. Happens-before comes
// from vector clocks: a stream knows, for every stream, the last of its operations ordered
// before its own next one. Edges: an event recorded on one stream and waited on by another
// (Stream::wait_for), the host waiting for a stream or an event (synchronize, Work::wait,
// copy_wait), and the host's order itself (work issued after the host learned that X is done
// runs after X). An access to bytes that another stream last wrote (or, for a write, last
// read) with no such edge is a race: RuntimeFault naming the op, the buffer (its registered
// name: a parameter, a ZeRO-3 slot, a bucket), both streams and both sequence numbers.
//
// DTRAIN_STREAM_CHECK=1 stops at the first race (the RuntimeFault); =report logs each
// distinct race once (by its two ops, streams and buffer) as a warning and goes on.
//
// Deterministic: the model follows the host's issue order, not the timing of execution, so
// a CPU run (where every op has finished when it returns) finds the races a GPU run would
// have. Thread-safe (one mutex).
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace dtrain {

// One byte range an operation touches.
struct MemAccess {
  const void* ptr = nullptr;
  size_t bytes = 0;
  bool write = false;
};
inline MemAccess reads(const Tensor& t) { return {t.data, t.defined() ? t.nbytes() : 0, false}; }
inline MemAccess writes(const Tensor& t) { return {t.data, t.defined() ? t.nbytes() : 0, true}; }
inline MemAccess reads(const void* p, size_t n) { return {p, n, false}; }
inline MemAccess writes(const void* p, size_t n) { return {p, n, true}; }

class StreamChecker {
 public:
  using StreamId = int;
  static constexpr StreamId kHost = 0;
  // A stream's knowledge at one point of its order: what an event recorded there carries.
  struct Mark {
    std::vector<uint64_t> clock;
  };

  // report: log distinct races and go on, instead of throwing at the first
  explicit StreamChecker(bool report = false);
  // A new logical stream (names need not be unique; messages use them).
  StreamId add_stream(const std::string& name);
  const std::string& stream_name(StreamId s) const;

  // Work issued on `s` now: checked against the earlier accesses of other streams, then
  // recorded. Returns the mark of `s` after it (its sequence number on `s`, 1, 2, ..., is
  // mark.clock[s]). Throws RuntimeFault on a race.
  Mark issue(StreamId s, const std::string& op, const std::vector<MemAccess>& acc);
  // The mark of `s` after the work issued on it so far (cudaEventRecord).
  Mark record(StreamId s) const;
  // Work issued on `waiter` from now on runs after `m` (cudaStreamWaitEvent).
  void wait(StreamId waiter, const Mark& m);
  void wait_stream(StreamId waiter, StreamId producer) { wait(waiter, record(producer)); }
  // The host blocked until `m` / everything issued on `s` so far was done.
  void host_wait(const Mark& m) { wait(kHost, m); }
  void host_wait_stream(StreamId s) { wait(kHost, record(s)); }

  // A name for the bytes [p, p + n) in reports; the smallest named range around an address
  // names it. Naming again replaces the name of that exact range.
  void name(const void* p, size_t n, const std::string& label);
  // Forgets the accesses and names of [p, p + n): memory returned to the system, whose next
  // owner orders itself through the allocator (cudaFree synchronises the device).
  void forget(const void* p, size_t n);

  // operations checked and recorded so far (all streams); races found (report mode)
  uint64_t issued() const;
  uint64_t races() const;

 private:
  struct Acc {
    StreamId stream = -1;
    uint64_t seq = 0;
    std::shared_ptr<const std::string> op;
  };
  struct Seg {
    uintptr_t end = 0;
    Acc write;
    std::vector<Acc> reads;  // the last read of each stream that read after `write`
  };
  struct Named {
    uintptr_t end;
    std::string label;
  };
  bool ordered(StreamId s, const Acc& a) const;  // a happens before s's current work
  void split_at(uintptr_t at);
  std::string describe(uintptr_t lo, uintptr_t hi) const;
  void race(const char* verb, const char* other_verb, StreamId s, uint64_t seq, const std::string& op,
            const Acc& other, uintptr_t lo, uintptr_t hi);

  mutable std::mutex mu_;
  std::vector<std::string> names_;
  std::vector<std::vector<uint64_t>> clock_;  // clock_[s][t]: t's last op ordered before s's next
  std::map<uintptr_t, Seg> segs_;             // disjoint [start, end) ranges with their last accesses
  std::multimap<uintptr_t, Named> labels_;
  uint64_t issued_ = 0, races_ = 0;
  bool report_ = false;
  std::set<std::string> reported_;
};

// DTRAIN_STREAM_CHECK: off (unset, empty or 0), on (1: stop at the first race) or report;
// read by make_backend. Any other value is a UserError naming the variable.
enum class StreamCheckMode { Off, Stop, Report };
StreamCheckMode stream_check_mode();

}  // namespace dtrain

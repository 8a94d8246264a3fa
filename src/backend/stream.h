#pragma once
// Streams: the ordering contract of dtrain (docs/distributed.md), one mechanism on every device.
//
// A Stream is an ordered queue of device work. The backend's compute stream runs the ops;
// each communicator has a stream of its own; the backend's asynchronous host copies have
// theirs. Work on one stream is ordered after work on another only through wait_for() (CUDA:
// an event recorded on the producer, waited on by this stream) or through the host (it waited
// for the producer, then issued the work). On the CPU the backend runs an op to its end before
// returning, so these calls order nothing physically; they are the same calls as on CUDA and
// the stream-order checker (backend/stream_check.h) holds the CPU run to CUDA's rules.
#include <memory>
#include <string>
#include <vector>

#include "backend/stream_check.h"

namespace dtrain {

// Where an issued operation ends in its stream's order: the host waiting for it (a
// communicator's Work::wait, a copy ticket) learns that it is done. Empty without a checker.
struct StreamMark {
  std::shared_ptr<StreamChecker> checker;
  StreamChecker::Mark mark;
  void host_wait() const {
    if (checker) checker->host_wait(mark);
  }
};

class Stream {
 public:
  // `checker`: the stream-order checker (null: off) this stream reports to.
  Stream(std::string name, std::shared_ptr<StreamChecker> checker);
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  const std::string& name() const { return name_; }
  // The device's handle: cudaStream_t on CUDA, nullptr elsewhere.
  virtual void* native() const { return nullptr; }
  // Work issued on this stream from now on runs after the work issued on `producer` so far.
  void wait_for(Stream& producer);
  // The host blocks until the work issued on this stream so far is done.
  void synchronize();
  // Declares work issued on this stream now, with the bytes it reads and writes (checked
  // against the other streams' accesses when the checker is on); returns the mark after it.
  StreamMark issue(const std::string& op, const std::vector<MemAccess>& acc);
  StreamChecker* checker() const { return checker_.get(); }

 protected:
  virtual void do_wait_for(Stream&) {}
  virtual void do_synchronize() {}

 private:
  std::string name_;
  std::shared_ptr<StreamChecker> checker_;
  StreamChecker::StreamId id_ = -1;
};

}  // namespace dtrain

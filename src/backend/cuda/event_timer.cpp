// CudaEventTimer: the EventTimer of the CUDA backend. Marks are cudaEvents (default flags:
// timing enabled) recorded on the backend's compute stream; recording never waits for the
// device. The events are created once and reused: a step with the same phases records the
// same marks, so after the first step no event is created.
#include <fmt/format.h>

#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/event_timer.h"

namespace dtrain {
namespace {

class CudaEventTimer final : public EventTimer {
 public:
  // capturing: the backend's flag, true between capture_begin and capture_end
  CudaEventTimer(int device, cudaStream_t stream, const bool* capturing)
      : dev_(device), stream_(stream), capturing_(capturing) {
    events_.reserve(kInitial);
    try {
      grow(kInitial);
    } catch (...) {
      destroy();
      throw;
    }
  }
  ~CudaEventTimer() override { destroy(); }
  CudaEventTimer(const CudaEventTimer&) = delete;
  CudaEventTimer& operator=(const CudaEventTimer&) = delete;

  int mark() override {
    if (used_ == events_.size()) grow(events_.size());  // doubles the pool
    // While the stream is captured into a CUDA graph, an external event-record node: the
    // graph records this event each time it is launched.
    if (*capturing_)
      DTRAIN_CUDA_CHECK(cudaEventRecordWithFlags(events_[used_], stream_, cudaEventRecordExternal),
                        "EventTimer::mark (in a CUDA graph capture)");
    else
      DTRAIN_CUDA_CHECK(cudaEventRecord(events_[used_], stream_), "EventTimer::mark");
    return int(used_++);
  }

  void skip(int n) override {
    DTRAIN_CHECK(n >= 0 && used_ + size_t(n) <= events_.size(),
                 "EventTimer::skip({}) with {} of {} events used", n, used_, events_.size());
    used_ += size_t(n);
  }

  void wait(int i) override {
    DTRAIN_CHECK(i >= 0 && size_t(i) < used_, "EventTimer::wait({}) with {} marks", i, used_);
    DTRAIN_CUDA_CHECK(cudaEventSynchronize(events_[size_t(i)]), fmt::format("EventTimer::wait({})", i));
  }

  double elapsed(int a, int b) override {
    DTRAIN_CHECK(a >= 0 && b >= a && size_t(b) < used_, "EventTimer::elapsed({}, {}) with {} marks", a, b, used_);
    if (a == b) return 0;
    // b was recorded after a on the same stream: once b has completed, so has a.
    wait(b);
    float ms = 0;
    DTRAIN_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[size_t(a)], events_[size_t(b)]),
                      fmt::format("EventTimer::elapsed({}, {})", a, b));
    return double(ms) * 1e-3;
  }

  void clear() override { used_ = 0; }
  int count() const override { return int(used_); }

 private:
  static constexpr size_t kInitial = 16;

  void grow(size_t n) {
    DTRAIN_CUDA_CHECK(cudaSetDevice(dev_), "EventTimer: cudaSetDevice");
    for (size_t i = 0; i < n; ++i) {
      cudaEvent_t e = nullptr;
      DTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault), "EventTimer: cudaEventCreate");
      events_.push_back(e);
    }
  }
  void destroy() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    events_.clear();
  }

  int dev_;
  cudaStream_t stream_;
  const bool* capturing_;
  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
};

}  // namespace

std::unique_ptr<EventTimer> CudaBackend::make_event_timer() {
  return std::make_unique<CudaEventTimer>(dev_, stream_, &capturing_);
}

}  // namespace dtrain

#pragma once
// EventTimer: marks in a backend's stream order, for timing phases of a step without
// adding synchronisation to it (Backend::make_event_timer()).
//   CPU:  mark() reads std::chrono::steady_clock; the work before it is done already.
//   CUDA: mark() records a cudaEvent (timing enabled, from a pool created once and reused)
//         on the compute stream and returns at once; the event's time is when the device
//         reached it. elapsed() waits for the later mark to complete, so call it where the
//         step waits for the device anyway (its end), not between phases.
// Marks are numbered 0, 1, ... in recording order since the last clear().
#include <chrono>
#include <memory>
#include <vector>

namespace dtrain {

class EventTimer {
 public:
  virtual ~EventTimer() = default;
  // Records "now" in stream order; returns the mark's index.
  virtual int mark() = 0;
  // The host waits until the device has reached mark i (CPU: returns at once).
  virtual void wait(int i) = 0;
  // Seconds from mark a to mark b (a recorded before b); waits for b (CUDA).
  virtual double elapsed(int a, int b) = 0;
  // Forgets every mark; the next mark() is index 0 again and reuses the first event.
  // Every mark must have completed (wait() for the last one) before clear() is called.
  virtual void clear() = 0;
  virtual int count() const = 0;  // marks since clear()
  // Counts n marks recorded by other means: the event-record nodes of a replayed CUDA graph,
  // captured from mark() calls with these same indices in an earlier step (CUDA: marks made
  // while the stream is being captured become such nodes).
  virtual void skip(int n) = 0;
};

// The CPU's timer (Backend's default): host steady-clock readings.
class HostEventTimer final : public EventTimer {
 public:
  using Clock = std::chrono::steady_clock;
  HostEventTimer() { marks_.reserve(32); }
  int mark() override;
  void wait(int i) override;
  double elapsed(int a, int b) override;
  void clear() override { marks_.clear(); }
  int count() const override { return int(marks_.size()); }
  void skip(int n) override { marks_.insert(marks_.end(), size_t(n), Clock::now()); }

 private:
  std::vector<Clock::time_point> marks_;
};

}  // namespace dtrain

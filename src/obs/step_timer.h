#pragma once
// StepTimer: the device phases of one training step (forward, backward, optimizer) timed
// in the backend's stream order with an EventTimer (backend/event_timer.h), and the
// step's total on the host's steady clock.
//   CPU:  a mark is a steady_clock reading (the work before it has finished).
//   CUDA: a mark is an event recorded on the compute stream; recording never waits. The
//         host waits for the device only where the step waits anyway: wait_device() just
//         before it blocks on gradient communication (which needs backward's gradients),
//         and finish() at the end of the step (the step's one final synchronisation).
// Data wait and exposed gradient sync are host time (the host waiting for the loader or
// for the network); their callers measure them with a steady clock.
// The intervals of a step are disjoint: data, forward, backward, sync and optimizer sum to
// at most the total (CUDA with grad_accum > 1: loading micro-batch k+1 may overlap the
// device's backward of micro-batch k, which is time saved, not lost).
#include <memory>
#include <vector>

#include "core/clock.h"

namespace dtrain {

class Backend;
class EventTimer;

enum class Phase { Forward = 0, Backward = 1, Optimizer = 2 };
inline constexpr int kDevicePhases = 3;
const char* phase_name(Phase p);

class StepTimer {
 public:
  explicit StepTimer(Backend& be);
  ~StepTimer();
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;

  // A new step: forgets the previous one's marks and reads the host clock.
  void start();
  // Opens / closes an interval of phase p (one open interval per phase). A phase may have
  // several intervals in a step (micro-batches): their seconds add up.
  void begin(Phase p);
  void end(Phase p);
  // The host waits until the device has reached the latest mark (CPU: nothing to wait for).
  void wait_device();
  // Ends the step: a last mark, waits for it, resolves every interval and the total.
  void finish();

  // After finish(): seconds of phase p in the step, and the step's host wall time from
  // start() to the end of finish().
  double seconds(Phase p) const { return seconds_[size_t(p)]; }
  double total_s() const { return total_s_; }
  bool in_step() const { return in_step_; }

  struct Interval {
    Phase phase;
    int begin, end;  // mark indices
  };
  // CUDA graphs (session/step_graph.h). What a captured region marked: mark indices
  // [first_mark, first_mark + marks) and the intervals it closed. A later step replaying the
  // graph (its event nodes record those same events) calls replayed() at the same point of
  // the step, so the step's phases still add up.
  struct Recorded {
    int first_mark = 0, marks = 0;
    std::vector<Interval> intervals;
  };
  struct Position {
    int mark = 0;
    size_t interval = 0;
  };
  Position position() const;
  Recorded recorded_since(const Position& p) const;
  void replayed(const Recorded& r);

 private:
  std::unique_ptr<EventTimer> ev_;
  std::vector<Interval> intervals_;
  int open_[kDevicePhases] = {-1, -1, -1};
  double seconds_[kDevicePhases] = {0, 0, 0};
  double total_s_ = 0;
  Clock::time_point t0_{};
  bool in_step_ = false;
};

}  // namespace dtrain

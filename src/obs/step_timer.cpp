#include "obs/step_timer.h"

#include "backend/backend.h"
#include "backend/event_timer.h"
#include "core/error.h"

namespace dtrain {

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::Optimizer: return "optimizer";
  }
  return "?";
}

StepTimer::StepTimer(Backend& be) : ev_(be.make_event_timer()) { intervals_.reserve(16); }
StepTimer::~StepTimer() = default;

void StepTimer::start() {
  // An aborted step (an exception) may leave marks pending on the device; re-recording a
  // pending CUDA event is allowed, so they are simply reused.
  ev_->clear();
  intervals_.clear();
  for (int i = 0; i < kDevicePhases; ++i) {
    open_[i] = -1;
    seconds_[i] = 0;
  }
  total_s_ = 0;
  in_step_ = true;
  t0_ = Clock::now();
}

void StepTimer::begin(Phase p) {
  DTRAIN_CHECK(in_step_, "StepTimer::begin({}) outside a step", phase_name(p));
  int& o = open_[size_t(p)];
  DTRAIN_CHECK(o < 0, "StepTimer::begin({}) while that phase is open", phase_name(p));
  o = ev_->mark();
}

void StepTimer::end(Phase p) {
  int& o = open_[size_t(p)];
  DTRAIN_CHECK(in_step_ && o >= 0, "StepTimer::end({}) without begin", phase_name(p));
  intervals_.push_back(Interval{p, o, ev_->mark()});
  o = -1;
}

StepTimer::Position StepTimer::position() const { return Position{ev_->count(), intervals_.size()}; }

StepTimer::Recorded StepTimer::recorded_since(const Position& p) const {
  DTRAIN_CHECK(p.mark <= ev_->count() && p.interval <= intervals_.size(), "StepTimer::recorded_since: bad position");
  for (int i = 0; i < kDevicePhases; ++i)
    DTRAIN_CHECK(open_[i] < p.mark, "StepTimer: phase {} open across a captured region", phase_name(Phase(i)));
  Recorded r;
  r.first_mark = p.mark;
  r.marks = ev_->count() - p.mark;
  r.intervals.assign(intervals_.begin() + std::ptrdiff_t(p.interval), intervals_.end());
  return r;
}

void StepTimer::replayed(const Recorded& r) {
  DTRAIN_CHECK(in_step_ && ev_->count() == r.first_mark,
               "StepTimer::replayed: the graph's marks start at {} but this step is at mark {}", r.first_mark,
               ev_->count());
  ev_->skip(r.marks);
  intervals_.insert(intervals_.end(), r.intervals.begin(), r.intervals.end());
}

void StepTimer::wait_device() {
  if (ev_->count() > 0) ev_->wait(ev_->count() - 1);
}

void StepTimer::finish() {
  DTRAIN_CHECK(in_step_, "StepTimer::finish() outside a step");
  for (int i = 0; i < kDevicePhases; ++i)
    DTRAIN_CHECK(open_[i] < 0, "StepTimer::finish() with phase {} open", phase_name(Phase(i)));
  const int last = ev_->mark();
  ev_->wait(last);  // the end of the step: every earlier mark has completed too
  total_s_ = seconds_since(t0_);
  for (const Interval& iv : intervals_) seconds_[size_t(iv.phase)] += ev_->elapsed(iv.begin, iv.end);
  in_step_ = false;
}

}  // namespace dtrain

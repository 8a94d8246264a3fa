#include "backend/event_timer.h"

#include "backend/backend.h"
#include "core/error.h"

namespace dtrain {

int HostEventTimer::mark() {
  marks_.push_back(Clock::now());
  return int(marks_.size()) - 1;
}

void HostEventTimer::wait(int i) {
  DTRAIN_CHECK(i >= 0 && i < count(), "EventTimer::wait({}) with {} marks", i, count());
}

double HostEventTimer::elapsed(int a, int b) {
  DTRAIN_CHECK(a >= 0 && b >= a && b < count(), "EventTimer::elapsed({}, {}) with {} marks", a, b, count());
  return std::chrono::duration<double>(marks_[size_t(b)] - marks_[size_t(a)]).count();
}

std::unique_ptr<EventTimer> Backend::make_event_timer() { return std::make_unique<HostEventTimer>(); }

}  // namespace dtrain

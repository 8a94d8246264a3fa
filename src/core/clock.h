#pragma once
// Host wall-clock intervals (steady clock), for the parts of a step measured on the host.
#include <chrono>

namespace dtrain {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace dtrain

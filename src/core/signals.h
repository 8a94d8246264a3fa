// SIGINT and SIGTERM handlers for a scope (the trainer's loop, the launcher's supervision):
// installs `handler` for both and restores the previous handlers when the scope ends.
#pragma once

#include <csignal>

namespace dtrain {

class StopSignalScope {
 public:
  explicit StopSignalScope(void (*handler)(int)) {
    struct sigaction sa {};
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignalScope() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  StopSignalScope(const StopSignalScope&) = delete;
  StopSignalScope& operator=(const StopSignalScope&) = delete;

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

}  // namespace dtrain

#pragma once
// Error types. Exceptions inside the code, exit codes only in main():
//   UserError    -> exit 2 (bad config, CLI, data shard, checkpoint)
//   RuntimeFault -> exit 1 (runtime failure: device, I/O, dead peer)
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace dtrain {

class Error : public std::runtime_error {
 public:
  Error(int exit_code, const std::string& msg) : std::runtime_error(msg), code_(exit_code) {}
  int exit_code() const { return code_; }

 private:
  int code_;
};

class UserError : public Error {
 public:
  explicit UserError(const std::string& msg) : Error(2, msg) {}
};

class RuntimeFault : public Error {
 public:
  explicit RuntimeFault(const std::string& msg) : Error(1, msg) {}
};

template <typename... Args>
[[noreturn]] void user_error(fmt::format_string<Args...> f, Args&&... args) {
  throw UserError(fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
[[noreturn]] void fault(fmt::format_string<Args...> f, Args&&... args) {
  throw RuntimeFault(fmt::format(f, std::forward<Args>(args)...));
}

// Internal invariant (a bug in dtrain, not a user error): exit 1.
#define DTRAIN_CHECK(cond, ...)                                                          \
  do {                                                                                   \
    if (!(cond))                                                                         \
      throw ::dtrain::RuntimeFault(std::string(__FILE__ ":") + std::to_string(__LINE__) + \
                                   ": check failed: " #cond ": " + fmt::format(__VA_ARGS__)); \
  } while (0)

}  // namespace dtrain

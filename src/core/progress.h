#pragma once
// Progress of a long job (data conversion, tokenization, indexing, evaluation, import): on a
// terminal one line redrawn in place (log::progress) at most 5 times a second, with the rate
// and, when the total is known, the percentage and ETA; when stdout is not a terminal, a log
// line every DTRAIN_PROGRESS_EVERY_S seconds (default 10; 0 = at every add), so jobs under a
// scheduler or a pipe show they are alive. finish() logs one summary line after a job that
// showed progress (a short one stays quiet).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace dtrain {

class Progress {
 public:
  // total <= 0: unknown. unit "bytes" is shown in MB.
  Progress(std::string what, int64_t total, std::string unit);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  void set_total(int64_t total);
  void add(int64_t n = 1);  // thread-safe
  // "<what>: <count> <unit> in <s>s (<rate> <unit>/s)" once, if a progress line was shown;
  // later calls do nothing.
  void finish();
  int64_t count() const { return done_.load(); }
  // The line shown for `done` of `total` after `seconds` (for tests and the summary).
  static std::string line(const std::string& what, int64_t done, int64_t total, const std::string& unit,
                          double seconds);

 private:
  void report(bool force);
  std::string what_, unit_;
  std::atomic<int64_t> total_, done_{0};
  std::chrono::steady_clock::time_point start_, last_;
  double every_s_;
  bool tty_, finished_ = false, shown_ = false;
  std::mutex mu_;
};

}  // namespace dtrain

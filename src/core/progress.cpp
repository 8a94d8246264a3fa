#include "core/progress.h"

#include <cstdlib>
#include <fmt/format.h>

#include "core/log.h"

namespace dtrain {

namespace {

double every_from_env() {
  const char* v = std::getenv("DTRAIN_PROGRESS_EVERY_S");
  if (!v || !*v) return 10.0;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  return end && *end == '\0' && s >= 0 ? s : 10.0;
}

std::string amount(int64_t n, const std::string& unit) {
  if (unit == "bytes") return fmt::format("{:.1f} MB", double(n) / 1e6);
  return fmt::format("{} {}", n, unit);
}

std::string hms(double s) {
  const int64_t t = int64_t(s + 0.5);
  return fmt::format("{}:{:02d}:{:02d}", t / 3600, (t / 60) % 60, t % 60);
}

}  // namespace

std::string Progress::line(const std::string& what, int64_t done, int64_t total, const std::string& unit,
                           double seconds) {
  const double rate = seconds > 0 ? double(done) / seconds : 0;
  const std::string r = unit == "bytes" ? fmt::format("{:.1f} MB/s", rate / 1e6) : fmt::format("{:.1f} {}/s", rate, unit);
  if (total <= 0) return fmt::format("{}: {} | {}", what, amount(done, unit), r);
  const double pct = 100.0 * double(done) / double(total);
  const std::string eta = rate > 0 && done < total ? hms(double(total - done) / rate) : "-";
  return fmt::format("{}: {} of {} ({:.0f}%) | {} | eta {}", what, amount(done, unit),
                     unit == "bytes" ? amount(total, unit) : std::to_string(total), pct, r, eta);
}

Progress::Progress(std::string what, int64_t total, std::string unit)
    : what_(std::move(what)), unit_(std::move(unit)), total_(total),
      start_(std::chrono::steady_clock::now()), last_(start_), every_s_(every_from_env()),
      tty_(log::stdout_is_terminal()) {}

Progress::~Progress() = default;

void Progress::set_total(int64_t total) { total_ = total; }

void Progress::add(int64_t n) {
  done_ += n;
  report(false);
}

void Progress::report(bool force) {
  const auto now = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock() || finished_) return;  // another thread is reporting
  const double since = std::chrono::duration<double>(now - last_).count();
  if (!force && since < (tty_ ? 0.2 : every_s_)) return;
  last_ = now;
  const std::string l = line(what_, done_, total_, unit_, std::chrono::duration<double>(now - start_).count());
  if (tty_)
    log::progress(l);
  else
    log::info("{}", l);
  shown_ = true;
}

void Progress::finish() {
  std::lock_guard<std::mutex> lk(mu_);
  if (finished_) return;
  finished_ = true;
  if (!shown_) return;  // a short job stays quiet
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = s > 0 ? double(done_) / s : 0;
  log::info("{}: {} in {:.1f}s ({})", what_, amount(done_, unit_), s,
            unit_ == "bytes" ? fmt::format("{:.1f} MB/s", rate / 1e6) : fmt::format("{:.1f} {}/s", rate, unit_));
}

}  // namespace dtrain

#include "core/log.h"

#include <cstdio>
#include <mutex>
#include <unistd.h>

namespace dtrain::log {

namespace {
std::mutex g_mu;
Level g_level = Level::Info;
FILE* g_file = nullptr;
int g_rank = 0;
bool g_progress_shown = false;

// Erases the progress line (the caller holds g_mu).
void clear_progress() {
  if (g_progress_shown) {
    fputs("\r\033[K", stdout);
    fflush(stdout);
    g_progress_shown = false;
  }
}
}  // namespace

bool stdout_is_terminal() {
  static const bool tty = isatty(fileno(stdout));
  return tty;
}

void progress(const std::string& line) {
  if (!stdout_is_terminal()) return;
  std::lock_guard<std::mutex> lk(g_mu);
  fmt::print(stdout, "\r{}\033[K", line);
  fflush(stdout);
  g_progress_shown = true;
}

void set_level(Level l) { g_level = l; }
Level level() { return g_rank == 0 ? g_level : Level::Warn; }
void set_rank(int r) { g_rank = r; }

void set_file(const std::string& path) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_file) fclose(g_file);
  g_file = path.empty() ? nullptr : fopen(path.c_str(), "a");
}

void write(Level l, const std::string& line) {
  static const char* tags[] = {"debug: ", "", "warning: ", "error: "};
  std::string prefix = g_rank ? fmt::format("[rank {}] ", g_rank) : "";
  std::lock_guard<std::mutex> lk(g_mu);
  clear_progress();
  fmt::print(stderr, "{}{}{}\n", prefix, tags[int(l)], line);
  fflush(stderr);
  if (g_file) {
    fmt::print(g_file, "{}{}{}\n", prefix, tags[int(l)], line);
    fflush(g_file);
  }
}

void console(const std::string& line) {
  std::lock_guard<std::mutex> lk(g_mu);
  clear_progress();
  fmt::print(stdout, "{}\n", line);
  fflush(stdout);
  if (g_file) {
    fmt::print(g_file, "{}\n", line);
    fflush(g_file);
  }
}

}  // namespace dtrain::log

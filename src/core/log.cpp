#include "core/log.h"

#include <cstdio>
#include <mutex>

namespace dtrain::log {

namespace {
std::mutex g_mu;
Level g_level = Level::Info;
FILE* g_file = nullptr;
int g_rank = 0;
}  // namespace

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
  fmt::print(stderr, "{}{}{}\n", prefix, tags[int(l)], line);
  fflush(stderr);
  if (g_file) {
    fmt::print(g_file, "{}{}{}\n", prefix, tags[int(l)], line);
    fflush(g_file);
  }
}

void console(const std::string& line) {
  std::lock_guard<std::mutex> lk(g_mu);
  fmt::print(stdout, "{}\n", line);
  fflush(stdout);
  if (g_file) {
    fmt::print(g_file, "{}\n", line);
    fflush(g_file);
  }
}

}  // namespace dtrain::log

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

std::string printable(std::string_view s) {
  std::string o;
  o.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      if (c == '\n') o += "\\n";
      else if (c == '\r') o += "\\r";
      else if (c == '\t') o += "\\t";
      else if (c < 0x20 || c == 0x7f) o += fmt::format("\\x{:02x}", unsigned(c));
      else o += char(c);
      ++i;
      continue;
    }
    // the length and the allowed range of the second byte (no overlong forms, no
    // surrogates, nothing above U+10FFFF: RFC 3629)
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    }
    bool ok = len > 0 && i + len <= n && p[i + 1] >= lo && p[i + 1] <= hi;
    for (size_t k = 2; ok && k < len; ++k) ok = p[i + k] >= 0x80 && p[i + k] <= 0xbf;
    if (ok) {
      o.append(s.data() + i, len);
      i += len;
    } else {
      o += fmt::format("\\x{:02x}", unsigned(c));
      ++i;
    }
  }
  return o;
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

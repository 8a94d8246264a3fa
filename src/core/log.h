#pragma once
// Logging through fmt. Lines go to stderr (info/warn/error) and, when a log file is set
// (train.log in the run directory), to that file too.
#include <fmt/format.h>

#include <string>
#include <string_view>

namespace dtrain::log {

// `s` as one line of valid UTF-8, for messages that quote what a file or a peer sent:
// control characters escaped (\n, \r, \t, \xNN) and every byte that is not part of a
// well-formed UTF-8 sequence shown as \xNN. Valid UTF-8 text is unchanged.
std::string printable(std::string_view s);

enum class Level { Debug = 0, Info = 1, Warn = 2, Error = 3 };

void set_level(Level l);
Level level();
void set_file(const std::string& path);  // "" closes; appends
void set_rank(int rank);                  // non-zero ranks log warnings and errors only
void write(Level l, const std::string& line);
// Writes the line to stdout and to the log file (console lines of the trainer).
void console(const std::string& line);
// A progress line redrawn in place on a terminal (never written to the log file or to a
// pipe); the next log line replaces it.
bool stdout_is_terminal();
void progress(const std::string& line);

template <typename... A>
void debug(fmt::format_string<A...> f, A&&... a) {
  if (level() <= Level::Debug) write(Level::Debug, fmt::format(f, std::forward<A>(a)...));
}
template <typename... A>
void info(fmt::format_string<A...> f, A&&... a) {
  if (level() <= Level::Info) write(Level::Info, fmt::format(f, std::forward<A>(a)...));
}
template <typename... A>
void warn(fmt::format_string<A...> f, A&&... a) {
  write(Level::Warn, fmt::format(f, std::forward<A>(a)...));
}
template <typename... A>
void error(fmt::format_string<A...> f, A&&... a) {
  write(Level::Error, fmt::format(f, std::forward<A>(a)...));
}

}  // namespace dtrain::log

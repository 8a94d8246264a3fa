#pragma once
// JSON Lines sinks (metrics.jsonl, events.jsonl): one compact JSON object per line, each
// line appended by one write(2) to an O_APPEND descriptor, so a crash loses at most the line
// being written. Opening a file whose last line was cut short (a process killed inside that
// write) drops that partial line first, so appending never glues a new object onto it.
#include <nlohmann/json.hpp>
#include <string>

namespace dtrain {

class JsonlWriter {
 public:
  explicit JsonlWriter(const std::string& path);  // append mode; RuntimeFault when it cannot open or repair
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const nlohmann::json& obj);  // one line, one write(2)
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// Current UTC time as ISO 8601 with milliseconds: "2024-05-20T12:34:56.789Z".
std::string iso8601_now();

}  // namespace dtrain

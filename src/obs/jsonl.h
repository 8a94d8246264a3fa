#pragma once
// JSON Lines sinks (metrics.jsonl, events.jsonl): one compact JSON object per line,
// appended and flushed line by line so a crash loses at most the line being written.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

namespace dtrain {

class JsonlWriter {
 public:
  explicit JsonlWriter(const std::string& path);  // append mode; RuntimeFault when it cannot open
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const nlohmann::json& obj);  // one line, then fflush
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  FILE* f_ = nullptr;
};

// Current UTC time as ISO 8601 with milliseconds: "2024-05-20T12:34:56.789Z".
std::string iso8601_now();

}  // namespace dtrain

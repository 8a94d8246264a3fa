#pragma once
// Readers of a run directory's JSON-lines files (metrics.jsonl, events.jsonl) and of the
// numbers in a command's output, shared by the end-to-end tests.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <regex>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

// Every row of a JSONL file (none when it does not exist), complete lines only: a test polling a live file can read it while a line is being
// appended, and the unterminated tail is that line's beginning.
inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream f(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  size_t pos = 0;
  for (size_t eol; (eol = text.find('\n', pos)) != std::string::npos; pos = eol + 1)
    if (eol > pos) rows.push_back(nlohmann::json::parse(text.substr(pos, eol - pos)));
  return rows;
}

// The rows of RUN_DIR/metrics.jsonl whose "kind" is `kind` ("train" | "eval").
inline std::vector<nlohmann::json> metric_rows(const std::string& run_dir, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (auto& r : read_jsonl(run_dir + "/metrics.jsonl"))
    if (r["kind"] == kind) out.push_back(r);
  return out;
}

// Field `key` of every train row, in order (a row without it fails the test).
inline std::vector<double> metric_series(const std::string& run_dir, const std::string& key) {
  std::vector<double> out;
  for (auto& r : metric_rows(run_dir, "train")) {
    REQUIRE_MESSAGE(r.contains(key), run_dir << ": a train row without " << key);
    out.push_back(r[key].get<double>());
  }
  return out;
}

// The last row of RUN_DIR/events.jsonl whose event is `event` (null when there is none).
inline nlohmann::json last_event(const std::string& run_dir, const std::string& event) {
  nlohmann::json last;
  for (auto& e : read_jsonl(run_dir + "/events.jsonl"))
    if (e.value("event", e.value("kind", "")) == event) last = e;
  return last;
}

// The logged training loss of every train row, in order.
inline std::vector<double> train_losses(const std::string& run_dir) { return metric_series(run_dir, "loss"); }

// The eval_loss of every eval row, in order.
inline std::vector<double> eval_losses(const std::string& run_dir) {
  std::vector<double> out;
  for (auto& r : metric_rows(run_dir, "eval")) out.push_back(r["eval_loss"].get<double>());
  return out;
}

// The largest relative difference of two loss lists over their common length (what the
// layout-against-one-process tests report and bound).
inline double worst_relative(const std::vector<double>& a, const std::vector<double>& b) {
  double w = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) w = std::max(w, std::fabs(a[i] - b[i]) / std::fabs(b[i]));
  return w;
}

// The names of the entries of `dir` that start with `prefix`, sorted (e.g. a run's step_*
// checkpoints, or a checkpoint's optim-* shard files).
inline std::vector<std::string> entries_with_prefix(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> out;
  for (auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The number captured by `regex`'s first group in `text` (a failed match fails the test).
inline double number_after(const std::string& text, const std::string& regex) {
  std::smatch m;
  REQUIRE_MESSAGE(std::regex_search(text, m, std::regex(regex)), text);
  return std::atof(m[1].str().c_str());
}

// Per-step losses `a` of a parallel layout against `b` of one process with the same global
// batch: `steps` of each, finite, within `rel` relative (1e-5 in f32: the reductions run in
// another order than one process's gradient accumulation; 16-bit layouts state their own).
inline void check_close(const std::string& what, const std::vector<double>& a, const std::vector<double>& b,
                        size_t steps, double rel = 1e-5) {
  INFO(what);
  REQUIRE(a.size() == steps);
  REQUIRE(b.size() == steps);
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1 << ": " << a[i] << " vs " << b[i]);
    CHECK(std::isfinite(a[i]));
    CHECK(std::abs(a[i] - b[i]) <= rel * std::abs(b[i]));
  }
}

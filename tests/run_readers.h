#pragma once
// Readers of a run directory's JSON-lines files (metrics.jsonl, events.jsonl), shared by the
// end-to-end tests.
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

// Every row of a JSONL file (none when it does not exist).
inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

// The rows of RUN_DIR/metrics.jsonl whose "kind" is `kind` ("train" | "eval").
inline std::vector<nlohmann::json> metric_rows(const std::string& run_dir, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (auto& r : read_jsonl(run_dir + "/metrics.jsonl"))
    if (r["kind"] == kind) out.push_back(r);
  return out;
}

// The logged training loss of every train row, in order.
inline std::vector<double> train_losses(const std::string& run_dir) {
  std::vector<double> out;
  for (auto& r : metric_rows(run_dir, "train")) out.push_back(r["loss"].get<double>());
  return out;
}

// Reading checkpoints back (checkpoint.h): verification against SHA256SUMS, the newest valid
// checkpoint with its fallbacks, best.json, and a path resolved to a checkpoint directory.
#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/sha256.h"
#include "checkpoint/flat_shards.h"

namespace dtrain {

namespace stdfs = std::filesystem;

namespace {

constexpr const char* kSums = CheckpointManager::kSums;
constexpr const char* kState = CheckpointManager::kState;
constexpr const char* kLatest = CheckpointManager::kLatest;
constexpr const char* kBest = CheckpointManager::kBest;

bool is_hex64(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// A file name listed in SHA256SUMS or `latest` must be a plain entry of the directory.
bool plain_name(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos && s.find('\0') == std::string::npos;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

}  // namespace

void CheckpointManager::mark_best(const std::string& ckpt_dir, const nlohmann::json& fields) const {
  nlohmann::json j = fields;
  j["checkpoint"] = fs::base_name(ckpt_dir);
  fs::write_file_atomic(checkpoints_dir() + "/" + kBest, j.dump() + "\n");
}

std::string CheckpointManager::best_json() const {
  const std::string path = checkpoints_dir() + "/" + kBest;
  if (!fs::exists(path)) return "";
  try {
    std::string text = fs::read_file(path);
    if (!nlohmann::json::parse(text).is_object()) return "";
    return text;
  } catch (const std::exception&) {
    return "";
  }
}

std::string CheckpointManager::best_dir() const {
  const std::string text = best_json();
  if (text.empty()) return "";
  const nlohmann::json j = nlohmann::json::parse(text);
  const std::string name = j.contains("checkpoint") && j["checkpoint"].is_string() ? j["checkpoint"].get<std::string>() : "";
  if (!plain_name(name) || step_of(name) < 0) return "";
  return checkpoints_dir() + "/" + name;
}

std::string CheckpointManager::verify(const std::string& ckpt_dir) {
  if (!fs::exists(ckpt_dir)) return "directory missing";
  if (!fs::is_dir(ckpt_dir)) return "not a directory";
  const std::string sums_path = ckpt_dir + "/" + kSums;
  if (!fs::exists(sums_path)) return std::string(kSums) + ": missing";
  std::string sums;
  try {
    sums = fs::read_file(sums_path, 1 << 20);
  } catch (const Error& e) {
    return std::string(kSums) + ": unreadable";
  }
  std::istringstream in(sums);
  std::string line;
  int lineno = 0;
  bool has_state = false;
  std::vector<std::pair<std::string, std::string>> entries;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    // sha256sum format: "<64 hex>  <name>" (text mode) or "<64 hex> *<name>" (binary mode)
    if (line.size() < 67 || line[64] != ' ' || (line[65] != ' ' && line[65] != '*') || !is_hex64(line.substr(0, 64)))
      return fmt::format("{}: line {} is not '<sha256>  <file>'", kSums, lineno);
    std::string file = line.substr(66);
    if (!plain_name(file)) return fmt::format("{}: line {} names '{}', not a file of the checkpoint", kSums, lineno, file);
    if (file == kState) has_state = true;
    entries.emplace_back(line.substr(0, 64), file);
  }
  if (entries.empty()) return std::string(kSums) + ": empty";
  // every file of the checkpoint is covered: a file left out of SHA256SUMS (the weights, say)
  // would be read unchecked
  {
    std::set<std::string> listed;
    for (const auto& e : entries) listed.insert(e.second);
    std::error_code ec;
    for (const auto& de : std::filesystem::directory_iterator(ckpt_dir, ec)) {
      const std::string name = de.path().filename().string();
      if (name != kSums && !listed.count(name)) return fmt::format("{}: not listed in {}", name, kSums);
    }
  }
  Progress progress("verify " + ckpt_dir, int64_t(entries.size()), "files");  // quiet unless it takes long
  for (const auto& [hex, file] : entries) {
    progress.add(1);
    std::string p = ckpt_dir + "/" + file;
    if (!fs::exists(p)) return file + ": missing";
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec)) return file + ": not a regular file";
    std::string got;
    try {
      got = sha256_file(p);
    } catch (const Error&) {
      return file + ": unreadable";
    }
    if (got != hex) return file + ": checksum mismatch";
  }
  progress.finish();
  if (!has_state) return std::string(kState) + ": not listed in " + kSums;
  std::string state;
  try {
    state = fs::read_file(ckpt_dir + "/" + kState, 64 << 20);
  } catch (const Error&) {
    return std::string(kState) + ": unreadable";
  }
  const auto j = nlohmann::json::parse(state, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::string(kState) + ": not valid JSON";
  // The optimizer files and the ZeRO-3 model files: all N present and consistent (a set of
  // shards written by N ranks is one checkpoint only when every shard is there).
  int expected_shards = -1, model_shards = -1;
  // the step, which must be the one the directory is named for (a resume from a step 0 written
  // into step_00000012 would train over the checkpoints after step 0)
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer() || j["step"].get<int64_t>() < 0)
    return std::string(kState) + ": step is not a non-negative integer";
  if (const int64_t named = step_of(ckpt_dir); named >= 0 && named != j["step"].get<int64_t>())
    return fmt::format("{}: step {} is not the directory's ({})", kState, j["step"].get<int64_t>(),
                       fs::base_name(ckpt_dir));
  if (j.is_object() && j.contains("optimizer") && j["optimizer"].is_object()) {
    const auto& o = j["optimizer"];
    if (!o.contains("shards") || !o["shards"].is_number_integer() || o["shards"].get<int64_t>() < 1)
      return std::string(kState) + ": optimizer.shards is not a positive integer";
    expected_shards = o["shards"].get<int>();
  }
  if (j.is_object() && j.contains("model") && j["model"].is_object() && j["model"].contains("shards")) {
    const auto& m = j["model"]["shards"];
    if (!m.is_number_integer() || m.get<int64_t>() < 1 || m.get<int64_t>() > (1 << 30))
      return std::string(kState) + ": model.shards is not a positive integer";
    model_shards = m.get<int>();
  }
  if (std::string p = flat_shards_problem(ckpt_dir, FlatKind::Optimizer, expected_shards); !p.empty()) return p;
  return flat_shards_problem(ckpt_dir, FlatKind::Model, model_shards);
}

std::string CheckpointManager::latest_valid(std::vector<std::string>* notes) const {
  const std::string cdir = checkpoints_dir();
  std::vector<std::string> skipped;  // "checkpoints/<name>: <problem>"
  auto finish = [&](const std::string& chosen) {
    if (notes) {
      std::string tail = chosen.empty() ? "no valid checkpoint left" : "falling back to " + fs::base_name(chosen);
      for (const auto& s : skipped) notes->push_back(s + "; " + tail);
    }
    return chosen;
  };

  std::string tried;
  const std::string latest_path = cdir + "/" + kLatest;
  if (fs::exists(latest_path)) {
    std::string name;
    try {
      name = trim(fs::read_file(latest_path, 4096));
    } catch (const Error&) {
      skipped.push_back("checkpoints/latest: unreadable");
    }
    if (!name.empty() || skipped.empty()) {
      if (!plain_name(name) || step_of(name) < 0) {
        skipped.push_back(fmt::format("checkpoints/latest: names '{}', not a step_* directory", name));
      } else {
        tried = name;
        std::string problem = verify(cdir + "/" + name);
        if (problem.empty()) return finish(cdir + "/" + name);
        skipped.push_back("checkpoints/" + name + ": " + problem);
      }
    }
  } else if (!list().empty()) {
    skipped.push_back("checkpoints/latest: missing");
  }

  std::vector<std::string> all = list();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    std::string name = fs::base_name(*it);
    if (name == tried) continue;
    std::string problem = verify(*it);
    if (problem.empty()) return finish(*it);
    skipped.push_back("checkpoints/" + name + ": " + problem);
  }
  return finish("");
}

// A checkpoint directory, RUN_DIR/checkpoints/best (checkpoint.keep_best), or a run
// directory (its newest valid checkpoint).
std::string resolve_checkpoint_dir(const std::string& path_in) {
  std::string path = path_in;
  // RUN_DIR/checkpoints/best: the checkpoint best.json names (checkpoint.keep_best)
  const stdfs::path p(path);
  if (!stdfs::exists(path) && p.filename() == "best" && stdfs::exists(p.parent_path() / "best.json")) {
    path = CheckpointManager(p.parent_path().parent_path().string()).best_dir();
    if (path.empty()) user_error("{}: best.json does not name a checkpoint", (p.parent_path() / "best.json").string());
  }
  if (!stdfs::exists(path)) user_error("checkpoint {} does not exist", path);
  if (stdfs::exists(path + "/model.safetensors") || stdfs::exists(path + "/SHA256SUMS")) {
    std::string problem = CheckpointManager::verify(path);
    if (!problem.empty()) user_error("checkpoint {} failed verification: {}", path, problem);
    return path;
  }
  if (stdfs::is_directory(path + "/checkpoints")) {
    std::vector<std::string> notes;
    std::string ck = CheckpointManager(path).latest_valid(&notes);
    for (auto& n : notes) log::warn("{}", n);
    if (ck.empty()) user_error("{}: no valid checkpoint under {}/checkpoints", path, path);
    return ck;
  }
  user_error("{} is neither a checkpoint directory (model.safetensors, SHA256SUMS) nor a run directory", path);
}


}  // namespace dtrain

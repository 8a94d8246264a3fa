#include "train/checkpoint.h"

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
#include "train/flat_shards.h"

namespace dtrain {

namespace stdfs = std::filesystem;

namespace {

constexpr const char* kSums = "SHA256SUMS";
constexpr const char* kState = "state.json";
constexpr const char* kLatest = "latest";
constexpr const char* kBest = "best.json";

std::function<void(const std::string&)>& test_hook() {
  static std::function<void(const std::string&)> h;
  return h;
}
void stage(const char* s) {
  if (test_hook()) test_hook()(s);
}

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

// Is the process that owns a ".tmp-...-<pid>" dir still running?
bool owner_alive(const std::string& name) {
  size_t dash = name.find_last_of('-');
  if (dash == std::string::npos) return false;
  std::string digits = name.substr(dash + 1);
  if (digits.empty() || digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  pid_t pid = pid_t(std::stol(digits));
  if (pid == ::getpid()) return true;
  return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM);
}

}  // namespace

CheckpointManager::CheckpointManager(std::string run_dir) : run_dir_(std::move(run_dir)) {
  while (run_dir_.size() > 1 && run_dir_.back() == '/') run_dir_.pop_back();
}

void CheckpointManager::set_test_hook(std::function<void(const std::string&)> hook) {
  test_hook() = std::move(hook);
}

std::string CheckpointManager::dir_name(int64_t step) {
  DTRAIN_CHECK(step >= 0, "negative checkpoint step {}", step);
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", (long long)step);
  return buf;
}

int64_t CheckpointManager::step_of(const std::string& dir_or_name) {
  std::string n = fs::base_name(dir_or_name);
  if (n.size() < 6 || n.compare(0, 5, "step_") != 0 || n.size() > 5 + 18) return -1;
  for (size_t i = 5; i < n.size(); ++i)
    if (n[i] < '0' || n[i] > '9') return -1;
  return std::stoll(n.substr(5));
}

std::vector<std::string> CheckpointManager::list() const {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  const std::string cdir = checkpoints_dir();
  for (stdfs::directory_iterator it(cdir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    int64_t s = step_of(name);
    if (s >= 0 && it->is_directory()) found.emplace_back(s, cdir + "/" + name);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

void CheckpointManager::clean_stale_tmp() const {
  std::error_code ec;
  const std::string cdir = checkpoints_dir();
  std::vector<std::string> stale;
  for (stdfs::directory_iterator it(cdir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 && !owner_alive(name)) stale.push_back(cdir + "/" + name);
    // `latest` temporaries of dead processes (latest.tmp-<pid>)
    if (name.rfind(std::string(kLatest) + ".tmp-", 0) == 0 && !owner_alive(name)) stale.push_back(cdir + "/" + name);
  }
  for (const auto& p : stale) fs::remove_tree(p);
}

std::string CheckpointManager::begin(int64_t step) {
  const std::string cdir = checkpoints_dir();
  fs::mkdirs(cdir);
  clean_stale_tmp();
  std::string tmp = cdir + "/.tmp-" + dir_name(step) + "-" + std::to_string(::getpid());
  fs::remove_tree(tmp);
  fs::mkdirs(tmp);
  return tmp;
}

std::string CheckpointManager::commit(int64_t step, const std::string& tmpdir, int keep_last) {
  const std::string cdir = checkpoints_dir();
  const std::string name = dir_name(step);
  const std::string final_dir = cdir + "/" + name;
  stage("written");

  // The checkpoint must pass verify() by construction: state.json present and JSON.
  const std::string state = tmpdir + "/" + kState;
  if (!fs::exists(state)) fault("checkpoint {}: the writer did not create {}", name, kState);
  if (!nlohmann::json::accept(fs::read_file(state)))
    fault("checkpoint {}: {} written by the trainer is not valid JSON", name, kState);

  // fsync every file, then hash it by reading it back (so SHA256SUMS describes exactly the
  // bytes that reached the file system).
  std::vector<std::string> files;
  std::error_code ec;
  for (stdfs::directory_iterator it(tmpdir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string f = it->path().filename().string();
    if (f == kSums) continue;
    if (!it->is_regular_file()) fault("checkpoint {}: {} is not a regular file (checkpoints hold files only)", name, f);
    files.push_back(f);
  }
  if (ec) fault("cannot list {}: {}", tmpdir, ec.message());
  std::sort(files.begin(), files.end());
  std::string sums;
  for (const auto& f : files) {
    fs::fsync_path(tmpdir + "/" + f);
    sums += sha256_file(tmpdir + "/" + f) + "  " + f + "\n";
  }
  fs::write_file(tmpdir + "/" + kSums, sums);
  fs::fsync_dir(tmpdir);
  stage("summed");

  // Move into place. If step_N already exists (a re-save of the same step), swap the two
  // atomically so that name always refers to a complete checkpoint, then drop the old one.
  if (fs::exists(final_dir)) {
    if (::renameat2(AT_FDCWD, tmpdir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      fs::fsync_dir(cdir);
      fs::remove_tree(tmpdir);  // now holds the old checkpoint
    } else {
      // File system without RENAME_EXCHANGE: move the old one aside first.
      std::string aside = cdir + "/.tmp-del-" + name + "-" + std::to_string(::getpid());
      fs::remove_tree(aside);
      fs::rename_path(final_dir, aside);
      fs::rename_path(tmpdir, final_dir);
      fs::fsync_dir(cdir);
      fs::remove_tree(aside);
    }
  } else {
    fs::rename_path(tmpdir, final_dir);
    fs::fsync_dir(cdir);
  }
  stage("renamed");

  fs::write_file_atomic(cdir + "/" + kLatest, name + "\n");
  stage("latest");

  prune(step, keep_last);
  stage("pruned");
  return final_dir;
}

std::string CheckpointManager::save(int64_t step, const std::function<void(const std::string&)>& write,
                                    int keep_last) {
  std::string tmp = begin(step);
  write(tmp);
  return commit(step, tmp, keep_last);
}

void CheckpointManager::prune(int64_t just_written, int keep_last) const {
  if (keep_last <= 0) return;
  std::vector<std::string> all = list();
  // Keep the newest keep_last by step, plus the one just written (complete and hashed
  // from its own bytes, so it is always a verified checkpoint that survives).
  size_t n = all.size();
  const std::string best = best_dir();
  std::vector<std::string> doomed;
  for (size_t i = 0; i < n; ++i) {
    bool newest = i + size_t(keep_last) >= n;
    if (!newest && step_of(all[i]) != just_written && all[i] != best) doomed.push_back(all[i]);
  }
  const std::string cdir = checkpoints_dir();
  for (const auto& d : doomed) {
    // Rename first so a crash mid-delete never leaves a half-deleted step_* dir behind.
    std::string trash = cdir + "/.tmp-del-" + fs::base_name(d) + "-" + std::to_string(::getpid());
    fs::remove_tree(trash);
    fs::rename_path(d, trash);
    fs::remove_tree(trash);
  }
  if (!doomed.empty()) fs::fsync_dir(cdir);
}

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

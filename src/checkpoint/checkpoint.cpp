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

std::function<void(const std::string&)>& test_hook() {
  static std::function<void(const std::string&)> h;
  return h;
}
void stage(const char* s) {
  if (test_hook()) test_hook()(s);
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

}  // namespace dtrain

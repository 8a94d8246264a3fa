// Checkpoint directories: atomic commit, checksums, verification, fallback, pruning and
// a SIGKILL-during-save fault test.
#include <doctest/doctest.h>
#include "test_util.h"
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "core/fsutil.h"
#include "core/sha256.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"

using namespace dtrain;
using test_util::TmpDir;

namespace {

// A trainer-like writer: model.safetensors with `n` floats derived from step, and state.json.
std::function<void(const std::string&)> writer(int64_t step, size_t n = 64) {
  return [step, n](const std::string& dir) {
    std::vector<float> w(n);
    for (size_t i = 0; i < n; ++i) w[i] = float(step) + float(i) * 0.001f;
    write_safetensors(dir + "/model.safetensors", {{"w", "F32", {int64_t(n)}, w.data(), n * 4}}, {});
    fs::write_file(dir + "/state.json", nlohmann::json{{"step", step}}.dump());
  };
}

int64_t state_step(const std::string& dir) {
  return nlohmann::json::parse(fs::read_file(dir + "/state.json"))["step"].get<int64_t>();
}

std::string latest_name(const std::string& run) {
  std::string s = fs::read_file(run + "/checkpoints/latest");
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

void flip_byte(const std::string& path, size_t at) {
  std::string b = fs::read_file(path);
  REQUIRE(at < b.size());
  b[at] = char(b[at] ^ 0x5a);
  fs::write_file(path, b);
}

std::vector<std::string> tmp_entries(const std::string& cdir) {
  std::vector<std::string> out;
  for (auto& e : std::filesystem::directory_iterator(cdir)) {
    std::string n = e.path().filename().string();
    if (n.rfind(".tmp-", 0) == 0 || n.find(".tmp-") != std::string::npos) out.push_back(n);
  }
  return out;
}

}  // namespace

TEST_SUITE("unit") {
// verify covers the whole directory: a file SHA256SUMS does not list (it would be read
// unchecked), a listed name that is not a regular file (a link to /dev/zero would never end
// hashing), and a state.json whose step is not the directory's (resuming it would write over
// the later checkpoints) each make the checkpoint invalid, and latest_valid falls back.
TEST_CASE("checkpoint: verify refuses unlisted files and non-regular files and a state step that is not the directory's") {
  TmpDir t;
  CheckpointManager m(t.path);
  const std::string d10 = m.save(10, writer(10), 5), d20 = m.save(20, writer(20), 5);
  REQUIRE(CheckpointManager::verify(d20) == "");
  auto rewrite_sums = [&](const std::string& d, const std::vector<std::string>& files) {
    std::string sums;
    for (const auto& f : files) sums += sha256_file(d + "/" + f) + "  " + f + "\n";
    fs::write_file(d + "/SHA256SUMS", sums);
  };
  rewrite_sums(d20, {"state.json"});  // the weights left out
  CHECK(CheckpointManager::verify(d20) == "model.safetensors: not listed in SHA256SUMS");
  std::vector<std::string> notes;
  CHECK(m.latest_valid(&notes) == d10);
  fs::write_file(d20 + "/state.json", nlohmann::json{{"step", 0}}.dump());
  rewrite_sums(d20, {"state.json", "model.safetensors"});
  CHECK(CheckpointManager::verify(d20) == "state.json: step 0 is not the directory's (step_00000020)");
  fs::write_file(d20 + "/state.json", nlohmann::json{{"step", -3}}.dump());
  rewrite_sums(d20, {"state.json", "model.safetensors"});
  CHECK(CheckpointManager::verify(d20) == "state.json: step is not a non-negative integer");
  fs::write_file(d20 + "/state.json", nlohmann::json{{"step", 20}}.dump());
  rewrite_sums(d20, {"state.json", "model.safetensors"});
  CHECK(CheckpointManager::verify(d20) == "");
  std::filesystem::remove(d20 + "/model.safetensors");
  std::filesystem::create_symlink("/dev/zero", d20 + "/model.safetensors");
  CHECK(CheckpointManager::verify(d20) == "model.safetensors: not a regular file");
  CHECK(m.latest_valid(nullptr) == d10);
  // a `latest` that never ends is read no further than a name can be
  std::filesystem::remove(t.path + "/checkpoints/latest");
  std::filesystem::create_symlink("/dev/zero", t.path + "/checkpoints/latest");
  CHECK(m.latest_valid(nullptr) == d10);
}

TEST_CASE("checkpoint: names") {
  CHECK(CheckpointManager::dir_name(1000) == "step_00001000");
  CHECK(CheckpointManager::dir_name(123456789) == "step_123456789");
  CHECK(CheckpointManager::step_of("runs/x/checkpoints/step_00000200") == 200);
  CHECK(CheckpointManager::step_of("step_") == -1);
  CHECK(CheckpointManager::step_of("step_12a") == -1);
  CHECK(CheckpointManager::step_of(".tmp-step_00000001-12") == -1);
}

TEST_CASE("checkpoint: save verify prune latest and the sha256sum format") {
  TmpDir t;
  CheckpointManager m(t.path);
  CHECK(m.latest_valid(nullptr).empty());
  CHECK(m.list().empty());
  for (int64_t s : {10, 20, 30, 40}) {
    std::string d = m.save(s, writer(s), 2);
    CHECK(d == t.path + "/checkpoints/" + CheckpointManager::dir_name(s));
    CHECK(CheckpointManager::verify(d) == "");
    CHECK(latest_name(t.path) == CheckpointManager::dir_name(s));
  }
  auto l = m.list();
  REQUIRE(l.size() == 2);
  CHECK(l[0] == t.path + "/checkpoints/step_00000030");
  CHECK(l[1] == t.path + "/checkpoints/step_00000040");
  std::vector<std::string> notes;
  CHECK(m.latest_valid(&notes) == l[1]);
  CHECK(notes.empty());
  CHECK(state_step(l[1]) == 40);
  CHECK(tmp_entries(t.path + "/checkpoints").empty());

  // SHA256SUMS is exactly what coreutils sha256sum writes and checks.
  std::string sums = fs::read_file(l[1] + "/SHA256SUMS");
  CHECK(sums.find("  model.safetensors\n") == 64);
  CHECK(std::system(("cd " + l[1] + " && sha256sum --check --status --strict SHA256SUMS").c_str()) == 0);
  flip_byte(l[1] + "/state.json", 2);
  CHECK(std::system(("cd " + l[1] + " && sha256sum --check --status SHA256SUMS").c_str()) != 0);

  // keep_last <= 0 keeps everything
  m.save(50, writer(50), 0);
  CHECK(m.list().size() == 3);
  // the one just written survives pruning even when it is not among the newest steps
  m.save(45, writer(45), 1);
  l = m.list();
  REQUIRE(l.size() == 2);
  CHECK(CheckpointManager::step_of(l[0]) == 45);
  CHECK(CheckpointManager::step_of(l[1]) == 50);
  CHECK(m.latest_valid(nullptr) == l[0]);  // `latest` names step 45
}

TEST_CASE("checkpoint: best.json names a checkpoint that pruning keeps - unless it is unreadable") {
  TmpDir t;
  CheckpointManager m(t.path);
  CHECK(m.best_json().empty());
  CHECK(m.best_dir().empty());
  m.save(1, writer(1), 1);
  const std::string two = m.save(2, writer(2), 1);
  m.mark_best(two, {{"step", 2}, {"metric", "eval_accuracy"}, {"mode", "max"}, {"value", 0.5}});
  CHECK(m.best_dir() == two);
  CHECK(nlohmann::json::parse(m.best_json())["checkpoint"] == "step_00000002");
  for (int64_t s : {3, 4}) m.save(s, writer(s), 1);
  auto l = m.list();
  REQUIRE(l.size() == 2);  // keep_last 1: the newest, and the best
  CHECK(l[0] == two);
  CHECK(CheckpointManager::step_of(l[1]) == 4);
  // best.json cut short by a crash (it is written atomically, but by hand anything goes):
  // nothing is protected any more, and nothing is misread
  fs::write_file(t.path + "/checkpoints/best.json", "{\"checkpoint\": \"step_000");
  CHECK(m.best_json().empty());
  CHECK(m.best_dir().empty());
  m.save(5, writer(5), 1);
  CHECK(m.list().size() == 1);
  // a name that is not one of this run's step directories is ignored too
  fs::write_file(t.path + "/checkpoints/best.json", R"({"checkpoint": "../../etc"})");
  CHECK(m.best_dir().empty());
}

TEST_CASE("checkpoint: re-saving an existing step replaces it atomically") {
  TmpDir t;
  CheckpointManager m(t.path);
  m.save(7, writer(7), 3);
  std::string d = m.save(7, [](const std::string& dir) {
    writer(7)(dir);
    fs::write_file(dir + "/extra.bin", std::string("second"));
  }, 3);
  CHECK(CheckpointManager::verify(d) == "");
  CHECK(fs::exists(d + "/extra.bin"));
  CHECK(m.list().size() == 1);
  CHECK(tmp_entries(t.path + "/checkpoints").empty());
}

TEST_CASE("checkpoint: the writer must produce a valid state.json") {
  TmpDir t;
  CheckpointManager m(t.path);
  CHECK_THROWS_AS(m.save(1, [](const std::string& dir) { fs::write_file(dir + "/model.bin", std::string("x")); }, 2),
                  RuntimeFault);
  CHECK_THROWS_AS(m.save(1, [](const std::string& dir) { fs::write_file(dir + "/state.json", std::string("{bad")); }, 2),
                  RuntimeFault);
  CHECK(m.list().empty());
  CHECK(m.latest_valid(nullptr).empty());
}

TEST_CASE("checkpoint: corruption is detected and latest_valid falls back with a note") {
  TmpDir t;
  CheckpointManager m(t.path);
  m.save(100, writer(100), 5);
  std::string d200 = m.save(200, writer(200), 5);
  std::string d100 = t.path + "/checkpoints/step_00000100";
  std::vector<std::string> notes;

  SUBCASE("flipped byte") {
    flip_byte(d200 + "/model.safetensors", 100);
    CHECK(CheckpointManager::verify(d200) == "model.safetensors: checksum mismatch");
    CHECK(m.latest_valid(&notes) == d100);
    REQUIRE(notes.size() == 1);
    CHECK(notes[0] == "checkpoints/step_00000200: model.safetensors: checksum mismatch; falling back to step_00000100");
  }
  SUBCASE("truncated file") {
    std::filesystem::resize_file(d200 + "/model.safetensors", 40);
    CHECK(CheckpointManager::verify(d200) == "model.safetensors: checksum mismatch");
    CHECK(m.latest_valid(&notes) == d100);
    CHECK(notes.size() == 1);
  }
  SUBCASE("missing file") {
    std::filesystem::remove(d200 + "/model.safetensors");
    CHECK(CheckpointManager::verify(d200) == "model.safetensors: missing");
    CHECK(m.latest_valid(&notes) == d100);
    CHECK(notes.size() == 1);
  }
  SUBCASE("missing SHA256SUMS") {
    std::filesystem::remove(d200 + "/SHA256SUMS");
    CHECK(CheckpointManager::verify(d200) == "SHA256SUMS: missing");
    CHECK(m.latest_valid(&notes) == d100);
    CHECK(notes.at(0) == "checkpoints/step_00000200: SHA256SUMS: missing; falling back to step_00000100");
  }
  SUBCASE("malformed SHA256SUMS") {
    fs::write_file(d200 + "/SHA256SUMS", std::string("nonsense\n"));
    CHECK(CheckpointManager::verify(d200) == "SHA256SUMS: line 1 is not '<sha256>  <file>'");
    fs::write_file(d200 + "/SHA256SUMS", std::string(64, 'a') + "  ../../etc/passwd\n");
    CHECK(CheckpointManager::verify(d200).find("not a file of the checkpoint") != std::string::npos);
    CHECK(m.latest_valid(&notes) == d100);
  }
  SUBCASE("state.json not JSON though its checksum matches") {
    fs::write_file(d200 + "/state.json", std::string("{not json"));
    std::string sums = fs::read_file(d200 + "/SHA256SUMS");
    std::string fixed;
    for (size_t pos = 0; pos < sums.size();) {
      size_t e = sums.find('\n', pos);
      std::string line = sums.substr(pos, e - pos);
      if (line.find("state.json") != std::string::npos)
        line = sha256_file(d200 + "/state.json") + "  state.json";
      fixed += line + "\n";
      pos = e + 1;
    }
    fs::write_file(d200 + "/SHA256SUMS", fixed);
    CHECK(CheckpointManager::verify(d200) == "state.json: not valid JSON");
  }
  SUBCASE("latest names a deleted directory") {
    std::filesystem::remove_all(d200);
    CHECK(CheckpointManager::verify(d200) == "directory missing");
    CHECK(m.latest_valid(&notes) == d100);
    CHECK(notes.at(0) == "checkpoints/step_00000200: directory missing; falling back to step_00000100");
  }
  SUBCASE("latest garbage") {
    fs::write_file(t.path + "/checkpoints/latest", std::string("../../elsewhere\n"));
    CHECK(m.latest_valid(&notes) == d200);
    CHECK(notes.size() == 1);
  }
  SUBCASE("latest missing") {
    std::filesystem::remove(t.path + "/checkpoints/latest");
    CHECK(m.latest_valid(&notes) == d200);
    CHECK(notes.at(0) == "checkpoints/latest: missing; falling back to step_00000200");
  }
  SUBCASE("nothing valid") {
    flip_byte(d200 + "/model.safetensors", 100);
    flip_byte(d100 + "/state.json", 1);
    CHECK(m.latest_valid(&notes) == "");
    REQUIRE(notes.size() == 2);
    CHECK(notes[0] == "checkpoints/step_00000200: model.safetensors: checksum mismatch; no valid checkpoint left");
    CHECK(notes[1] == "checkpoints/step_00000100: state.json: checksum mismatch; no valid checkpoint left");
  }
}

TEST_CASE("checkpoint: leftover .tmp dirs are ignored and cleaned by the next save") {
  TmpDir t;
  CheckpointManager m(t.path);
  std::string d1 = m.save(1, writer(1), 3);
  // A dead process's pid: fork a child that exits at once.
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  REQUIRE(dead > 0);
  waitpid(dead, nullptr, 0);
  std::string stale = t.path + "/checkpoints/.tmp-step_00000002-" + std::to_string(dead);
  fs::mkdirs(stale);
  writer(2)(stale);  // complete files but no SHA256SUMS and never renamed
  std::string live = t.path + "/checkpoints/.tmp-step_00000003-" + std::to_string(getppid());
  fs::mkdirs(live);  // owned by a live process: must be left alone
  CHECK(m.list().size() == 1);
  CHECK(m.latest_valid(nullptr) == d1);
  m.save(4, writer(4), 3);
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(live));
  CHECK(m.list().size() == 2);
}
}

TEST_SUITE("integration") {
TEST_CASE("checkpoint: SIGKILL at any instant of a save leaves a valid checkpoint") {
  TmpDir t;
  const std::string run = t.path;
  const size_t big = size_t(1) << 20;  // floats: 4 MiB model file
  CheckpointManager m(run);
  auto t0 = std::chrono::steady_clock::now();
  m.save(0, writer(0, big), 2);
  double save_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("one 4 MiB checkpoint save takes " << save_us / 1000 << " ms");

  const char* stages[] = {"written", "summed", "renamed", "latest", "pruned"};
  std::mt19937 rng(1234);
  int completed = 0;
  for (int i = 0; i < 20; ++i) {
    const int64_t step = 100 * (i + 1);
    const std::string prev_latest = latest_name(run);
    // Even iterations stop at a named commit stage, odd ones at a random instant.
    const std::string target = i % 2 == 0 ? stages[(i / 2) % 5] : "";
    int pfd[2];
    REQUIRE(pipe(pfd) == 0);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      close(pfd[0]);
      CheckpointManager::set_test_hook([&](const std::string& s) {
        if (s == target) {
          if (write(pfd[1], "x", 1) != 1) _exit(4);
          for (;;) pause();
        }
      });
      try {
        CheckpointManager(run).save(step, writer(step, big), 2);
      } catch (...) {
        _exit(3);
      }
      _exit(0);
    }
    close(pfd[1]);
    if (!target.empty()) {
      char c;
      REQUIRE(read(pfd[0], &c, 1) == 1);  // the child reached the stage
    } else {
      std::uniform_real_distribution<double> d(0.0, 1.3 * save_us);
      usleep(useconds_t(d(rng)));
    }
    kill(pid, SIGKILL);
    int st = 0;
    REQUIRE(waitpid(pid, &st, 0) == pid);
    close(pfd[0]);
    if (WIFEXITED(st)) {
      CHECK(WEXITSTATUS(st) == 0);
      ++completed;
    }
    INFO("iteration " << i << " stage '" << target << "'");
    std::vector<std::string> notes;
    std::string v = m.latest_valid(&notes);
    REQUIRE(!v.empty());
    CHECK(CheckpointManager::verify(v) == "");
    CHECK(notes.empty());  // `latest` always names a complete checkpoint
    CHECK(CheckpointManager::verify(run + "/checkpoints/" + latest_name(run)) == "");
    if (target == "written" || target == "summed" || target == "renamed") {
      CHECK(latest_name(run) == prev_latest);
    } else if (target == "latest" || target == "pruned") {
      CHECK(latest_name(run) == CheckpointManager::dir_name(step));
    }
    if (target == "renamed") CHECK(CheckpointManager::verify(run + "/checkpoints/" + CheckpointManager::dir_name(step)) == "");
    // every step_* dir that exists is complete (renames are atomic, deletes go through .tmp-del-*)
    for (const auto& d : m.list()) CHECK(CheckpointManager::verify(d) == "");
  }
  MESSAGE(completed << " of 10 randomly timed saves finished before the kill");
  // The next save cleans every leftover of the killed writers.
  m.save(5000, writer(5000), 2);
  CHECK(tmp_entries(run + "/checkpoints").empty());
  CHECK(m.list().size() == 2);
}
}

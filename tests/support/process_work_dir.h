#pragma once
// A work directory of this test process: DTRAIN_BUILD_DIR/<name>/<pid>, removed when the
// process exits. ctest -j runs test cases of one file in parallel processes; files whose test
// cases share runs made once per process (a reference run, a layout's run) must not share a
// directory, or one process re-creating a run deletes it under another.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

inline std::string process_work_dir(const std::string& name) {
  struct Cleanup {
    std::vector<std::string> dirs;
    ~Cleanup() {
      std::error_code ec;
      for (const auto& d : dirs) std::filesystem::remove_all(d, ec);
    }
  };
  static Cleanup cleanup;
  const std::string dir = std::string(DTRAIN_BUILD_DIR) + "/" + name + "/" + std::to_string(::getpid());
  cleanup.dirs.push_back(dir);
  return dir;
}

#pragma once
// The first Fashion-MNIST shard of each split (2000 samples), converted once per build
// directory into DTRAIN_BUILD_DIR/test_train/fmnist by the real `dtrain data fashion-mnist`.
// ctest runs test cases as parallel processes, so the conversion happens under a file lock.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "run_cmd.h"

inline const std::string& fmnist_slice() {
  static const std::string dir = [] {
    const std::string base = std::string(DTRAIN_BUILD_DIR) + "/test_train";
    const std::string d = base + "/fmnist";
    std::filesystem::create_directories(base);
    int fd = open((base + "/.dataset.lock").c_str(), O_CREAT | O_RDWR, 0644);
    REQUIRE(fd >= 0);
    flock(fd, LOCK_EX);
    if (!std::filesystem::exists(d + "/manifest.json")) {
      // $DTRAIN_FMNIST_SRC: the IDX files elsewhere than Debian's package (a GPU machine)
      const char* src = std::getenv("DTRAIN_FMNIST_SRC");
      const std::string from = src && *src ? " --src " + shell_quote(src) : "";
      auto r = run_cmd(dtrain_bin() + " data fashion-mnist" + from + " --out " + d + " --shard-size 2000");
      REQUIRE_MESSAGE(r.code == 0, r.all());
    }
    flock(fd, LOCK_UN);
    close(fd);
    return d;
  }();
  return dir;
}

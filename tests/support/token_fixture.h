#pragma once
// A few KB of this repository's source, byte-tokenized once into WORK/tokens (under a file
// lock: ctest runs test cases as parallel processes); returns that directory.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "run_cmd.h"

inline std::string byte_tokens(const std::string& work) {
  namespace stdfs = std::filesystem;
  const std::string src = DTRAIN_SOURCE_DIR;
  stdfs::create_directories(work);
  const std::string d = work + "/tokens";
  const int fd = open((work + "/.lock").c_str(), O_CREAT | O_RDWR, 0644);
  REQUIRE(fd >= 0);
  flock(fd, LOCK_EX);
  if (!stdfs::exists(d + "/manifest.json")) {
    auto r = run_cmd(shell_quote(dtrain_bin()) + " data tokenize " + src + "/src/session/step.cpp " + src +
                     "/src/session/session.cpp --out " + d + " --tokenizer byte --val-fraction 0.2");
    CHECK_MESSAGE(r.code == 0, r.all());
  }
  flock(fd, LOCK_UN);
  close(fd);
  return d;
}

#pragma once
// Small helpers shared by the unit tests: a temporary directory removed at scope exit, and
// a Python script run with the project's venv (the real ecosystem readers).
#include <doctest/doctest.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "core/fsutil.h"

namespace test_util {

struct TmpDir {
  std::string path;
  TmpDir() {
    char tmpl[] = "/tmp/dtrain_test_XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TmpDir() { std::filesystem::remove_all(path); }
  TmpDir(const TmpDir&) = delete;
  TmpDir& operator=(const TmpDir&) = delete;
};

// Writes `script` to DIR/script.py, runs it with the venv's python, returns its output
// (stdout and stderr); a non-zero exit fails the test with the output shown.
inline std::string run_python(const std::string& dir, const std::string& script) {
  std::string py = dir + "/script.py";
  dtrain::fs::write_file(py, script);
  std::string cmd = std::string(DTRAIN_SOURCE_DIR "/.venv/bin/python ") + py + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int rc = pclose(p);
  INFO("python output: " << out);
  REQUIRE(rc == 0);
  return out;
}

}  // namespace test_util

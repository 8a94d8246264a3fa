// Helpers of the image-dataset tests (test_data.cpp, test_image_size.cpp): a fresh directory
// under the build tree, a command's output, whole files written and read, a UserError
// expected, the loader options of a converted dataset.
#pragma once

#include <doctest/doctest.h>

#include <cstdio>
#include <functional>
#include <vector>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "core/error.h"
#include "data/image_loader.h"

namespace {

inline std::string fresh_dir(const std::string& name) {
  std::filesystem::path p = std::filesystem::path(DTRAIN_BUILD_DIR) / "test_data" / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

inline std::string run_capture(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  REQUIRE(f != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  int rc = pclose(f);
  CHECK_MESSAGE(rc == 0, cmd);
  return out;
}

inline void write_bytes(const std::string& path, const std::string& s) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << s;
}
inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Asserts that fn throws UserError whose message contains every needle.
inline void expect_user_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const dtrain::UserError& e) {
    std::string msg = e.what();
    for (const auto& n : needles) CHECK_MESSAGE(msg.find(n) != std::string::npos, "'" << n << "' not in: " << msg);
    CHECK_MESSAGE(msg.find('\n') == std::string::npos, "multi-line message: " << msg);
    return;
  } catch (const std::exception& e) {
    FAIL("expected UserError, got: " << e.what());
  }
  FAIL("expected UserError, nothing thrown");
}

inline dtrain::data::ImageLoaderOptions opts(const std::string& root, int64_t batch, bool shuffle = true) {
  dtrain::data::ImageLoaderOptions o;
  o.root = root;
  o.split = "train";
  o.batch_size = batch;
  o.shuffle = shuffle;
  o.drop_last = false;
  o.seed = 1234;
  return o;
}

}  // namespace

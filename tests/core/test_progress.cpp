// Progress lines of long jobs (core/progress.h): the line's form, and what a job prints when
// stdout is not a terminal (a line per DTRAIN_PROGRESS_EVERY_S seconds, then a summary).
#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include "core/progress.h"
#include "run_cmd.h"

namespace stdfs = std::filesystem;
using dtrain::Progress;

TEST_SUITE("unit") {

TEST_CASE("progress: the line shows count - total - percentage - rate and ETA") {
  CHECK(Progress::line("write train", 250, 1000, "samples", 5.0) ==
        "write train: 250 samples of 1000 (25%) | 50.0 samples/s | eta 0:00:15");
  CHECK(Progress::line("index train", 3, 0, "shards", 1.5) == "index train: 3 shards | 2.0 shards/s");
  CHECK(Progress::line("tokenize", 2'000'000, 8'000'000, "bytes", 2.0) ==
        "tokenize: 2.0 MB of 8.0 MB (25%) | 1.0 MB/s | eta 0:00:06");
  CHECK(Progress::line("eval", 0, 10, "batches", 0.0) == "eval: 0 batches of 10 (0%) | 0.0 batches/s | eta -");
}

}  // TEST_SUITE

TEST_SUITE("integration") {

TEST_CASE("progress: data jobs print progress lines and a summary when stdout is not a terminal") {
  const std::string work = std::string(DTRAIN_BUILD_DIR) + "/test_progress";
  stdfs::remove_all(work);
  stdfs::create_directories(work);
  const std::string bin = shell_quote(dtrain_bin());
  auto r = run_cmd("DTRAIN_PROGRESS_EVERY_S=0 " + bin + " data shapes --out " + work +
                   "/shapes --count 30 --size 16 --classes 3 | cat");
  REQUIRE_MESSAGE(r.code == 0, r.all());
  const std::string out = r.all();
  INFO(out);
  CHECK(out.find("write train: 1 samples of ") != std::string::npos);
  CHECK(out.find("| eta ") != std::string::npos);
  CHECK(out.find("(100%)") != std::string::npos);
  CHECK(out.find("write train: ") != std::string::npos);
  CHECK(out.find(" samples in ") != std::string::npos);  // the summary
  // tokenization counts bytes
  auto t = run_cmd("DTRAIN_PROGRESS_EVERY_S=0 " + bin + " data tokenize " + std::string(DTRAIN_SOURCE_DIR) +
                   "/README.md --out " + work + "/tok --tokenizer byte | cat");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  CHECK_MESSAGE(t.all().find("tokenize: ") != std::string::npos, t.all());
  CHECK_MESSAGE(t.all().find(" MB of ") != std::string::npos, t.all());
  // and without the variable a short job prints no progress at all
  auto q = run_cmd(bin + " data shapes --out " + work + "/shapes2 --count 30 --size 16 --classes 3 | cat");
  REQUIRE(q.code == 0);
  CHECK(q.all().find("samples of") == std::string::npos);
  CHECK(q.all().find(" samples in ") == std::string::npos);
}

}  // TEST_SUITE

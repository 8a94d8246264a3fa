// The dtrain command line, run as a real process: exit codes (0 ok, 2 user error) and
// one-line error messages.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>

#include "backend/backend.h"
#include "backend/unfused.h"
#include "core/error.h"
#include "run_cmd.h"
#include "skip.h"

namespace {

// Writes `text` to DTRAIN_BUILD_DIR/test_cli/<name> and returns the path.
std::string write_temp(const std::string& name, const std::string& text) {
  std::filesystem::path dir = std::filesystem::path(DTRAIN_BUILD_DIR) / "test_cli";
  std::filesystem::create_directories(dir);
  std::filesystem::path p = dir / name;
  std::ofstream(p) << text;
  return p.string();
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A user error: exit 2 and exactly one line on stderr, starting with "error: ".
void check_user_error(const CmdResult& r, const std::string& part) {
  CHECK(r.code == 2);
  CHECK_MESSAGE(r.err_lines() == 1, r.err);
  CHECK(r.err.rfind("error: ", 0) == 0);
  CHECK_MESSAGE(has(r.err, part), "stderr: " << r.err << "\nmissing: " << part);
}

}  // namespace

TEST_SUITE("integration") {
TEST_CASE("cli: no subcommand prints help and exits 2") {
  CmdResult r = run_dtrain("");
  CHECK(r.code == 2);
  CHECK(has(r.all(), "Usage: dtrain"));
  CHECK(has(r.all(), "train"));
}

TEST_CASE("cli: version and info") {
  CmdResult v = run_dtrain("version");
  CHECK(v.code == 0);
  CHECK(v.out == "dtrain " DTRAIN_VERSION "\n");
  CHECK(run_dtrain("--version").out == "dtrain " DTRAIN_VERSION "\n");
  CmdResult i = run_dtrain("info");
  CHECK(i.code == 0);
  CHECK(has(i.out, "dtrain " DTRAIN_VERSION));
  CHECK(has(i.out, "OpenBLAS"));
  CHECK(has(i.out, "oneDNN"));
  CHECK(has(i.out, "CUDA backend: "));
  // the thread count training would use, not the machine's
  CHECK(has(run_cmd("env OMP_NUM_THREADS=1 " + shell_quote(dtrain_bin()) + " info").out,
            "CPU threads for training: 1 (OMP_NUM_THREADS"));
  CHECK(has(run_cmd("env OMP_NUM_THREADS=3 " + shell_quote(dtrain_bin()) + " info").out,
            "CPU threads for training: 3 (OMP_NUM_THREADS"));
}

// OpenBLAS's generic Prescott kernels on a CPU it does not know: dtrain runs itself again with
// the kernels the CPU's instructions allow; a user's OPENBLAS_CORETYPE is kept.
TEST_CASE("cli: OpenBLAS never runs its generic kernels on an AVX2 CPU - OPENBLAS_CORETYPE set by the user wins") {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) SKIP_TEST("CPU without AVX2+FMA");
  CmdResult i = run_cmd("env -u OPENBLAS_CORETYPE -u DTRAIN_OPENBLAS_CORETYPE_FROM " + shell_quote(dtrain_bin()) + " info");
  REQUIRE(i.code == 0);
  const size_t at = i.out.find("kernels ");
  REQUIRE_MESSAGE(at != std::string::npos, i.out);
  const std::string kernels = i.out.substr(at + 8, i.out.find('\n', at) - at - 8);
  MESSAGE("OpenBLAS kernels: " << kernels);
  CHECK(kernels.rfind("Prescott", 0) != 0);
  CmdResult forced = run_cmd("env OPENBLAS_CORETYPE=Haswell " + shell_quote(dtrain_bin()) + " info");
  CHECK(has(forced.out, "kernels Haswell (OPENBLAS_CORETYPE)"));
  // a re-executed process keeps its arguments and its exit code
  CmdResult bad = run_cmd("env -u OPENBLAS_CORETYPE " + shell_quote(dtrain_bin()) + " train /nonexistent.toml");
  CHECK(bad.code == 2);
  CHECK(has(bad.err, "/nonexistent.toml"));
}

// A recipe that never ends (a link to /dev/zero) is refused after 16 MiB, not read into memory.
TEST_CASE("cli: a recipe path that is a link to /dev/zero exits 2") {
  const std::string dir = std::string(DTRAIN_BUILD_DIR) + "/test_cli_zero";
  std::filesystem::create_directories(dir);
  std::filesystem::remove(dir + "/r.toml");
  std::filesystem::create_symlink("/dev/zero", dir + "/r.toml");
  CmdResult r = run_dtrain("train " + dir + "/r.toml");
  CHECK(r.code == 2);
  CHECK(r.err_lines() == 1);
  CHECK_MESSAGE(r.err.find("more than 16 MiB: not a recipe") != std::string::npos, r.err);
}

// --json PATH replaces a regular file only: a directory or a device there is a user error
// (a device node was replaced by a regular file), as is a directory that does not exist.
TEST_CASE("cli: --json refuses a path that is not a regular file") {
  const std::string dir = std::string(DTRAIN_BUILD_DIR) + "/test_cli_json";
  std::filesystem::create_directories(dir + "/taken");
  const std::string plan = "plan " + std::string(DTRAIN_SOURCE_DIR) + "/configs/tiny_gpt.toml --nproc 1 --set data.kind=synthetic --json ";
  CmdResult r = run_dtrain(plan + dir + "/taken");
  CHECK(r.code == 2);
  CHECK(r.err_lines() == 1);
  CHECK_MESSAGE(r.err.find("--json " + dir + "/taken: exists and is not a regular file") != std::string::npos, r.err);
  CHECK(std::filesystem::is_directory(dir + "/taken"));
  r = run_dtrain(plan + dir + "/missing/x.json");
  CHECK(r.code == 2);
  CHECK(r.err_lines() == 1);
  r = run_dtrain(plan + dir + "/ok.json");
  CHECK_MESSAGE(r.code == 0, r.all());
  CHECK(std::filesystem::is_regular_file(dir + "/ok.json"));
}

TEST_CASE("cli: every subcommand has --help") {
  for (const char* sub : {"", "train", "eval", "bench", "inspect", "data", "data fashion-mnist",
                          "data images", "info", "version"}) {
    CAPTURE(sub);
    CmdResult r = run_dtrain(std::string(sub) + " --help");
    CHECK(r.code == 0);
    CHECK(has(r.out, "Usage:"));
  }
  CHECK(has(run_dtrain("train --help").out, "--resume"));
  CHECK(has(run_dtrain("train --help").out, "--nproc-per-node"));
  CHECK(has(run_dtrain("data images --help").out, "--shard-size"));
}

TEST_CASE("cli: each subcommand's --help shows examples of that subcommand") {
  // Each leaf command's --help ends with examples that run that command (not the training
  // examples of the top level).
  for (const char* sub : {"train", "eval", "sample", "bench", "inspect", "report", "info", "version",
                          "import gpt2", "data fashion-mnist", "data images", "data tokenize", "data shapes",
                          "data segmentation", "data index"}) {
    CAPTURE(sub);
    const std::string out = run_dtrain(std::string(sub) + " --help").out;
    const size_t at = out.find("Examples:");
    REQUIRE_MESSAGE(at != std::string::npos, out);
    const std::string examples = out.substr(at);
    CHECK_MESSAGE(has(examples, std::string("dtrain ") + sub), examples);
  }
  // the top level names the commands' own --help
  CHECK(has(run_dtrain("--help").out, "dtrain COMMAND --help"));
}

TEST_CASE("cli: DTRAIN_FAILPOINTS with an unknown failpoint or a bad argument is a user error") {
  check_user_error(run_cmd("DTRAIN_FAILPOINTS=no.such=1 " + shell_quote(dtrain_bin()) + " info"), "DTRAIN_FAILPOINTS: unknown failpoint 'no.such'");
  check_user_error(run_cmd("DTRAIN_FAILPOINTS=train.slow_step=1 " + shell_quote(dtrain_bin()) + " info"), "expected RANK:MS");
  check_user_error(run_cmd("DTRAIN_FAILPOINTS=train.stop_at_step=x " + shell_quote(dtrain_bin()) + " info"), "train.stop_at_step=x");
  CmdResult l = run_dtrain("info --failpoints");
  CHECK(l.code == 0);
  for (const char* name : {"train.stop_at_step", "train.slow_step", "checkpoint.write_fail", "step.grad_overflow",
                           "tokenize.piece_bytes"})
    CHECK_MESSAGE(has(l.out, name), l.out);
}

TEST_CASE("cli: train --help-config lists every key") {
  CmdResult r = run_dtrain("train --help-config");
  CHECK(r.code == 0);
  CHECK(has(r.out, "train.batch_size"));
  CHECK(has(r.out, "optim.name"));
  CHECK(has(r.out, "observability.prometheus_port"));
}

TEST_CASE("cli: missing recipe") {
  std::string p = std::string(DTRAIN_BUILD_DIR) + "/test_cli/missing.toml";
  check_user_error(run_dtrain("train " + shell_quote(p)),
                   "cannot read recipe " + p + ": No such file or directory");
}

TEST_CASE("cli: recipe with a typo names file:line:col and a suggestion") {
  std::string p = write_temp("typo.toml",
                             "[model]\nkind = \"resnet\"\n\n[data]\npath = \"d\"\n\n[train]\nbatch_sise = 32\n");
  CmdResult r = run_dtrain("train " + shell_quote(p));
  check_user_error(r, p + ":8:1: train.batch_sise: unknown key (did you mean train.batch_size?)");
  CmdResult s = run_dtrain("eval " + shell_quote(p) + " --checkpoint x");
  check_user_error(s, "did you mean train.batch_size?");
  CmdResult b = run_dtrain("bench " + shell_quote(p));
  check_user_error(b, ":8:1:");
}

TEST_CASE("cli: bad --set overrides") {
  std::string p = write_temp("ok.toml", "[model]\nkind = \"resnet\"\n[data]\npath = \"d\"\n");
  check_user_error(run_dtrain("train " + shell_quote(p) + " --set train.batch_size=abc"),
                   "--set train.batch_size=abc: train.batch_size: expected an integer");
  check_user_error(run_dtrain("train --set optim.name=adamx " + shell_quote(p)),
                   "optim.name: expected one of sgd, adamw, got 'adamx'");
  check_user_error(run_dtrain("train " + shell_quote(p) + " --set train.batch_size"),
                   "--set train.batch_size: expected section.key=value");
  check_user_error(run_dtrain("train " + shell_quote(p) + " --set=optim.lrr=1"),
                   "optim.lrr: unknown key (did you mean optim.lr?)");
}

TEST_CASE("cli: command-line mistakes exit 2") {
  check_user_error(run_dtrain("train"), "--resume RUN_DIR");
  check_user_error(run_dtrain("frobnicate"), "frobnicate");
  check_user_error(run_dtrain("train x.toml --device gpu"), "--device");
  check_user_error(run_dtrain("train x.toml --nproc-per-node 0"), "--nproc-per-node");
  check_user_error(run_dtrain("eval x.toml"), "--checkpoint");
  check_user_error(run_dtrain("data"), "dtrain data --help");
  check_user_error(run_dtrain("data images"), "src");
  check_user_error(run_dtrain("inspect"), "path");
}
}

TEST_SUITE("integration") {
TEST_CASE("cli: device cuda without a CUDA device exits 2 naming the choices") {
  if (dtrain::cuda_device_count() > 0) {
    SKIP_TEST("this machine has a CUDA device");
  }
  const std::string p = write_temp("want_cuda.toml", R"(
[run]
device = "cuda"
[model]
kind = "resnet"
depth = 8
in_channels = 1
[data]
kind = "synthetic"
synthetic_height = 8
synthetic_width = 8
)");
#ifdef DTRAIN_WITH_CUDA
  check_user_error(run_dtrain("bench " + shell_quote(p) + " --steps 1 --warmup 0"), "no CUDA device is visible");
#else
  check_user_error(run_dtrain("bench " + shell_quote(p) + " --steps 1 --warmup 0"), "built without CUDA");
#endif
  check_user_error(run_dtrain("bench " + shell_quote(p) + " --steps 1 --warmup 0"), "use device = \"cpu\" or \"auto\"");
  // an override on the command line makes the same recipe run on the CPU
  CmdResult ok = run_dtrain("bench " + shell_quote(p) + " --steps 1 --warmup 0 --set run.device=cpu");
  CHECK_MESSAGE(ok.code == 0, ok.all());
}
}

TEST_SUITE("unit") {
TEST_CASE("DTRAIN_CUDA_UNFUSED: names and all parse - unknown names are a UserError naming the variable") {
  using dtrain::parse_cuda_unfused;
  CHECK(!parse_cuda_unfused("").any());
  CHECK(!parse_cuda_unfused(" , ").any());
  auto g = parse_cuda_unfused("gelu_epilogue");
  CHECK(g.gelu_epilogue);
  CHECK(!g.bgrad_epilogue);
  CHECK(!g.conv_cat);
  auto two = parse_cuda_unfused(" bgrad_epilogue ,conv_cat");
  CHECK(!two.gelu_epilogue);
  CHECK(two.bgrad_epilogue);
  CHECK(two.conv_cat);
  auto all = parse_cuda_unfused("all");
  CHECK((all.gelu_epilogue && all.bgrad_epilogue && all.conv_cat));
  CHECK_THROWS_WITH_AS(parse_cuda_unfused("gelu"), doctest::Contains("DTRAIN_CUDA_UNFUSED: unknown 'gelu'"),
                       dtrain::UserError);
}
}

// dtrain info / dtrain version: the build, the libraries and devices it sees, and the
// failpoints. `info` must succeed on a machine without a GPU, even in a CUDA build.
#include <fmt/format.h>

#include "backend/backend.h"
#include "cli/command.h"
#include "comm/communicator.h"
#include "comm/env.h"
#include "core/failpoint.h"

namespace dtrain::cli {

namespace {

std::string compiler() {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "GCC " __VERSION__;
#else
  return "unknown";
#endif
}

int cmd_info(bool failpoints) {
  if (failpoints) {
    fmt::print("failpoints (armed with DTRAIN_FAILPOINTS=\"name=ARG;...\", docs/failpoints.md):\n");
    for (const auto& f : failpoint::all()) fmt::print("  {}={}\n      {}\n", f.name, f.arg, f.what);
    return 0;
  }
  fmt::print("dtrain {}\n", DTRAIN_VERSION);
#ifdef NDEBUG
  fmt::print("build: release (optimized, NDEBUG)\n");
#else
  fmt::print("build: debug\n");
#endif
  fmt::print("compiler: {}\n", compiler());
  // what a training process started here would use (session.cpp asks the same, with the recipe's
  // run.threads first): OMP_NUM_THREADS, else the affinity mask's CPUs over the local ranks
  const comm::CpuThreads threads = comm::cpu_threads(0, "");
  fmt::print("CPU threads for training: {} ({}; a recipe's run.threads wins)\n", threads.threads, threads.source);
  for (const auto& line : describe_backends()) fmt::print("{}\n", line);
  for (const auto& line : comm::describe_communicators()) fmt::print("{}\n", line);
  return 0;
}

}  // namespace

void add_info(CLI::App& app, Run& run) {
  auto failpoints = std::make_shared<bool>(false);
  auto* info = app.add_subcommand("info", "print the build, libraries and devices");
  info->add_flag("--failpoints", *failpoints, "list the failpoints DTRAIN_FAILPOINTS can arm");
  set_examples(info, {"dtrain info", "dtrain info --failpoints"});
  info->callback([failpoints, &run] { run = [failpoints] { return cmd_info(*failpoints); }; });
  auto* version = app.add_subcommand("version", "print the version");
  set_examples(version, {"dtrain version", "dtrain --version"});
  version->callback([&run] {
    run = [] {
      fmt::print("dtrain {}\n", DTRAIN_VERSION);
      return 0;
    };
  });
}

}  // namespace dtrain::cli

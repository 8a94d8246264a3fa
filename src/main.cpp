// dtrain: command-line entry. Builds the CLI11 app from the commands of src/cli/ and runs
// the one that was parsed; no logic lives here. Exit codes: 0 success, 2 user error (bad
// recipe, bad command line, bad data), 1 runtime fault.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>

#include "cli/command.h"
#include "core/error.h"
#include "core/failpoint.h"
#include "core/log.h"

using namespace dtrain;

namespace {

// Deepest subcommand named on the command line (for "see ... --help" hints).
std::string chosen_path(const CLI::App& app) {
  std::string path = app.get_name();
  const CLI::App* cur = &app;
  for (;;) {
    auto subs = cur->get_subcommands();
    if (subs.empty()) break;
    cur = subs.front();
    path += " " + cur->get_name();
  }
  return path;
}

}  // namespace

int main(int argc, char** argv) {
  cli::prepare_process(argv);
  CLI::App app{"dtrain: train ResNet, U-Net and GPT models from TOML recipes, on CPU or CUDA", "dtrain"};
  app.set_version_flag("--version", std::string("dtrain ") + DTRAIN_VERSION);
  cli::set_examples(&app, {"dtrain data fashion-mnist",
                           "dtrain train configs/resnet20_fmnist.toml",
                           "dtrain train --resume runs/resnet20_fmnist",
                           "dtrain eval configs/resnet20_fmnist.toml --checkpoint runs/resnet20_fmnist",
                           "dtrain COMMAND --help        (each command's own options and examples)"});
  cli::Run run;
  cli::add_train(app, run);
  cli::add_eval(app, run);
  cli::add_sample(app, run);
  cli::add_bench(app, run);
  cli::add_inspect(app, run);
  cli::add_plan(app, run);
  cli::add_checkpoint(app, run);
  cli::add_data(app, run);
  cli::add_import(app, run);
  cli::add_report(app, run);
  cli::add_reproduce(app, run);
  cli::add_info(app, run);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    fmt::print(stderr, "error: {} (see '{} --help')\n", log::printable(e.what()), chosen_path(app));
    return 2;
  }
  if (!run) {
    fmt::print(stderr, "{}", app.help());
    return 2;
  }
  try {
    failpoint::get(failpoint::Point::StopAtStep);  // a malformed DTRAIN_FAILPOINTS fails here, once
    return run();
  } catch (const Error& e) {  // one line of valid UTF-8 whatever the message quotes
    fmt::print(stderr, "error: {}\n", log::printable(e.what()));
    return e.exit_code();
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", log::printable(e.what()));
    return 1;
  }
}

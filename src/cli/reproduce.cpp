// dtrain reproduce: a benchmark recipe from nothing to a verdict. Prepares its data (its
// data.prepare command, when data.path does not exist), trains it in a fresh run directory
// (a child `dtrain train`, so launcher flags work as they do there), judges the run against
// the recipe's [expect] table (obs/reproduce.h), writes report.md and the charts into the run
// directory and exits 0 when reproduced, 1 when not. --list shows the recipes that carry one.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <optional>

#include <fmt/ranges.h>

#include "cli/command.h"
#include "comm/launcher.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "obs/plot.h"
#include "obs/reproduce.h"
#include "config/config.h"

namespace dtrain::cli {

namespace stdfs = std::filesystem;

namespace {

struct ReproduceArgs : RecipeArgs {
  int nproc_per_node = 1;
  bool list = false;
  std::vector<std::string> list_dirs;
};

pid_t g_child = 0;
void forward_signal(int sig) {
  if (g_child > 0) ::kill(g_child, sig);
}

// Runs this executable with `args` and returns its exit status (128 + signal when killed).
// SIGINT and SIGTERM reach the child (a preempted training checkpoints and exits 0); this
// process waits for it.
int run_self(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {comm::self_exe()};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& s : argv) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  std::cout << std::flush;
  std::cerr << std::flush;
  const pid_t pid = ::fork();
  if (pid < 0) fault("dtrain reproduce: fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    ::execv(cargv[0], cargv.data());
    std::fprintf(stderr, "dtrain reproduce: cannot run %s: %s\n", cargv[0], std::strerror(errno));
    ::_exit(127);
  }
  g_child = pid;
  struct sigaction sa{}, old_int{}, old_term{};
  sa.sa_handler = forward_signal;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  g_child = 0;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

Expectation expectation(const Config& cfg, const std::string& recipe) {
  Expectation e;
  e.recipe = recipe;
  e.metric = cfg.expect.metric;
  e.target = cfg.expect.target;
  e.tolerance = cfg.expect.tolerance;
  e.budget_steps = cfg.expect.budget_steps;
  e.budget_s = cfg.expect.budget_s;
  e.hardware = cfg.expect.hardware;
  e.reference = cfg.expect.reference;
  return e;
}

std::string utc_stamp() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  return buf;
}

int cmd_list(const ReproduceArgs& a) {
  std::vector<std::string> dirs = a.list_dirs;
  if (!a.config.empty()) dirs.insert(dirs.begin(), a.config);
  if (dirs.empty()) dirs.push_back("configs");
  std::vector<std::string> files;
  for (const std::string& d : dirs) {
    std::error_code ec;
    if (stdfs::is_regular_file(d, ec)) {
      files.push_back(d);
      continue;
    }
    if (!stdfs::is_directory(d, ec)) user_error("dtrain reproduce --list: {}: no such recipe or directory", d);
    for (auto it = stdfs::recursive_directory_iterator(d, ec); !ec && it != stdfs::recursive_directory_iterator();
         it.increment(ec))
      if (it->is_regular_file() && it->path().extension() == ".toml") files.push_back(it->path().string());
  }
  std::sort(files.begin(), files.end());
  int shown = 0;
  for (const std::string& f : files) {
    std::optional<Config> cfg;
    try {
      cfg = Config::load(f);
    } catch (const UserError& e) {
      fmt::print(stderr, "skipped {}: {}\n", f, e.what());
      continue;
    }
    const Expectation e = expectation(*cfg, f);
    if (e.metric.empty()) continue;
    std::string budget;
    if (e.budget_steps > 0) budget += fmt::format("by step {}", e.budget_steps);
    if (e.budget_s > 0) budget += fmt::format("{}within {:g} s", budget.empty() ? "" : ", ", e.budget_s);
    fmt::print("{}\n  expects {} {} {:g}{}{}\n  measured on: {}{}\n", f, e.metric, e.lower_is_better() ? "<=" : ">=",
               e.target, e.tolerance > 0 ? fmt::format(" (tolerance {:g})", e.tolerance) : "",
               budget.empty() ? "" : " " + budget, e.hardware.empty() ? "(not stated)" : e.hardware,
               e.reference.empty() ? "" : "\n  reference: " + e.reference);
    ++shown;
  }
  if (shown == 0) fmt::print("no recipe with an [expect] table under {}\n", fmt::join(dirs, ", "));
  return 0;
}

int cmd_reproduce(const ReproduceArgs& a) {
  if (a.list) return cmd_list(a);
  if (a.config.empty()) user_error("dtrain reproduce: give a recipe (dtrain reproduce CONFIG), or --list");
  Config cfg = Config::load(a.config, a.overrides);
  Expectation e = expectation(cfg, a.config);
  if (e.metric.empty())
    user_error("{}: no [expect] table (expect.metric): nothing to reproduce (dtrain reproduce --list shows the "
               "recipes that have one)", a.config);
  std::error_code ec;
  if (!e.reference.empty() && !stdfs::is_regular_file(e.reference, ec))
    user_error("{}: expect.reference = \"{}\": no such file", a.config, e.reference);
  // the data, as the recipe says it is made
  const std::string& path = cfg.data.path;
  if (cfg.data.kind != "synthetic" && !path.empty() && !stdfs::exists(path, ec)) {
    const std::string& prepare = cfg.data.prepare;
    if (prepare.empty())
      user_error("{}: data.path = \"{}\" does not exist and the recipe has no data.prepare command", a.config, path);
    const std::vector<std::string> words = prepare_command_words(prepare, a.config);
    log::console(fmt::format("reproduce: preparing the data: {}", prepare));
    if (const int rc = run_self(words); rc != 0) {
      log::console(fmt::format("reproduce: data preparation failed (exit {}): {}", rc, prepare));
      return rc == 2 ? 2 : 1;
    }
  }
  // a fresh run directory
  std::string name = cfg.run.name;
  const bool named = std::any_of(a.overrides.begin(), a.overrides.end(),
                                 [](const std::string& o) { return o.rfind("run.name=", 0) == 0; });
  if (!named) name += "-reproduce-" + utc_stamp();
  const std::string run_dir = cfg.run.out_dir + "/" + name;
  std::vector<std::string> train = {"train", a.config};
  for (const std::string& o : a.overrides) train.insert(train.end(), {"--set", o});
  if (!named) train.insert(train.end(), {"--set", "run.name=" + name});
  if (!a.device.empty()) train.insert(train.end(), {"--device", a.device});
  if (a.nproc_per_node > 1) train.insert(train.end(), {"--nproc-per-node", std::to_string(a.nproc_per_node)});
  log::console(fmt::format("reproduce: training {} into {}", a.config, run_dir));
  if (const int rc = run_self(train); rc != 0) {
    log::console(fmt::format("reproduce: training failed (exit {}); no verdict", rc));
    return rc == 2 ? 2 : 1;
  }
  // verdict, charts, report
  const Verdict v = judge_run(e, run_dir);
  std::vector<std::string> charts;
  try {
    charts = plot_runs({run_dir}, run_dir, e.reference);
  } catch (const Error& err) {  // a chart is not the verdict: say so and go on
    log::warn("reproduce: charts not written: {}", err.what());
  }
  fs::write_file_atomic(run_dir + "/report.md", v.markdown(e, run_dir, charts));
  log::console(v.line(e));
  log::console(fmt::format("reproduce: report {}/report.md", run_dir));
  return v.reproduced ? 0 : 1;
}

}  // namespace

void add_reproduce(CLI::App& app, Run& run) {
  auto a = std::make_shared<ReproduceArgs>();
  auto* c = add_recipe_command(app, *a, "reproduce",
                               "prepare a benchmark recipe's data, train it, and judge the run against the "
                               "recipe's [expect] table (exit 0 reproduced, 1 not)",
                               "recipe (TOML) with an [expect] table", false);
  c->add_flag("--list", a->list, "list the recipes (under configs/, or the given files and directories) that carry "
                                 "an [expect] table, with their expected results and where those were measured");
  c->add_option("--nproc-per-node", a->nproc_per_node, "train on this many local ranks (the result does not "
                                                       "depend on it: rank r takes micro-batch r)")
      ->check(CLI::Range(1, 1024));
  c->add_option("dirs", a->list_dirs, "with --list: more recipe files or directories")->type_name("DIR...");
  add_recipe_options(c, a->overrides, a->device);
  set_footer(c,
      "Runs the recipe's data.prepare command when data.path does not exist, trains in a fresh run directory\n"
      "(run.name + -reproduce-<UTC time>, unless --set run.name=...), then prints the verdict: whether an\n"
      "evaluation reached expect.target (within expect.tolerance) by expect.budget_steps and within\n"
      "expect.budget_s, the final and reference values, and the throughput against the reference run's.\n"
      "Writes report.md and the charts (PNG and SVG) into the run directory.",
      {"dtrain reproduce --list",
       "dtrain reproduce configs/resnet20_fmnist.toml",
       "dtrain reproduce configs/gpt_fortunes.toml --nproc-per-node 2"});
  run_when_parsed(c, run, a, cmd_reproduce);
}

}  // namespace dtrain::cli

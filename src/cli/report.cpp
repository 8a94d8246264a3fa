// dtrain report: one run or several side by side (obs/report.h).
#include <iostream>

#include "cli/command.h"
#include "obs/report.h"

namespace dtrain::cli {

namespace {
struct ReportArgs {
  std::vector<std::string> runs;
  std::string format = "text";  // text | md | json
};
}  // namespace

void add_report(CLI::App& app, Run& run) {
  auto a = std::make_shared<ReportArgs>();
  auto* c = app.add_subcommand("report", "summarise one run or several side by side");
  c->add_option("runs", a->runs, "run directories")->type_name("RUN_DIR...")->required();
  c->add_option("--format", a->format, "text | md | json")->capture_default_str()->check(CLI::IsMember({"text", "md", "json"}));
  set_examples(c, {"dtrain report runs/resnet20_fmnist",
                   "dtrain report runs/a runs/b --format md        (side by side, a Markdown table)",
                   "dtrain report runs/* --format json"});
  c->callback([a, &run] {
    run = [a] {
      std::cout << report_runs(a->runs, a->format) << std::flush;
      return 0;
    };
  });
}

}  // namespace dtrain::cli

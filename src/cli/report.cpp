// dtrain report: one run or several side by side (obs/report.h); --plot draws their charts
// (obs/plot.h), with the reference curve of the first run's recipe ([expect] reference) dashed.
#include <filesystem>
#include <iostream>

#include <fmt/ranges.h>

#include "cli/command.h"
#include "core/log.h"
#include "obs/plot.h"
#include "obs/report.h"
#include "config/config.h"

namespace dtrain::cli {

namespace {
struct ReportArgs {
  std::vector<std::string> runs;
  std::string format = "text";  // text | md | json
  bool plot = false;
  std::string plot_dir;  // "" = <first run>/charts
  std::string reference;
};

// The first run's resolved recipe's [expect] metric and reference ("" when it has none).
std::pair<std::string, std::string> run_expectation(const std::string& run) {
  const std::string path = run + "/config.toml";
  if (!std::filesystem::exists(path)) return {};
  const Config cfg = Config::load(path);
  return {cfg.expect.metric, cfg.expect.reference};
}

int cmd_report(const ReportArgs& a) {
  std::cout << report_runs(a.runs, a.format) << std::flush;
  if (!a.plot) return 0;
  auto [metric, reference] = run_expectation(a.runs.front());
  if (!a.reference.empty()) reference = a.reference == "none" ? "" : a.reference;
  if (!reference.empty() && !std::filesystem::exists(reference)) {
    log::warn("reference curve {} not found (run from the directory the recipe's paths are relative to, or give "
              "--reference FILE): charts without it", reference);
    reference.clear();
  }
  const std::string dir = a.plot_dir.empty() ? a.runs.front() + "/charts" : a.plot_dir;
  const std::vector<std::string> files = plot_runs(a.runs, dir, reference, metric);
  std::cerr << "charts (PNG and SVG) in " << dir << ": " << fmt::format("{}", fmt::join(files, ", ")) << "\n";
  return 0;
}
}  // namespace

void add_report(CLI::App& app, Run& run) {
  auto a = std::make_shared<ReportArgs>();
  auto* c = app.add_subcommand("report", "summarise one run or several side by side; --plot draws their charts");
  c->add_option("runs", a->runs, "run directories")->type_name("RUN_DIR...")->required();
  c->add_option("--format", a->format, "text | md | json")->capture_default_str()->check(CLI::IsMember({"text", "md", "json"}));
  c->add_flag("--plot", a->plot,
              "also write PNG and SVG charts, the runs overlaid: training loss and the eval metric against step and "
              "wall time, throughput, step time p50/p95, learning rate");
  c->add_option("--plot-dir", a->plot_dir, "where --plot writes (default: RUN_DIR/charts of the first run)")
      ->type_name("DIR");
  c->add_option("--reference", a->reference,
                "a reference metrics.jsonl drawn dashed (default: the first run's expect.reference; none = without)")
      ->type_name("FILE");
  set_examples(c, {"dtrain report runs/resnet20_fmnist",
                   "dtrain report runs/a runs/b --format md        (side by side, a Markdown table)",
                   "dtrain report runs/* --format json",
                   "dtrain report runs/a runs/b --plot --plot-dir charts/ab"});
  c->callback([a, &run] {
    run = [a] { return cmd_report(*a); };
  });
}

}  // namespace dtrain::cli

#pragma once
// Charts of runs (`dtrain report RUN... --plot`, `dtrain reproduce`): line charts drawn with
// cairo from the runs' metrics.jsonl, one PNG and one SVG per chart, the runs overlaid in
// distinct colours and a reference run dashed.
#include <string>
#include <vector>

namespace dtrain {

// One series of a chart: (x, y) points in order.
struct PlotSeries {
  std::string label;
  std::vector<double> x, y;
  bool dashed = false;   // the reference curve
  bool markers = false;  // sparse points (evaluations)
};

struct PlotSpec {
  std::string title, x_label, y_label;
  std::vector<PlotSeries> series;
};

// Draws `spec` into `path_stem`.png (width x height pixels) and `path_stem`.svg.
// RuntimeFault when a file cannot be written; UserError when no series has a point.
void draw_chart(const PlotSpec& spec, const std::string& path_stem, int width = 960, int height = 600);

// The charts of `runs` (run directories, labelled by their names) into `out_dir`: training
// loss and the eval metric against step and against wall time, throughput, step time
// p50/p95 and learning rate. `reference`: a metrics.jsonl drawn dashed ("" = none).
// `metric`: the eval-row field to chart ("" = eval_accuracy, else eval_miou, else eval_loss:
// the first the runs have). Returns the PNG file names written (relative to out_dir); a chart
// without data in any run is left out. UserError for a run without metrics.jsonl.
std::vector<std::string> plot_runs(const std::vector<std::string>& runs, const std::string& out_dir,
                                   const std::string& reference, const std::string& metric = "");

// Tick positions for [lo, hi]: about `target` "nice" steps (1, 2, 2.5 or 5 times a power of
// ten) covering the range; exposed for tests.
std::vector<double> nice_ticks(double lo, double hi, int target = 6);

}  // namespace dtrain

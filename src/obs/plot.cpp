#include "obs/plot.h"

#include <cairo-svg.h>
#include <cairo.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <numbers>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fsutil.h"
#include "obs/report.h"

namespace dtrain {

namespace {

using nlohmann::json;
namespace stdfs = std::filesystem;

constexpr const char* kFont = "DejaVu Sans";
// Colour-blind-safe palette (Okabe-Ito), then the reference's dark grey.
constexpr double kPalette[][3] = {{0.000, 0.447, 0.698}, {0.835, 0.369, 0.000}, {0.000, 0.620, 0.451},
                                  {0.800, 0.475, 0.655}, {0.337, 0.706, 0.914}, {0.902, 0.624, 0.000},
                                  {0.941, 0.894, 0.259}, {0.000, 0.000, 0.000}};
constexpr double kReference[3] = {0.33, 0.33, 0.33};

bool finite_point(double x, double y) { return std::isfinite(x) && std::isfinite(y); }

// A tick value as text, with as many decimals as the step needs; thousands as k, millions as M.
std::string tick_label(double v, double step, double scale_max) {
  if (std::fabs(v) < step * 1e-9) v = 0;
  const char* suffix = "";
  double div = 1;
  if (scale_max >= 1e6) div = 1e6, suffix = "M";
  else if (scale_max >= 1e4) div = 1e3, suffix = "k";
  const double s = step / div;
  if (s < 1e-4 && v != 0) return fmt::format("{:.1e}", v);
  int dec = 0;
  while (dec < 8 && std::fabs(s * std::pow(10.0, dec) - std::round(s * std::pow(10.0, dec))) > 1e-6) ++dec;
  return fmt::format("{:.{}f}{}", v / div, dec, suffix);
}

void set_font(cairo_t* cr, double size, bool bold = false) {
  cairo_select_font_face(cr, kFont, CAIRO_FONT_SLANT_NORMAL, bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
}

double text_width(cairo_t* cr, const std::string& s) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  return e.x_advance;
}

// Draws `s` with its anchor at (x, y): ax 0 left, 0.5 centre, 1 right; ay 0 top, 0.5 middle, 1 baseline.
void text(cairo_t* cr, const std::string& s, double x, double y, double ax, double ay) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  cairo_font_extents_t f;
  cairo_font_extents(cr, &f);
  const double h = f.ascent * 0.75;  // cap height, roughly
  cairo_move_to(cr, x - ax * e.x_advance, y + (1 - ay) * h);
  cairo_show_text(cr, s.c_str());
}

void set_line_style(cairo_t* cr, const PlotSeries& s) {
  if (s.dashed) {
    const double d[] = {9, 5};
    cairo_set_dash(cr, d, 2, 0);
  } else if (s.label.size() > 4 && s.label.compare(s.label.size() - 4, 4, " p95") == 0) {
    const double d[] = {2, 3};
    cairo_set_dash(cr, d, 2, 0);
  } else {
    cairo_set_dash(cr, nullptr, 0, 0);
  }
}

constexpr double kLegendSample = 30, kLegendGap = 22, kLegendRow = 22;

// The rows the legend takes in `width` pixels (its entries laid out left to right).
int legend_rows(cairo_t* cr, const PlotSpec& spec, double width) {
  set_font(cr, 13);
  int rows = 1;
  double x = 0;
  for (const PlotSeries& s : spec.series) {
    const double w = kLegendSample + 8 + text_width(cr, s.label) + kLegendGap;
    if (x > 0 && x + w > width) x = 0, ++rows;
    x += w;
  }
  return rows;
}

void render(cairo_t* cr, const PlotSpec& spec, int W, int H) {
  double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
  for (const PlotSeries& s : spec.series)
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i)
      if (finite_point(s.x[i], s.y[i])) {
        xlo = std::min(xlo, s.x[i]), xhi = std::max(xhi, s.x[i]);
        ylo = std::min(ylo, s.y[i]), yhi = std::max(yhi, s.y[i]);
      }
  if (xhi == xlo) xlo -= 1, xhi += 1;
  if (yhi == ylo) {
    const double d = std::max(std::fabs(ylo) * 0.1, 1e-3);
    ylo -= d, yhi += d;
  }
  const double pad = (yhi - ylo) * 0.06, xpad = (xhi - xlo) * 0.02;  // markers at the edges stay whole
  ylo -= pad, yhi += pad;
  xlo -= xpad, xhi += xpad;
  const std::vector<double> xt = nice_ticks(xlo, xhi), yt = nice_ticks(ylo, yhi);
  const double xstep = xt.size() > 1 ? xt[1] - xt[0] : 1, ystep = yt.size() > 1 ? yt[1] - yt[0] : 1;
  const double xmax_abs = std::max(std::fabs(xlo), std::fabs(xhi)), ymax_abs = std::max(std::fabs(ylo), std::fabs(yhi));

  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  // margins from the tick labels' widths
  set_font(cr, 13);
  double ytw = 0;
  for (double v : yt) ytw = std::max(ytw, text_width(cr, tick_label(v, ystep, ymax_abs)));
  const double left = 24 + 18 + 10 + ytw + 8, right = 28, bottom = 70;
  const double top = 50 + kLegendRow * legend_rows(cr, spec, W - left - right) + 8;
  const double px0 = left, px1 = W - right, py0 = top, py1 = H - bottom;
  auto X = [&](double x) { return px0 + (x - xlo) / (xhi - xlo) * (px1 - px0); };
  auto Y = [&](double y) { return py1 - (y - ylo) / (yhi - ylo) * (py1 - py0); };

  // grid and ticks
  cairo_set_line_width(cr, 1);
  for (double v : xt) {
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, std::round(X(v)) + 0.5, py0);
    cairo_line_to(cr, std::round(X(v)) + 0.5, py1);
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
    cairo_move_to(cr, std::round(X(v)) + 0.5, py1);
    cairo_line_to(cr, std::round(X(v)) + 0.5, py1 + 5);
    cairo_stroke(cr);
    text(cr, tick_label(v, xstep, xmax_abs), X(v), py1 + 9, 0.5, 0);
  }
  for (double v : yt) {
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, px0, std::round(Y(v)) + 0.5);
    cairo_line_to(cr, px1, std::round(Y(v)) + 0.5);
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
    cairo_move_to(cr, px0 - 5, std::round(Y(v)) + 0.5);
    cairo_line_to(cr, px0, std::round(Y(v)) + 0.5);
    cairo_stroke(cr);
    text(cr, tick_label(v, ystep, ymax_abs), px0 - 9, Y(v), 1, 0.5);
  }
  cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
  cairo_rectangle(cr, px0 + 0.5, py0 + 0.5, px1 - px0 - 1, py1 - py0 - 1);
  cairo_stroke(cr);
  // labels and title
  set_font(cr, 15);
  text(cr, spec.x_label, (px0 + px1) / 2, H - 22, 0.5, 1);
  cairo_save(cr);
  cairo_translate(cr, 26, (py0 + py1) / 2);
  cairo_rotate(cr, -std::numbers::pi / 2);
  text(cr, spec.y_label, 0, 0, 0.5, 0.5);
  cairo_restore(cr);
  set_font(cr, 18, true);
  text(cr, spec.title, (px0 + px1) / 2, 32, 0.5, 1);

  // series, clipped to the plot area
  cairo_save(cr);
  cairo_rectangle(cr, px0, py0, px1 - px0, py1 - py0);
  cairo_clip(cr);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
  int colour = 0;
  std::vector<const double*> colours;
  for (const PlotSeries& s : spec.series) {
    const double* c = s.dashed ? kReference : kPalette[size_t(colour) % 8];
    // a run's p95 series shares its p50's colour
    const bool p95 = !s.dashed && s.label.size() > 4 && s.label.compare(s.label.size() - 4, 4, " p95") == 0;
    if (p95 && colour > 0) c = kPalette[size_t(colour - 1) % 8];
    else if (!s.dashed) ++colour;
    colours.push_back(c);
    cairo_set_source_rgb(cr, c[0], c[1], c[2]);
    cairo_set_line_width(cr, 2.2);
    set_line_style(cr, s);
    bool pen = false;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!finite_point(s.x[i], s.y[i])) {
        pen = false;
        continue;
      }
      if (pen) cairo_line_to(cr, X(s.x[i]), Y(s.y[i]));
      else cairo_move_to(cr, X(s.x[i]), Y(s.y[i]));
      pen = true;
    }
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
    if (s.markers)
      for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i)
        if (finite_point(s.x[i], s.y[i])) {
          cairo_arc(cr, X(s.x[i]), Y(s.y[i]), 3.8, 0, 2 * std::numbers::pi);
          cairo_fill(cr);
        }
  }
  cairo_restore(cr);

  // legend: one row (or more) of entries between the title and the plot, never over the data
  set_font(cr, 13);
  double x = 0, y = 0;
  for (size_t i = 0; i < spec.series.size(); ++i) {
    const double w = kLegendSample + 8 + text_width(cr, spec.series[i].label) + kLegendGap;
    if (x > 0 && px0 + x + w > px1) x = 0, y += kLegendRow;
    const double lx = px0 + x, ly = 50 + y + kLegendRow / 2;
    const double* c = colours[i];
    cairo_set_source_rgb(cr, c[0], c[1], c[2]);
    cairo_set_line_width(cr, 2.2);
    set_line_style(cr, spec.series[i]);
    cairo_move_to(cr, lx, ly);
    cairo_line_to(cr, lx + kLegendSample, ly);
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
    if (spec.series[i].markers) {
      cairo_arc(cr, lx + kLegendSample / 2, ly, 3.8, 0, 2 * std::numbers::pi);
      cairo_fill(cr);
    }
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    text(cr, spec.series[i].label, lx + kLegendSample + 8, ly, 0, 0.5);
    x += w;
  }
}

void check_surface(cairo_surface_t* s, const std::string& path) {
  if (cairo_surface_status(s) != CAIRO_STATUS_SUCCESS)
    fault("cannot draw chart {}: {}", path, cairo_status_to_string(cairo_surface_status(s)));
}

// --- runs to charts ---

struct RunCurves {
  std::string label;
  std::vector<json> train, eval;
};

RunCurves read_run(const std::string& metrics_path, const std::string& label) {
  std::vector<std::string> notes;
  RunCurves r;
  r.label = label;
  for (json& row : read_jsonl(metrics_path, notes)) {
    const std::string kind = row.value("kind", "");
    if (kind == "train") r.train.push_back(std::move(row));
    else if (kind == "eval") r.eval.push_back(std::move(row));
  }
  return r;
}

double field(const json& row, const std::string& key) {
  auto it = row.find(key);
  return it != row.end() && it->is_number() ? it->get<double>() : NAN;
}

PlotSeries series(const RunCurves& r, const std::vector<json>& rows, const std::string& xk, const std::string& yk,
                  double xscale, double yscale, const std::string& label) {
  PlotSeries s;
  s.label = label;
  for (const json& row : rows) {
    const double x = field(row, xk), y = field(row, yk);
    if (!finite_point(x, y)) continue;
    s.x.push_back(x * xscale);
    s.y.push_back(y * yscale);
  }
  (void)r;
  return s;
}

std::string metric_title(const std::string& m) {
  if (m == "eval_accuracy") return "test accuracy (%)";
  if (m == "eval_accuracy_top5") return "test top-5 accuracy (%)";
  if (m == "eval_miou") return "validation mIoU (%)";
  if (m == "eval_dice") return "validation mean Dice (%)";
  if (m == "eval_pixel_accuracy") return "validation pixel accuracy (%)";
  return "evaluation loss";
}

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int target) {
  std::vector<double> out;
  if (!(hi > lo) || !std::isfinite(lo) || !std::isfinite(hi) || target < 1) return out;
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag * 10;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) out.push_back(v);
  return out;
}

void draw_chart(const PlotSpec& spec, const std::string& path_stem, int width, int height) {
  bool any = false;
  for (const PlotSeries& s : spec.series)
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) any = any || finite_point(s.x[i], s.y[i]);
  if (!any) user_error("chart {}: no data to draw", path_stem);
  const std::string png = path_stem + ".png", svg = path_stem + ".svg";
  {
    cairo_surface_t* surf = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height);
    check_surface(surf, png);
    cairo_t* cr = cairo_create(surf);
    render(cr, spec, width, height);
    cairo_destroy(cr);
    const cairo_status_t st = cairo_surface_write_to_png(surf, (png + ".tmp").c_str());
    cairo_surface_destroy(surf);
    if (st != CAIRO_STATUS_SUCCESS) fault("cannot write chart {}: {}", png, cairo_status_to_string(st));
    fs::rename_path(png + ".tmp", png);
  }
  {
    cairo_surface_t* surf = cairo_svg_surface_create((svg + ".tmp").c_str(), width, height);
    check_surface(surf, svg);
    cairo_t* cr = cairo_create(surf);
    render(cr, spec, width, height);
    cairo_destroy(cr);
    cairo_surface_finish(surf);
    const cairo_status_t st = cairo_surface_status(surf);
    cairo_surface_destroy(surf);
    if (st != CAIRO_STATUS_SUCCESS) fault("cannot write chart {}: {}", svg, cairo_status_to_string(st));
    fs::rename_path(svg + ".tmp", svg);
  }
}

std::vector<std::string> plot_runs(const std::vector<std::string>& runs, const std::string& out_dir,
                                   const std::string& reference, const std::string& metric_in) {
  std::vector<RunCurves> curves;
  for (const std::string& d : runs) {
    std::string label = stdfs::path(d).filename().string();
    if (label.empty()) label = stdfs::path(d).parent_path().filename().string();
    curves.push_back(read_run(d + "/metrics.jsonl", label));
  }
  std::vector<RunCurves> all = curves;
  if (!reference.empty()) all.push_back(read_run(reference, "reference"));
  const size_t n_runs = curves.size();
  auto is_ref = [&](size_t i) { return i >= n_runs; };

  std::string metric = metric_in;
  for (const char* m : {"eval_accuracy", "eval_miou", "eval_loss"})
    for (const RunCurves& c : curves)
      if (metric.empty() && !c.eval.empty() && c.eval[0].contains(m)) metric = m;
  const double mscale = metric == "eval_loss" || metric.empty() ? 1 : 100;
  // wall time in minutes past ten of them
  double tmax = 0;
  for (const RunCurves& c : all)
    for (const json& r : c.train) tmax = std::max(tmax, field(r, "elapsed_s"));
  const bool minutes = tmax > 600;
  const double tscale = minutes ? 1.0 / 60 : 1.0;
  const std::string tlabel = minutes ? "wall time (min)" : "wall time (s)";
  std::string rate = "images_per_s";
  for (const RunCurves& c : all)
    if (!c.train.empty() && c.train[0].contains("tokens_per_s")) rate = "tokens_per_s";

  struct Chart {
    std::string file, title, xl, yl;
    std::function<void(PlotSpec&, const RunCurves&, bool)> add;
  };
  auto simple = [&](const std::string& xk, const std::string& yk, double xs, double ys, bool eval) {
    return [=](PlotSpec& p, const RunCurves& c, bool ref) {
      PlotSeries s = series(c, eval ? c.eval : c.train, xk, yk, xs, ys, c.label);
      s.dashed = ref;
      s.markers = eval;
      p.series.push_back(std::move(s));
    };
  };
  std::vector<Chart> charts = {
      {"loss_step", "Training loss", "step", "training loss", simple("step", "loss", 1, 1, false)},
      {"loss_time", "Training loss over wall time", tlabel, "training loss", simple("elapsed_s", "loss", tscale, 1, false)},
      {"eval_step", "Evaluation", "step", metric_title(metric), simple("step", metric, 1, mscale, true)},
      {"eval_time", "Evaluation over wall time", tlabel, metric_title(metric), simple("elapsed_s", metric, tscale, mscale, true)},
      {"throughput", "Throughput", "step", rate == "tokens_per_s" ? "tokens/s" : "images/s",
       simple("step", rate, 1, 1, false)},
      {"step_time", "Step time (p50 solid, p95 dotted)", "step", "step time (ms)",
       [](PlotSpec& p, const RunCurves& c, bool ref) {
         PlotSeries a = series(c, c.train, "step", "step_p50_s", 1, 1e3, c.label + " p50");
         PlotSeries b = series(c, c.train, "step", "step_p95_s", 1, 1e3, c.label + " p95");
         a.dashed = ref;
         b.dashed = ref;
         p.series.push_back(std::move(a));
         if (!ref) p.series.push_back(std::move(b));
       }},
      {"lr", "Learning rate", "step", "learning rate", simple("step", "lr", 1, 1, false)},
  };
  fs::mkdirs(out_dir);
  std::vector<std::string> written;
  for (const Chart& ch : charts) {
    if (metric.empty() && ch.file.rfind("eval", 0) == 0) continue;
    PlotSpec spec{ch.title, ch.xl, ch.yl, {}};
    for (size_t i = 0; i < all.size(); ++i) ch.add(spec, all[i], is_ref(i));
    spec.series.erase(std::remove_if(spec.series.begin(), spec.series.end(),
                                     [](const PlotSeries& s) { return s.x.empty(); }),
                      spec.series.end());
    if (spec.series.empty()) continue;
    draw_chart(spec, out_dir + "/" + ch.file);
    written.push_back(ch.file + ".png");
  }
  return written;
}

}  // namespace dtrain

#include "plan/scaling.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "core/error.h"
#include "comm/collective_bench.h"

namespace dtrain::parallel {

LinkModel nvlink_h100() { return {"nvlink-h100", 5e-6, 450e9}; }
LinkModel ib_400g() { return {"ib-400g", 10e-6, 50e9}; }

double ring_allreduce_s(double bytes, int n, const LinkModel& link) {
  if (n <= 1) return 0.0;
  return 2.0 * (n - 1) * link.alpha_s + 2.0 * (n - 1) / n * bytes / link.beta_bytes_per_s;
}

double allreduce_s(double bytes, int n, const LinkModel& link, const LinkModel& intra, int gpus_per_node) {
  if (n < 1) user_error("GPU count {}: expected >= 1", n);
  if (gpus_per_node < 1) user_error("gpus per node {}: expected >= 1", gpus_per_node);
  if (n <= gpus_per_node) return ring_allreduce_s(bytes, n, link);
  if (n % gpus_per_node != 0)
    user_error("GPU count {}: expected a multiple of {} GPUs per node", n, gpus_per_node);
  const int g = gpus_per_node, nodes = n / g;
  // reduce-scatter + allgather inside the node: each (g-1) alpha + (g-1)/g * bytes / beta
  const double in_node = 2.0 * ((g - 1) * intra.alpha_s + double(g - 1) / g * bytes / intra.beta_bytes_per_s);
  return in_node + ring_allreduce_s(bytes / g, nodes, link);
}

ScalingPoint predict_point(const ScalingInputs& in, int gpus, const LinkModel& link, const LinkModel& intra,
                           int gpus_per_node) {
  ScalingPoint p;
  p.gpus = gpus;
  p.comm_s = allreduce_s(in.grad_bytes, gpus, link, intra, gpus_per_node);
  const double hidden = in.overlap_fraction * in.backward_share * in.step_compute_s;
  p.exposed_s = std::max(0.0, p.comm_s - hidden);
  p.step_s = in.step_compute_s + p.exposed_s;
  p.efficiency = p.step_s > 0 ? in.step_compute_s / p.step_s : 1.0;
  return p;
}

LinkModel fit_link(const std::vector<std::pair<double, double>>& pts, int n, const std::string& name,
                   const std::string& what) {
  if (n < 2) user_error("{}: {} rank(s): fitting a link needs a run with at least 2 ranks", what, n);
  if (pts.size() < 2) user_error("{}: {} allreduce point(s): expected at least 2 sizes", what, pts.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (auto [x, y] : pts) {
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double m = double(pts.size());
  const double den = m * sxx - sx * sx;
  if (den <= 0) user_error("{}: every allreduce point has the same size: expected at least 2 sizes", what);
  const double b = (m * sxy - sx * sy) / den;
  const double a = (sy - b * sx) / m;
  if (!(b > 0)) user_error("{}: allreduce time does not grow with size (slope {}): cannot fit a bandwidth", what, b);
  LinkModel l;
  l.name = name;
  l.alpha_s = std::max(0.0, a) / (2.0 * (n - 1));
  l.beta_bytes_per_s = 2.0 * (n - 1) / n / b;
  return l;
}

LinkModel fit_link_from_rows(const std::vector<CollectiveRow>& rows, int n, const std::string& name,
                             const std::string& what) {
  std::vector<std::pair<double, double>> pts;
  for (const auto& r : rows)
    if (r.op == "allreduce") pts.emplace_back(double(r.bytes), r.time_us * 1e-6);
  return fit_link(pts, n, name, what);
}

static std::string human_bytes(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.1f} MB", b / 1e6);
  return fmt::format("{:.0f} B", b);
}

std::string predict_scaling_table(const std::vector<ScalingInputs>& inputs, const std::vector<LinkModel>& links,
                                  const std::vector<int>& gpus) {
  const LinkModel intra = nvlink_h100();
  std::string s = "Links (alpha, per-GPU bus bandwidth):\n";
  for (const auto& l : links)
    s += fmt::format("  {}: alpha {:.2f} us, beta {:.2f} GB/s\n", l.name, l.alpha_s * 1e6, l.beta_bytes_per_s / 1e9);
  s += "Up to 8 GPUs: one ring over the link; above: NVLink inside 8-GPU nodes, the link across nodes.\n";
  for (const auto& in : inputs) {
    s += fmt::format("\n{}: compute {:.2f} ms/step, gradients {}, backward {:.0f}% of the step, overlap {:.0f}% "
                     "of backward\n\n",
                     in.name, in.step_compute_s * 1e3, human_bytes(in.grad_bytes), in.backward_share * 100,
                     in.overlap_fraction * 100);
    s += "| link | GPUs | allreduce (ms) | exposed comm (ms) | step (ms) | efficiency |\n";
    s += "|---|---:|---:|---:|---:|---:|\n";
    for (const auto& l : links)
      for (int g : gpus) {
        ScalingPoint p = predict_point(in, g, l, intra);
        s += fmt::format("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.1f}% |\n", l.name, g, p.comm_s * 1e3,
                         p.exposed_s * 1e3, p.step_s * 1e3, p.efficiency * 100);
      }
  }
  return s;
}

ScalingInputs resnet50_h100_measured() {
  ScalingInputs in;
  in.name = "resnet50-b128-h100 (measured)";
  in.step_compute_s = 0.0719;
  in.grad_bytes = 25557032.0 * 4;
  in.backward_share = 0.61;
  in.overlap_fraction = 0.6;
  return in;
}

ScalingInputs parse_scaling_entry(const std::string& entry) {
  std::vector<std::string> f;
  std::stringstream ss(entry);
  for (std::string x; std::getline(ss, x, ':');) f.push_back(x);
  const char* want = "expected name:step_s:grad_bytes[:backward_share[:overlap_fraction]]";
  if (f.size() < 3 || f.size() > 5 || f[0].empty()) user_error("--entry \"{}\": {}", entry, want);
  auto num = [&](const std::string& v, const char* what) {
    size_t used = 0;
    double d = 0;
    try {
      d = std::stod(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != v.size() || !std::isfinite(d) || d < 0) user_error("--entry \"{}\": {} \"{}\": {}", entry, what, v, want);
    return d;
  };
  ScalingInputs in;
  in.name = f[0];
  in.step_compute_s = num(f[1], "step_s");
  in.grad_bytes = num(f[2], "grad_bytes");
  if (in.step_compute_s <= 0) user_error("--entry \"{}\": step_s must be > 0", entry);
  if (f.size() > 3) in.backward_share = num(f[3], "backward_share");
  if (f.size() > 4) in.overlap_fraction = num(f[4], "overlap_fraction");
  if (in.backward_share > 1 || in.overlap_fraction > 1)
    user_error("--entry \"{}\": backward_share and overlap_fraction are fractions in [0, 1]", entry);
  return in;
}

}  // namespace dtrain::parallel

#include "obs/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "core/error.h"
#include "obs/metrics.h"

namespace dtrain {

namespace {

namespace stdfs = std::filesystem;
using nlohmann::json;

}  // namespace

std::vector<json> read_jsonl(const std::string& path, std::vector<std::string>& notes) {
  std::error_code ec;
  if (!stdfs::is_regular_file(path, ec)) user_error("{}: not found (is this a dtrain run directory?)", path);
  std::ifstream f(path, std::ios::binary);
  if (!f) user_error("{}: cannot be read", path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string text = ss.str();
  std::vector<json> rows;
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    bool terminated = eol != std::string::npos;
    std::string line = text.substr(pos, terminated ? eol - pos : std::string::npos);
    pos = terminated ? eol + 1 : text.size();
    line_no++;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      if (!terminated) {
        notes.push_back(fmt::format("{}:{}: skipped a truncated last line", path, line_no));
        break;
      }
      user_error("{}:{}: corrupt line (expected one JSON object per line): {}", path, line_no,
                 line.substr(0, 60) + (line.size() > 60 ? "..." : ""));
    }
    rows.push_back(std::move(j));
  }
  return rows;
}

namespace {

double num(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return RunSummary::kNone;
  return it->get<double>();
}

std::string str(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

bool known(double v) { return !std::isnan(v); }

std::string hms(double s) {
  if (!known(s) || s < 0) return "-";
  int64_t t = int64_t(s + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60);
  return fmt::format("{}:{:02}", t / 60, t % 60);
}
std::string pct(double v) { return known(v) ? fmt::format("{:.1f}%", 100 * v) : "-"; }
std::string ms(double s) { return known(s) ? fmt::format("{:.1f} ms", 1e3 * s) : "-"; }
std::string fixed(double v, int prec) { return known(v) ? fmt::format("{:.{}f}", v, prec) : "-"; }

json jnum(double v) { return known(v) ? json(v) : json(nullptr); }

}  // namespace

RunSummary summarize_run(const std::string& dir) {
  std::error_code ec;
  if (!stdfs::is_directory(dir, ec)) user_error("dtrain report: {} is not a directory (expected a run directory)", dir);
  RunSummary r;
  r.dir = dir;
  std::vector<json> metrics = read_jsonl(dir + "/metrics.jsonl", r.notes);
  std::vector<json> events = read_jsonl(dir + "/events.jsonl", r.notes);

  std::vector<double> steps_s, ips;
  double sum_step = 0, sum_data = 0, sum_fwd = 0, sum_bwd = 0, sum_opt = 0, sum_sync = 0, max_elapsed = RunSummary::kNone;
  bool have_sync = false;
  for (const json& m : metrics) {
    std::string kind = str(m, "kind");
    double step = num(m, "step");
    if (known(step)) r.steps = std::max(r.steps, int64_t(step));
    if (kind == "train") {
      if (known(num(m, "loss"))) r.final_loss = num(m, "loss");
      if (known(num(m, "images_per_s"))) {
        ips.push_back(num(m, "images_per_s"));
      } else if (known(num(m, "tokens_per_s"))) {  // GPT
        ips.push_back(num(m, "tokens_per_s"));
        r.rate_unit = "tok";
      }
      double el = num(m, "elapsed_s");
      if (known(el)) max_elapsed = known(max_elapsed) ? std::max(max_elapsed, el) : el;
      double st = num(m, "step_s");
      if (!known(st)) continue;
      steps_s.push_back(st);
      sum_step += st;
      auto add = [&](const char* k, double& acc) {
        double v = num(m, k);
        if (known(v)) acc += v;
      };
      add("data_s", sum_data);
      add("forward_s", sum_fwd);
      add("backward_s", sum_bwd);
      add("optimizer_s", sum_opt);
      if (known(num(m, "sync_s"))) {
        have_sync = true;
        sum_sync += num(m, "sync_s");
      }
    } else if (kind == "eval") {
      if (known(num(m, "eval_loss"))) r.final_eval_loss = num(m, "eval_loss");
      if (known(num(m, "eval_accuracy"))) r.final_eval_accuracy = num(m, "eval_accuracy");
    }
  }
  r.step_rows = steps_s.size();
  if (!steps_s.empty()) {
    std::sort(steps_s.begin(), steps_s.end());
    r.step_p50_s = quantile_sorted(steps_s, 0.5);
    r.step_p95_s = quantile_sorted(steps_s, 0.95);
    r.step_p99_s = quantile_sorted(steps_s, 0.99);
  }
  if (sum_step > 0) {
    r.share_data = sum_data / sum_step;
    r.share_forward = sum_fwd / sum_step;
    r.share_backward = sum_bwd / sum_step;
    r.share_optimizer = sum_opt / sum_step;
    double covered = sum_data + sum_fwd + sum_bwd + sum_opt;
    if (have_sync) {
      r.share_sync = sum_sync / sum_step;
      covered += sum_sync;
    }
    r.share_other = std::max(0.0, 1.0 - covered / sum_step);
  }
  if (!ips.empty()) {
    size_t first = ips.size() > 1 ? 1 : 0;  // the first window includes start-up
    double s = 0;
    for (size_t i = first; i < ips.size(); i++) s += ips[i];
    r.samples_per_s = s / double(ips.size() - first);
  }

  double ck_sum = 0;
  int64_t ck_timed = 0;
  bool ended = false;
  for (const json& e : events) {
    std::string ev = str(e, "event");
    if (ev == "checkpoint") {
      r.checkpoints++;
      if (known(num(e, "seconds"))) {
        ck_sum += num(e, "seconds");
        ck_timed++;
      }
    } else if (ev == "checkpoint_invalid" || ev == "checkpoint_failed") {
      r.checkpoint_failures++;
    } else if (ev == "best") {
      r.best_metric = str(e, "metric");
      r.best_value = num(e, "value");
      r.best_step = known(num(e, "step")) ? int64_t(num(e, "step")) : -1;
    } else if (ev == "resume") {
      r.resumes++;
      // the launcher's restarts: a restarted group resumes with its restart count
      if (known(num(e, "restart_count"))) r.restarts = std::max(r.restarts, int64_t(num(e, "restart_count")));
    } else if (ev == "signal") {
      r.preemptions++;
    } else if (ev == "run_start") {
      ended = false;
    } else if (ev == "run_end") {
      ended = true;
      if (!str(e, "status").empty()) r.status = str(e, "status");
      if (known(num(e, "step"))) r.steps = std::max(r.steps, int64_t(num(e, "step")));
      if (known(num(e, "wall_time_s"))) r.wall_time_s = num(e, "wall_time_s");
      if (known(num(e, "eval_accuracy"))) r.final_eval_accuracy = num(e, "eval_accuracy");
      if (known(num(e, "eval_loss"))) r.final_eval_loss = num(e, "eval_loss");
    }
  }
  if (!ended) r.status = events.empty() ? "unknown" : "running or crashed";
  if (ck_timed) r.checkpoint_mean_s = ck_sum / double(ck_timed);
  // A run that is still going (or crashed) has no run_end: its last logged elapsed time.
  if (!ended || !known(r.wall_time_s)) {
    if (known(max_elapsed) && (!known(r.wall_time_s) || max_elapsed > r.wall_time_s)) r.wall_time_s = max_elapsed;
  }
  return r;
}

json summary_json(const RunSummary& s) {
  return {{"run", s.dir},
          {"status", s.status},
          {"wall_time_s", jnum(s.wall_time_s)},
          {"steps", s.steps},
          {"samples_per_s", jnum(s.samples_per_s)},
          {"throughput_unit", s.rate_unit == "tok" ? "tokens" : "images"},
          {"step_rows", s.step_rows},
          {"step_p50_s", jnum(s.step_p50_s)},
          {"step_p95_s", jnum(s.step_p95_s)},
          {"step_p99_s", jnum(s.step_p99_s)},
          {"share",
           {{"data", jnum(s.share_data)},
            {"forward", jnum(s.share_forward)},
            {"backward", jnum(s.share_backward)},
            {"sync_exposed", jnum(s.share_sync)},
            {"optimizer", jnum(s.share_optimizer)},
            {"other", jnum(s.share_other)}}},
          {"checkpoints", s.checkpoints},
          {"checkpoint_failures", s.checkpoint_failures},
          {"checkpoint_mean_s", jnum(s.checkpoint_mean_s)},
          {"resumes", s.resumes},
          {"preemptions", s.preemptions},
          {"restarts", s.restarts},
          {"final_loss", jnum(s.final_loss)},
          {"final_eval_loss", jnum(s.final_eval_loss)},
          {"final_eval_accuracy", jnum(s.final_eval_accuracy)},
          {"best", s.best_metric.empty() ? json(nullptr)
                                         : json{{"metric", s.best_metric}, {"value", jnum(s.best_value)},
                                                {"step", s.best_step}}},
          {"notes", s.notes}};
}

std::string render_report(const std::vector<RunSummary>& runs, const std::string& format) {
  if (format == "json") {
    json arr = json::array();
    for (const auto& r : runs) arr.push_back(summary_json(r));
    return arr.dump(2) + "\n";
  }
  if (format != "text" && format != "md")
    user_error("dtrain report: --format {} is not known (expected text, md or json)", format);

  using Row = std::pair<std::string, std::vector<std::string>>;
  std::vector<Row> rows;
  auto add = [&](const std::string& label, auto fn) {
    Row row{label, {}};
    for (const auto& r : runs) row.second.push_back(fn(r));
    rows.push_back(std::move(row));
  };
  add("run", [](const RunSummary& r) { return r.dir; });
  add("status", [](const RunSummary& r) { return r.status; });
  add("wall time", [](const RunSummary& r) { return hms(r.wall_time_s); });
  add("steps", [](const RunSummary& r) { return std::to_string(r.steps); });
  add("throughput (per s)", [](const RunSummary& r) {
    return std::isfinite(r.samples_per_s) ? fixed(r.samples_per_s, 1) + " " + r.rate_unit : fixed(r.samples_per_s, 1);
  });
  add("step p50", [](const RunSummary& r) { return ms(r.step_p50_s); });
  add("step p95", [](const RunSummary& r) { return ms(r.step_p95_s); });
  add("step p99", [](const RunSummary& r) { return ms(r.step_p99_s); });
  add("step rows (logged steps)", [](const RunSummary& r) { return std::to_string(r.step_rows); });
  add("time: data", [](const RunSummary& r) { return pct(r.share_data); });
  add("time: forward", [](const RunSummary& r) { return pct(r.share_forward); });
  add("time: backward", [](const RunSummary& r) { return pct(r.share_backward); });
  add("time: exposed sync", [](const RunSummary& r) { return pct(r.share_sync); });
  add("time: optimizer", [](const RunSummary& r) { return pct(r.share_optimizer); });
  add("time: other", [](const RunSummary& r) { return pct(r.share_other); });
  add("checkpoints written", [](const RunSummary& r) { return std::to_string(r.checkpoints); });
  add("checkpoints failed/invalid", [](const RunSummary& r) { return std::to_string(r.checkpoint_failures); });
  add("checkpoint mean", [](const RunSummary& r) {
    return known(r.checkpoint_mean_s) ? fmt::format("{:.2f} s", r.checkpoint_mean_s) : std::string("-");
  });
  add("resumes", [](const RunSummary& r) { return std::to_string(r.resumes); });
  add("preemptions", [](const RunSummary& r) { return std::to_string(r.preemptions); });
  add("restarts", [](const RunSummary& r) { return std::to_string(r.restarts); });
  add("final train loss", [](const RunSummary& r) { return fixed(r.final_loss, 4); });
  add("final eval loss", [](const RunSummary& r) { return fixed(r.final_eval_loss, 4); });
  add("final eval accuracy", [](const RunSummary& r) { return pct(r.final_eval_accuracy); });
  add("best checkpoint", [](const RunSummary& r) {
    return r.best_metric.empty() ? std::string("-")
                                 : fmt::format("{} {:.4g} at step {}", r.best_metric, r.best_value, r.best_step);
  });

  std::string out;
  if (format == "md") {
    auto line = [&](const Row& row) {
      out += "| " + row.first;
      for (const auto& c : row.second) out += " | " + c;
      out += " |\n";
    };
    line(rows[0]);
    out += "|---";
    for (size_t i = 0; i < runs.size(); i++) out += "|---:";
    out += "|\n";
    for (size_t i = 1; i < rows.size(); i++) line(rows[i]);
  } else {
    size_t w0 = 0;
    std::vector<size_t> w(runs.size(), 0);
    for (const auto& row : rows) {
      w0 = std::max(w0, row.first.size());
      for (size_t i = 0; i < row.second.size(); i++) w[i] = std::max(w[i], row.second[i].size());
    }
    for (const auto& row : rows) {
      std::string l = fmt::format("{:<{}}", row.first, w0);
      for (size_t i = 0; i < row.second.size(); i++) l += fmt::format("  {:>{}}", row.second[i], w[i]);
      while (!l.empty() && l.back() == ' ') l.pop_back();
      out += l + "\n";
    }
  }
  for (const auto& r : runs)
    for (const auto& n : r.notes) out += (format == "md" ? "\n> note: " : "note: ") + n + "\n";
  return out;
}

std::string report_runs(const std::vector<std::string>& dirs, const std::string& format) {
  if (dirs.empty()) user_error("dtrain report: give at least one run directory");
  if (format != "text" && format != "md" && format != "json")
    user_error("dtrain report: --format {} is not known (expected text, md or json)", format);
  std::vector<RunSummary> runs;
  for (const auto& d : dirs) {
    std::string dir = d;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    runs.push_back(summarize_run(dir));
  }
  return render_report(runs, format);
}

}  // namespace dtrain

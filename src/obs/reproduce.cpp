#include "obs/reproduce.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "obs/report.h"

namespace dtrain {

namespace {

using nlohmann::json;

bool known(double v) { return !std::isnan(v); }

double num(const json& j, const std::string& key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : Verdict::kNone;
}

// What one metrics.jsonl says about the expectation.
struct Curve {
  int64_t evals = 0, reached_step = -1, final_step = -1;
  double time_to_target_s = Verdict::kNone, final_value = Verdict::kNone, best_value = Verdict::kNone;
  double throughput = Verdict::kNone;
  std::string unit;
};

Curve read_curve(const Expectation& e, const std::string& path, std::vector<std::string>& notes) {
  const std::vector<json> rows = read_jsonl(path, notes);
  Curve c;
  double last_train_elapsed = Verdict::kNone, rate_sum = 0;
  int64_t rates = 0;
  bool first_rate = true;
  for (const json& r : rows) {
    const std::string kind = r.value("kind", "");
    if (kind == "train") {
      if (known(num(r, "elapsed_s"))) last_train_elapsed = num(r, "elapsed_s");
      for (const char* k : {"images_per_s", "tokens_per_s"}) {
        const double v = num(r, k);
        if (!known(v)) continue;
        c.unit = k[0] == 'i' ? "images/s" : "tokens/s";
        if (first_rate) {  // the first logged window carries the start-up (as dtrain report drops it)
          first_rate = false;
          continue;
        }
        rate_sum += v;
        ++rates;
      }
      continue;
    }
    if (kind != "eval") continue;
    const double v = num(r, e.metric), step = num(r, "step");
    if (!known(v) || !known(step)) continue;
    ++c.evals;
    c.final_value = v;
    c.final_step = int64_t(step);
    if (!known(c.best_value) || (e.lower_is_better() ? v < c.best_value : v > c.best_value)) c.best_value = v;
    const bool in_steps = e.budget_steps == 0 || int64_t(step) <= e.budget_steps;
    if (c.reached_step < 0 && in_steps && e.reached(v)) {
      c.reached_step = int64_t(step);
      // the eval row's own wall time; rows written before it existed: the last train row's
      c.time_to_target_s = known(num(r, "elapsed_s")) ? num(r, "elapsed_s") : last_train_elapsed;
    }
  }
  if (rates > 0) c.throughput = rate_sum / double(rates);
  return c;
}

std::string value_str(const std::string&, double v) { return known(v) ? fmt::format("{:.4f}", v) : "-"; }

std::string secs(double s) { return known(s) ? fmt::format("{:.1f} s", s) : "-"; }

}  // namespace

bool Expectation::reached(double v) const {
  if (!known(v)) return false;
  return lower_is_better() ? v <= target + tolerance : v >= target - tolerance;
}

Verdict judge_run(const Expectation& e, const std::string& run_dir) {
  Verdict v;
  const Curve c = read_curve(e, run_dir + "/metrics.jsonl", v.notes);
  v.evals = c.evals;
  v.reached_step = c.reached_step;
  v.time_to_target_s = c.time_to_target_s;
  v.final_step = c.final_step;
  v.final_value = c.final_value;
  v.best_value = c.best_value;
  v.throughput = c.throughput;
  v.unit = c.unit;
  if (!e.reference.empty()) {
    const Curve r = read_curve(e, e.reference, v.notes);
    v.ref_final_value = r.final_value;
    v.ref_throughput = r.throughput;
    v.ref_time_to_target_s = r.time_to_target_s;
  }
  const char* cmp = e.lower_is_better() ? "<=" : ">=";
  const std::string by = e.budget_steps > 0 ? fmt::format(" by step {}", e.budget_steps) : "";
  if (c.evals == 0) {
    v.why = fmt::format("the run has no evaluation with {}", e.metric);
  } else if (c.reached_step < 0) {
    v.why = fmt::format("no evaluation reached {} {} {}{}{} (best {})", e.metric, cmp, value_str(e.metric, e.target),
                        e.tolerance > 0 ? fmt::format(" (tolerance {})", e.tolerance) : "", by,
                        value_str(e.metric, c.best_value));
  } else if (e.budget_s > 0 && !(c.time_to_target_s <= e.budget_s)) {
    v.why = fmt::format("the target was reached at step {} after {}, over the budget of {}", c.reached_step,
                        secs(c.time_to_target_s), secs(e.budget_s));
  }
  v.reproduced = v.why.empty();
  return v;
}

std::string Verdict::line(const Expectation& e) const {
  const char* cmp = e.lower_is_better() ? "<=" : ">=";
  std::string s = reproduced ? "reproduced: " : "NOT reproduced: ";
  if (reproduced)
    s += fmt::format("{} {} {} reached at step {} after {}{}", e.metric, cmp, value_str(e.metric, e.target),
                     reached_step, secs(time_to_target_s),
                     e.budget_s > 0 ? fmt::format(" (budget {})", secs(e.budget_s)) : "");
  else
    s += why;
  s += fmt::format(" | final {} {} at step {}", e.metric, value_str(e.metric, final_value), final_step);
  if (known(ref_final_value)) s += fmt::format(" (reference {})", value_str(e.metric, ref_final_value));
  if (known(throughput)) {
    s += fmt::format(" | {:.1f} {}", throughput, unit);
    if (known(ref_throughput) && ref_throughput > 0)
      s += fmt::format(" = {:.2f}x the reference", throughput / ref_throughput);
  }
  if (!e.hardware.empty()) s += fmt::format(" | expected on: {}", e.hardware);
  return s;
}

std::string Verdict::markdown(const Expectation& e, const std::string& run_dir,
                              const std::vector<std::string>& charts) const {
  const char* cmp = e.lower_is_better() ? "<=" : ">=";
  std::string md = fmt::format("# dtrain reproduce: {}\n\n**{}**{}\n\n", e.recipe,
                               reproduced ? "Reproduced" : "Not reproduced", reproduced ? "" : ": " + why);
  md += fmt::format("Run directory: `{}`\n\n", run_dir);
  md += "| | expected | measured | reference run |\n|---|---|---|---|\n";
  md += fmt::format("| target | {} {} {}{} | {} | |\n", e.metric, cmp, value_str(e.metric, e.target),
                    e.tolerance > 0 ? fmt::format(" (tolerance {})", e.tolerance) : "",
                    reached_step >= 0 ? fmt::format("reached at step {}", reached_step) : "not reached");
  md += fmt::format("| time to target | {} | {} | {} |\n", e.budget_s > 0 ? "<= " + secs(e.budget_s) : "-",
                    secs(time_to_target_s), secs(ref_time_to_target_s));
  md += fmt::format("| step budget | {} | {} | |\n", e.budget_steps > 0 ? std::to_string(e.budget_steps) : "end of recipe",
                    reached_step >= 0 ? std::to_string(reached_step) : "-");
  md += fmt::format("| final {} | | {} (step {}) | {} |\n", e.metric, value_str(e.metric, final_value), final_step,
                    value_str(e.metric, ref_final_value));
  md += fmt::format("| best {} | | {} | |\n", e.metric, value_str(e.metric, best_value));
  const bool ratio = known(throughput) && known(ref_throughput) && ref_throughput > 0;
  md += fmt::format("| throughput | | {} | {}{} |\n", known(throughput) ? fmt::format("{:.1f} {}", throughput, unit) : "-",
                    known(ref_throughput) ? fmt::format("{:.1f} {}", ref_throughput, unit) : "-",
                    ratio ? fmt::format(" (measured = {:.2f}x)", throughput / ref_throughput) : "");
  md += fmt::format("\nExpected result measured on: {}\n", e.hardware.empty() ? "(not stated)" : e.hardware);
  if (!e.reference.empty()) md += fmt::format("Reference curve: `{}`\n", e.reference);
  if (!charts.empty()) {
    md += "\n## Charts\n\n";
    for (const std::string& c : charts) md += fmt::format("![{}]({})\n\n", c, c);
  }
  for (const std::string& n : notes) md += fmt::format("\nNote: {}\n", n);
  return md;
}

std::vector<std::string> prepare_command_words(const std::string& line, const std::string& recipe) {
  std::vector<std::string> words;
  std::string cur;
  bool in_word = false;
  char quote = 0;
  for (size_t i = 0; i < line.size(); ++i) {
    const char ch = line[i];
    if (quote) {
      if (ch == quote) quote = 0;
      else if (ch == '\\' && quote == '"' && i + 1 < line.size()) cur += line[++i];
      else cur += ch;
      continue;
    }
    if (ch == '\'' || ch == '"') {
      quote = ch;
      in_word = true;
    } else if (ch == '\\' && i + 1 < line.size()) {
      cur += line[++i];
      in_word = true;
    } else if (ch == ' ' || ch == '\t') {
      if (in_word) words.push_back(cur);
      cur.clear();
      in_word = false;
    } else if (std::strchr(";|&<>`$(){}\n", ch)) {
      user_error("{}: data.prepare = \"{}\": dtrain reproduce runs one dtrain command, without shell syntax ('{}')",
                 recipe, line, ch);
    } else {
      cur += ch;
      in_word = true;
    }
  }
  if (quote) user_error("{}: data.prepare = \"{}\": unterminated quote", recipe, line);
  if (in_word) words.push_back(cur);
  if (words.empty() || words[0] != "dtrain")
    user_error("{}: data.prepare = \"{}\": expected a dtrain command (\"dtrain data ...\")", recipe, line);
  words.erase(words.begin());
  return words;
}

}  // namespace dtrain

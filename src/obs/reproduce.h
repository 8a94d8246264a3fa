#pragma once
// The verdict of `dtrain reproduce`: a finished run's metrics.jsonl judged against the
// expected result a recipe carries in its [expect] table (and, when it names one, against a
// reference run's metrics.jsonl: final metric and throughput).
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace dtrain {

struct Expectation {
  std::string recipe;           // for messages and report.md
  std::string metric;           // eval-row field: eval_accuracy, eval_loss, eval_miou, ...
  double target = 0, tolerance = 0;
  int64_t budget_steps = 0;     // 0: by the end of the run
  double budget_s = 0;          // 0: no time budget
  std::string hardware;         // where the expected result was measured
  std::string reference;        // reference metrics.jsonl ("" = none)
  bool lower_is_better() const { return metric == "eval_loss"; }
  // The value counts as reached: >= target - tolerance (<= target + tolerance for a loss).
  bool reached(double v) const;
};

struct Verdict {
  static constexpr double kNone = std::numeric_limits<double>::quiet_NaN();
  bool reproduced = false;
  std::string why;                        // the failed condition ("" when reproduced)
  int64_t evals = 0;                      // evaluations with the metric in the run
  int64_t reached_step = -1;              // the first evaluation that reached the target
  double time_to_target_s = kNone;        // the run's wall time at that evaluation
  int64_t final_step = -1;
  double final_value = kNone;             // the last evaluation's metric
  double best_value = kNone;
  double throughput = kNone;              // mean images/s or tokens/s of the logged rows (first dropped)
  std::string unit;                       // "images/s" | "tokens/s" ("" when no train rows)
  double ref_final_value = kNone, ref_throughput = kNone, ref_time_to_target_s = kNone;
  std::vector<std::string> notes;         // e.g. a truncated last line skipped

  // One console line: "reproduced: ..." / "NOT reproduced: ...".
  std::string line(const Expectation& e) const;
  // report.md: the verdict, a table of expected against measured, and `charts` (PNG file
  // names in the run directory) as images.
  std::string markdown(const Expectation& e, const std::string& run_dir, const std::vector<std::string>& charts) const;
};

// Judges the run in `run_dir` (its metrics.jsonl; UserError when it is missing or corrupt,
// or when the reference file is). Not reproduced when no evaluation reached the target by
// budget_steps, or the first that did came after budget_s.
Verdict judge_run(const Expectation& e, const std::string& run_dir);

// A recipe's data.prepare line split into the words of the dtrain command it runs, without the
// leading "dtrain" (split as a shell splits a plain command line: '...' and "..." quote,
// backslash escapes). UserError naming `recipe` and the line when it is not one dtrain command
// or holds shell syntax (pipes, redirections, substitutions, several commands).
std::vector<std::string> prepare_command_words(const std::string& line, const std::string& recipe);

}  // namespace dtrain

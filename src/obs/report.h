#pragma once
// `dtrain report RUN_DIR...`: a summary of finished (or running) runs from their
// metrics.jsonl and events.jsonl, one run or several side by side, as text, Markdown
// or JSON.
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtrain {

// `dtrain report`: the runs (directories) summarised side by side in `format` (text | md |
// json). UserError on a bad format, no run, a missing or corrupt metrics.jsonl /
// events.jsonl (naming the file and line).
std::string report_runs(const std::vector<std::string>& dirs, const std::string& format);

struct RunSummary {
  static constexpr double kNone = std::numeric_limits<double>::quiet_NaN();
  std::string dir;
  std::string status = "unknown";  // run_end status: completed|preempted|diverged; "running?" without run_end
  double wall_time_s = kNone;
  int64_t steps = 0;
  // mean of the logged images_per_s, or tokens_per_s for GPT (first row dropped when there are more)
  double samples_per_s = kNone;
  std::string rate_unit = "img";  // what samples_per_s counts: img | tok
  // Step time over the logged train rows (the step at each log interval, not every step).
  size_t step_rows = 0;
  double step_p50_s = kNone, step_p95_s = kNone, step_p99_s = kNone;
  // Share of the summed step time per phase; sync only when rows carry sync_s.
  double share_data = kNone, share_forward = kNone, share_backward = kNone, share_optimizer = kNone,
         share_sync = kNone, share_other = kNone;
  int64_t checkpoints = 0, checkpoint_failures = 0;
  double checkpoint_mean_s = kNone;
  int64_t resumes = 0, preemptions = 0, restarts = 0;
  double final_loss = kNone, final_eval_loss = kNone, final_eval_accuracy = kNone;
  // checkpoint.keep_best: the last `best` event (metric name, value, step); empty metric when none
  std::string best_metric;
  double best_value = kNone;
  int64_t best_step = -1;
  std::vector<std::string> notes;  // e.g. a truncated last line that was skipped
};

RunSummary summarize_run(const std::string& dir);
// Every line of a JSONL file (metrics.jsonl, events.jsonl) as an object. UserError naming
// the file (and line) when it is missing or a line is corrupt; a last line without its
// newline that does not parse is what a crash mid-write leaves: skipped with a note.
std::vector<nlohmann::json> read_jsonl(const std::string& path, std::vector<std::string>& notes);
nlohmann::json summary_json(const RunSummary& s);
// format: text|md|json.
std::string render_report(const std::vector<RunSummary>& runs, const std::string& format);

}  // namespace dtrain

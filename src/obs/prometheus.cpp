#include "obs/prometheus.h"

#include <fmt/format.h>

#include <cmath>

namespace dtrain {

std::string prom_escape_label(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out.push_back(c);
  }
  return out;
}

std::string prom_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{}", int64_t(v));
  return fmt::format("{}", v);
}

namespace {

class Writer {
 public:
  explicit Writer(const Snapshot& s)
      : base_(fmt::format("run=\"{}\",rank=\"{}\"", prom_escape_label(s.run), s.rank)) {}

  void family(const char* name, const char* type, const char* help) {
    out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  // extra: more labels, already escaped, without the leading comma ("" for none).
  void sample(const std::string& name, const std::string& extra, double v) {
    out_ += name;
    out_ += '{';
    out_ += base_;
    if (!extra.empty()) {
      out_ += ',';
      out_ += extra;
    }
    out_ += "} ";
    out_ += prom_number(v);
    out_ += '\n';
  }
  void one(const char* name, const char* type, const char* help, double v) {
    family(name, type, help);
    sample(name, "", v);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string base_, out_;
};

}  // namespace

std::string render_prometheus(const Snapshot& s) {
  Writer w(s);
  w.family("dtrain_step_seconds", "summary",
           "Wall time of one training step; quantiles over the most recent steps, sum and count since the process started.");
  w.sample("dtrain_step_seconds", "quantile=\"0.5\"", s.step_p50_s);
  w.sample("dtrain_step_seconds", "quantile=\"0.95\"", s.step_p95_s);
  w.sample("dtrain_step_seconds", "quantile=\"0.99\"", s.step_p99_s);
  w.sample("dtrain_step_seconds_sum", "", s.step_seconds_sum);
  w.sample("dtrain_step_seconds_count", "", double(s.step_count));

  w.one("dtrain_step", "gauge", "Optimizer steps completed (global step, including steps before a resume).",
        double(s.step));
  w.one("dtrain_samples_total", "counter", "Training samples (images, or sequences) processed by the job's ranks.",
        double(s.samples_total));
  w.one("dtrain_tokens_total", "counter", "Training tokens processed by the job's ranks (token models only).",
        double(s.tokens_total));

  if (s.window_steps > 0) {
    w.family("dtrain_step_phase_seconds", "gauge", "Mean seconds per step spent in each phase over the recent steps.");
    w.sample("dtrain_step_phase_seconds", "phase=\"data\"", s.data_s);
    w.sample("dtrain_step_phase_seconds", "phase=\"forward\"", s.forward_s);
    w.sample("dtrain_step_phase_seconds", "phase=\"backward\"", s.backward_s);
    w.sample("dtrain_step_phase_seconds", "phase=\"sync\"", s.sync_s);
    w.sample("dtrain_step_phase_seconds", "phase=\"optimizer\"", s.optimizer_s);
    w.one("dtrain_grad_sync_exposed_seconds", "gauge",
          "Mean seconds per step of gradient synchronisation not hidden behind backward, over the recent steps.",
          s.sync_s);
  }

  if (!std::isnan(s.last_checkpoint_s))
    w.one("dtrain_checkpoint_seconds", "gauge", "Seconds the most recent checkpoint took to write.",
          s.last_checkpoint_s);
  w.one("dtrain_checkpoints_total", "counter", "Checkpoints written.", double(s.checkpoints_total));
  w.one("dtrain_checkpoint_failures_total", "counter", "Checkpoint writes that failed or checkpoints found invalid.",
        double(s.checkpoint_failures_total));
  w.one("dtrain_resumes_total", "counter", "Resumes from a checkpoint.", double(s.resumes_total));
  w.one("dtrain_preemptions_total", "counter", "Preemptions (SIGTERM/SIGINT) handled.", double(s.preemptions_total));
  w.one("dtrain_restarts_total", "counter", "Worker restarts by the launcher.", double(s.restarts_total));
  w.one("dtrain_stragglers_total", "counter", "Ranks flagged as stragglers, summed over the log steps.",
        double(s.stragglers_total));

  bool any_util = false, any_mem = false;
  for (const auto& g : s.gpus) {
    any_util |= g.utilization_ratio >= 0;
    any_mem |= g.memory_used_bytes >= 0 || g.memory_total_bytes >= 0;
  }
  if (!s.gpus.empty()) {
    w.family("dtrain_gpu_info", "gauge", "GPUs seen by this process (value 1; the name label is the device name).");
    for (const auto& g : s.gpus)
      w.sample("dtrain_gpu_info", fmt::format("gpu=\"{}\",name=\"{}\"", g.index, prom_escape_label(g.name)), 1);
  }
  if (any_util) {
    w.family("dtrain_gpu_utilization_ratio", "gauge",
             "Fraction of the last sample period in which a kernel ran on the GPU (NVML).");
    for (const auto& g : s.gpus)
      if (g.utilization_ratio >= 0) w.sample("dtrain_gpu_utilization_ratio", fmt::format("gpu=\"{}\"", g.index), g.utilization_ratio);
  }
  if (any_mem) {
    w.family("dtrain_gpu_memory_bytes", "gauge", "GPU memory in bytes: used and total (NVML).");
    for (const auto& g : s.gpus) {
      if (g.memory_used_bytes >= 0)
        w.sample("dtrain_gpu_memory_bytes", fmt::format("gpu=\"{}\",kind=\"used\"", g.index), g.memory_used_bytes);
      if (g.memory_total_bytes >= 0)
        w.sample("dtrain_gpu_memory_bytes", fmt::format("gpu=\"{}\",kind=\"total\"", g.index), g.memory_total_bytes);
    }
  }
  if (s.arena_high_water_bytes >= 0)
    w.one("dtrain_arena_high_water_bytes", "gauge", "Most bytes the activation arena has held at once.",
          s.arena_high_water_bytes);
  if (!std::isnan(s.mfu_ratio))
    w.one("dtrain_mfu_ratio", "gauge",
          "Model FLOPs utilisation: achieved model FLOP/s over the device's peak dense FLOP/s.", s.mfu_ratio);
  if (!std::isnan(s.loss)) w.one("dtrain_loss", "gauge", "Training loss of the most recent logged step.", s.loss);
  if (!std::isnan(s.loss_scale))
    w.one("dtrain_loss_scale", "gauge", "fp16 dynamic loss scale after the most recent step.", s.loss_scale);
  if (s.skipped_steps_total >= 0)
    w.one("dtrain_skipped_steps_total", "counter",
          "Steps skipped because fp16 gradients overflowed (inf/nan); each halves the loss scale.",
          double(s.skipped_steps_total));
  if (!std::isnan(s.lr)) w.one("dtrain_learning_rate", "gauge", "Learning rate of the most recent logged step.", s.lr);
  if (s.eval_step >= 0) {
    w.one("dtrain_eval_step", "gauge", "Step of the most recent evaluation.", double(s.eval_step));
    if (!std::isnan(s.eval_loss)) w.one("dtrain_eval_loss", "gauge", "Loss of the most recent evaluation.", s.eval_loss);
    if (!std::isnan(s.eval_value) && !s.eval_metric.empty()) {
      w.family("dtrain_eval_metric", "gauge",
               "Task metric of the most recent evaluation: accuracy, miou (mean IoU) or perplexity.");
      w.sample("dtrain_eval_metric", fmt::format("metric=\"{}\"", s.eval_metric), s.eval_value);
    }
    if (!std::isnan(s.eval_best))
      w.one("dtrain_eval_best", "gauge",
            "Best evaluation so far by checkpoint.keep_best's ranking (accuracy, mIoU, or the lowest GPT val loss).",
            s.eval_best);
  }
  if (!s.moe_expert_tokens_total.empty()) {
    w.family("dtrain_moe_expert_tokens_total", "counter",
             "Token slots the routers sent to each expert, over the MoE layers (this rank's).");
    for (size_t e = 0; e < s.moe_expert_tokens_total.size(); ++e)
      w.sample("dtrain_moe_expert_tokens_total", fmt::format("expert=\"{}\"", e), double(s.moe_expert_tokens_total[e]));
  }
  if (s.moe_dropped_tokens_total >= 0)
    w.one("dtrain_moe_dropped_tokens_total", "counter",
          "Token slots an expert's capacity dropped (model.capacity_factor), over the MoE layers.",
          double(s.moe_dropped_tokens_total));
  if (!std::isnan(s.moe_aux_loss))
    w.one("dtrain_moe_aux_loss", "gauge", "Load-balancing loss (without its coefficient) of the most recent logged step.",
          s.moe_aux_loss);
  if (s.time_unix > 0)
    w.one("dtrain_snapshot_timestamp_seconds", "gauge", "Unix time at which these values were published.",
          s.time_unix);
  return w.take();
}

}  // namespace dtrain

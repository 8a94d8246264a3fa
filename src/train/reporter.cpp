// The run's reporting (reporter.h): console, metrics.jsonl, TensorBoard, Prometheus and events.
#include "train/reporter.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "checkpoint/train_state.h"
#include "core/log.h"
#include "obs/metrics.h"
#include "obs/nvml.h"
#include "obs/peak_flops.h"
#include "obs/stragglers.h"
#include "parallel/data_parallel.h"
#include "session/dist_setup.h"
#include "session/layout.h"
#include "session/pipeline.h"
#include "session/step.h"
#include "train/run_dir.h"

namespace dtrain {

std::string hms(double s) {
  if (!(s >= 0) || s > 1e8) return "?";
  int64_t t = int64_t(s + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60);
  return fmt::format("{}:{:02}", t / 60, t % 60);
}

Reporter::Reporter(Parts p) : p_(std::move(p)) {}

void Reporter::start(const std::string& run_dir, const TrainState& ts) {
  if (!p_.run) return;
  const Session& s = p_.s;
  const Config& cfg = s.cfg;
  DistRuntime* d = p_.d;
  // the whole model's parameters (a pipeline stage holds part of them)
  const int64_t num_params = s.pipe ? s.pipe->full_layout().universal_num_params() : s.params.universal_num_params();
  log::info("run {} | model {}{} | {} parameters | device {} | {} steps ({} per epoch)", run_dir, cfg.model.kind,
            cfg.model.kind == "gpt" ? "" : fmt::format(" depth {}", cfg.model.depth), num_params, s.be->name(),
            s.total_steps, s.steps_per_epoch);
  if (s.base)  // lora.enabled: the parameters above are the adapters
    log::info("LoRA: the {} parameters above are adapters of rank {} (alpha {}) on {}; the model's {} are frozen "
              "(model.init_from)",
              num_params, cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules, s.base->universal_num_params());
  if (s.params.mixed())
    log::info("precision {}: forward/backward in 16 bits on a cast copy of the f32 master weights{}{}",
              cfg.precision.dtype,
              s.scaler.enabled() ? fmt::format(", dynamic loss scale from {}", s.scaler.scale()) : "",
              s.be->device().is_cuda() ? "" : " (emulated on the CPU: for testing, slower than fp32)");
  if (s.opt && s.opt->offloaded())
    log::info("offload: optimizer state, f32 master weights and gradient staging in host memory ({:.1f} MiB per rank, "
              "{} chunks per update); the device holds no optimizer state",
              double(s.opt->host_bytes()) / (1 << 20), s.opt->offload_chunks());
  if (d) {
    // what each rank holds (ZeRO-1/2 shard the optimizer state; parameters and gradients stay
    // full-size unless ZeRO-3 shards them too)
    const double mib = 1.0 / (1 << 20);
    const int64_t np = s.params.sharded() ? s.params.shard_params().numel() : s.params.num_params();
    const int64_t state = s.opt ? s.opt->device_state_bytes() : 0;
    const int zero = d->zero_stage;
    log::info("memory per rank: parameters {:.1f} MiB{} | gradients {:.1f} MiB | optimizer state {:.1f} MiB{}",
              double(np) * 4 * mib,
              s.params.mixed() && !s.params.sharded()
                  ? fmt::format(" + {:.1f} MiB {} copy", double(np) * 2 * mib, cfg.precision.dtype)
                  : "",
              double(np) * 4 * mib, double(state) * mib,
              zero > 0 ? fmt::format(" (ZeRO-{}: 1/{} of the full state)", zero,
                                     zero == 3 ? d->shard_group_size : p_.world_size)
                       : "");
    if (const parallel::Zero3* z3 = d->dp->zero3()) {
      log::info("ZeRO-3: {} units ({} root), gathered one at a time with the next prefetched | windows {:.1f} MiB",
                s.params.units().size(),
                std::count_if(s.params.units().begin(), s.params.units().end(), [](auto& u) { return u.root; }),
                double(z3->window_bytes()) * mib);
      if (z3->replicas() > 1)
        log::info("ZeRO-3 hybrid sharding: shard groups of {} ranks, {} replicas (gradients all-reduced across them)",
                  z3->shard_group_size(), z3->replicas());
    }
    const auto* buckets = d->dp->buckets();
    log::info("data parallel: {} ranks ({}) | {} per rank, {} global batch | zero {} | {} gradient buckets", s.world,
              d->comm->backend_name(), cfg.train.batch_size, p_.layout.global_batch(), zero,
              buckets ? buckets->buckets().size() : 0);
    if (d->tp)
      log::info("tensor parallel: {} ranks per group ({} x {} mesh, tensor innermost) | {} of {} parameters per rank{}",
                s.tp_size, s.world, s.tp_size, s.params.num_params(), s.params.universal_num_params(),
                cfg.parallel.sequence ? " | sequence parallel" : "");
    if (s.pipe) log::info("{}", s.pipe->describe(s.world, s.tp_size, cfg.train.grad_accum));
  }
  // CPU threads as state.json records them: rank 0's count (null on CUDA), every rank's when they differ
  const std::vector<int> threads = job_cpu_threads(s);
  nlohmann::json start = {{"config_hash", cfg.hash()}, {"world_size", p_.world_size},
                          {"version", DTRAIN_VERSION}, {"device", s.be->name()}, {"start_step", ts.step},
                          {"total_steps", s.total_steps}, {"num_params", num_params},
                          {"cpu_threads", threads.empty() ? nlohmann::json(nullptr) : nlohmann::json(threads[0])},
                          {"cpu_threads_from", s.cpu_threads_source}};
  if (threads.size() > 1) start["cpu_threads_per_rank"] = threads;
  {  // rank 0's bytes (every rank holds the same amounts, up to ZeRO's last shard)
    const int64_t held = s.params.sharded() ? s.params.shard_params().numel() : s.params.num_params();
    const parallel::Zero3* z3 = d ? d->dp->zero3() : nullptr;
    start["memory"] = {{"parameters", held * 4 + (s.params.mixed() && !z3 ? held * 2 : 0)},
                       {"gradients", held * 4},
                       {"optimizer_state", s.opt ? s.opt->device_state_bytes() : 0},
                       {"offload_host", s.opt ? s.opt->host_bytes() : 0},
                       {"zero3_windows", z3 ? z3->window_bytes() : 0}};
    if (z3) start["zero3"] = {{"shard_group_size", z3->shard_group_size()}, {"replicas", z3->replicas()}};
  }
  p_.run->event("run_start", start);
}

void Reporter::begin_window() { t_window_ = Clock::now(); }

void Reporter::step(const StepStats& ss, double busy_s) {
  Session& s = p_.s;
  busy_window_.push_back(busy_s);
  if (p_.d) grad_bytes_ += p_.d->dp->grad_bytes();
  rank_samples_ += ss.local_samples;  // train_step reports samples summed over ranks
  pp_idle_s_ += ss.pp_idle_s;
  pp_busy_s_ += ss.pp_busy_s;
  pp_theory_ = ss.pp_bubble_theory;
  window_samples_ += ss.samples;
  if (s.scaler.enabled()) p_.reg.set_loss_scale(s.scaler.scale(), s.scaler.state().skipped_steps);
  // the job's samples (sequences for GPT, whose loss units are tokens) and tokens
  const bool tokens = s.task->unit() == "tok";
  p_.reg.record_step({ss.t.total_s, ss.t.data_s, ss.t.forward_s, ss.t.backward_s, ss.sync_s, ss.t.optimizer_s,
                      ss.samples / std::max<int64_t>(1, s.task->units_per_sample()), tokens ? ss.samples : 0});
}

void Reporter::progress(int64_t step, int64_t total, double loss, double wall_time_s) {
  if (!p_.run || !log::stdout_is_terminal()) return;
  const int width = 30;
  const int filled = int(double(width) * double(step) / double(total));
  log::progress(fmt::format("[{}{}] {}/{} | loss {:.4f} | {}", std::string(size_t(filled), '#'),
                            std::string(size_t(width - filled), '.'), step, total, loss, hms(wall_time_s)));
}

void Reporter::log(int64_t step, const StepStats& ss, double lr, double wall_time_s) {
  Session& s = p_.s;
  DistRuntime* d = p_.d;
  nlohmann::json extra = nlohmann::json::object();
  if (d) {  // collective: every rank, same step
    const double p50 = quantile(busy_window_, 0.5);
    auto ranks = gather_rank_stats(*d, *s.be, {p50, double(rank_samples_)});
    std::vector<double> p50s;
    nlohmann::json rj = nlohmann::json::array();
    for (size_t r = 0; r < ranks.size(); ++r) {
      p50s.push_back(ranks[r].p50_s);
      rj.push_back({{"rank", r}, {"host", p_.hosts.at(r)}, {"step_p50_s", ranks[r].p50_s},
                    {"samples", int64_t(ranks[r].samples)}});
    }
    extra["ranks"] = rj;
    auto slow = find_stragglers(p50s, 0.2);
    if (p_.run && !slow.empty()) {
      nlohmann::json sj = nlohmann::json::array();
      for (auto& sg : slow) {
        log::warn("straggler: rank {} on host {}: step p50 {:.1f} ms is {:.0f}% above the median rank's {:.1f} ms",
                  sg.rank, p_.hosts.at(size_t(sg.rank)), 1e3 * sg.p50_s, 100 * sg.excess, 1e3 * sg.median_s);
        sj.push_back(sg.rank);
      }
      p_.reg.add_stragglers(int64_t(slow.size()));
      extra["stragglers"] = sj;
      p_.run->event("straggler", {{"step", step}, {"ranks", sj}});
    }
  }
  busy_window_.clear();
  if (!p_.run) return;
  const auto now = Clock::now();
  const double win = std::chrono::duration<double>(now - t_window_).count();
  const double ips = win > 0 ? double(window_samples_) / win : 0;
  const double eta = ips > 0 ? double(s.total_steps - step) * double(ss.samples) / ips : 0;
  const double mfu = mfu_ratio(p_.flops_per_unit > 0 ? p_.flops_per_unit * ips : kUnknown, p_.peak);
  const double epoch = double(step) / double(s.steps_per_epoch);
  const std::string unit = s.task->unit();  // img | tok
  const std::string rate_key = unit == "tok" ? "tokens_per_s" : "images_per_s";
  const std::string mfu_s = std::isfinite(mfu) ? fmt::format(" | mfu {:.1f}%", 100 * mfu) : "";
  log::console(fmt::format("step {:>6}/{} | epoch {:6.2f} | loss {:.4f} | lr {:.5f} | {:7.1f} {}/s{} | elapsed {} | eta {}",
                           step, s.total_steps, epoch, ss.loss, lr, ips, unit, mfu_s, hms(wall_time_s), hms(eta)));
  RunDir& run = *p_.run;
  nlohmann::json row = {{"kind", "train"}, {"step", step}, {"epoch", epoch}, {"loss", ss.loss}, {"lr", lr},
                        {rate_key, ips}, {"elapsed_s", wall_time_s},
                        {"step_s", ss.t.total_s}, {"data_s", ss.t.data_s}, {"forward_s", ss.t.forward_s},
                        {"backward_s", ss.t.backward_s}, {"optimizer_s", ss.t.optimizer_s}};
  // measured on this rank (rank 0): the high-water mark of its allocations and of the activations
  row["mem_peak_bytes"] = s.be->alloc_counts().peak_bytes;
  row["activation_bytes"] = int64_t(s.arena->high_water() + (s.scratch_arena ? s.scratch_arena->high_water() : 0));
  if (s.world > 1) {
    row["sync_s"] = ss.sync_s;
    row["world_size"] = s.world;
    if (!(d && d->zero_stage == 3)) row["comm_bytes"] = d->dp->grad_bytes();  // this rank's, this step's gradients
  }
  if (ss.grad_norm >= 0) row["grad_norm"] = ss.grad_norm;
  if (ss.pp_bubble_theory >= 0) {  // pipeline: the step's bubble, theory and measured (idle / compute)
    row["pp_bubble_theory"] = ss.pp_bubble_theory;
    row["pp_bubble_measured"] = ss.pp_busy_s > 0 ? ss.pp_idle_s / ss.pp_busy_s : 0.0;
    row["pp_idle_s"] = ss.pp_idle_s;
    row["pp_busy_s"] = ss.pp_busy_s;
  }
  if (s.scaler.enabled()) {
    row["loss_scale"] = s.scaler.scale();
    row["skipped_steps"] = s.scaler.state().skipped_steps;
    run.scalar("train/loss_scale", s.scaler.scale(), step);
  }
  if (std::isfinite(mfu)) {
    row["mfu"] = mfu;
    run.scalar("train/mfu", mfu, step);
  }
  for (auto& [k, v] : extra.items()) row[k] = v;
  const nlohmann::json task_fields = s.task->step_fields();  // a mixture of experts' routing
  for (auto& [k, v] : task_fields.items()) row[k] = v;
  if (row.contains("moe_aux_loss")) {
    p_.reg.add_moe(row["moe_tokens_per_expert"].get<std::vector<int64_t>>(), row["moe_dropped_tokens"].get<int64_t>(),
                   row["moe_aux_loss"].get<double>());
    run.scalar("train/moe_aux_loss", row["moe_aux_loss"].get<double>(), step);
  }
  p_.reg.set_mfu(mfu);
  p_.reg.set_loss(ss.loss);
  p_.reg.set_lr(lr);
  p_.reg.set_arena_high_water(double(s.arena->high_water()));
  if (p_.nvml.available()) p_.reg.set_gpus(p_.nvml.sample());
  p_.reg.publish();
  // the step-time quantiles of the window /metrics serves (its last 100 steps)
  if (const auto snap = p_.reg.snapshot(); snap && snap->window_steps > 0) {
    row["step_p50_s"] = snap->step_p50_s;
    row["step_p95_s"] = snap->step_p95_s;
    row["step_p99_s"] = snap->step_p99_s;
  }
  run.metrics(row);
  run.scalar("train/loss", ss.loss, step);
  run.scalar("train/lr", lr, step);
  run.scalar("train/" + rate_key, ips, step);
  if (ss.grad_norm >= 0) run.scalar("train/grad_norm", ss.grad_norm, step);
  // the step's phases and the memory high-water marks, as metrics.jsonl has them
  for (const char* k : {"step_s", "data_s", "forward_s", "backward_s", "optimizer_s", "sync_s"})
    if (row.contains(k)) run.scalar(std::string("time/") + k, row[k].get<double>(), step);
  run.scalar("memory/peak_bytes", double(row["mem_peak_bytes"].get<int64_t>()), step);
  run.scalar("memory/activation_bytes", double(row["activation_bytes"].get<int64_t>()), step);
  run.flush();
  t_window_ = now;
  window_samples_ = 0;
}

// `wall_time_s`: the run's wall time when the evaluated step ended (eval rows carry it, so a
// time to target reads off metrics.jsonl).
std::optional<EvalReport> Reporter::evaluate(int64_t step, double wall_time_s) {
  Session& s = p_.s;
  const auto t0 = Clock::now();
  const EvalStats ev = dtrain::evaluate(s, p_.d ? p_.d->dp.get() : nullptr);
  const double secs = seconds_since(t0);
  if (!ev.samples || !p_.run) return std::nullopt;
  RunDir& run = *p_.run;
  EvalReport r = s.task->report(ev);
  log::console(fmt::format("eval  step {:>6} | {} | {:.1f}s", step, r.line, secs));
  nlohmann::json row = {{"kind", "eval"},      {"step", step},           {"eval_loss", ev.loss},
                        {"eval_samples", ev.samples}, {"elapsed_s", wall_time_s}};
  for (auto& [k, v] : r.fields.items()) row[k] = v;
  run.scalar("eval/loss", ev.loss, step);
  for (auto& [tag, v] : r.scalars) run.scalar(tag, v, step);
  run.metrics(row);
  run.flush();
  p_.reg.set_eval(step, ev.loss, r.gauge, r.gauge_value);
  p_.reg.publish();
  r.end_fields["eval_loss"] = ev.loss;
  return r;
}

void Reporter::end(const std::string& run_dir, const TrainState& ts, bool stopped_early,
                   const std::optional<EvalReport>& final_eval) {
  if (!p_.run) return;
  Session& s = p_.s;
  DistRuntime* d = p_.d;
  RunDir& run = *p_.run;
  nlohmann::json end = {{"status", "completed"}, {"step", ts.step}, {"wall_time_s", ts.wall_time_s}};
  if (stopped_early) end["early_stopped"] = true;
  if (pp_theory_ >= 0) {  // pipeline: the bubble over this session's steps
    end["pp_bubble_theory"] = pp_theory_;
    end["pp_bubble_measured"] = pp_busy_s_ > 0 ? pp_idle_s_ / pp_busy_s_ : 0.0;
  }
  if (final_eval) {
    for (auto& [k, v] : final_eval->end_fields.items()) end[k] = v;
    log::console(fmt::format("done: {} steps in {} | {} | run dir {}", ts.step, hms(ts.wall_time_s),
                             final_eval->summary, run_dir));
  } else {
    log::console(fmt::format("done: {} steps in {} | run dir {}", ts.step, hms(ts.wall_time_s), run_dir));
  }
  if (d) {  // rank 0's payload bytes: the gradients over this session, every collective by kind
    auto kinds = [](const comm::CommBytes& b) {
      return nlohmann::json{{"allreduce", b.allreduce}, {"reduce_scatter", b.reduce_scatter},
                            {"allgather", b.allgather}, {"broadcast", b.broadcast}, {"p2p", b.p2p}};
    };
    end["comm_bytes"] = kinds(d->comm->bytes_sent());
    end["comm_bytes"]["gradients"] = grad_bytes_;
    end["comm_bytes"]["grad_compression"] = s.cfg.parallel.grad_compression;
    // model parallelism: what this rank sent in its tensor and pipeline groups, by kind
    if (d->tp_comm) end["comm_bytes"]["tp"] = kinds(d->tp_comm->bytes_sent());
    if (d->pp_comm) end["comm_bytes"]["pp"] = kinds(d->pp_comm->bytes_sent());
  }
  if (const parallel::Zero3* z3 = d ? d->dp->zero3() : nullptr) {  // rank 0's pass collectives
    const parallel::Zero3::Traffic& t = z3->traffic();
    end["zero3_bytes"] = {{"allgather", t.allgather}, {"allgather_f32", t.allgather_f32},
                          {"reduce_scatter", t.reduce_scatter}, {"reduce_dtype", std::string(dtype_name(z3->reduce_dtype()))}};
  }
  if (s.graphs) {  // train.cuda_graph: how often the micro-batches ran as a replayed graph
    end["cuda_graph_captures"] = s.graphs->captures();
    end["cuda_graph_replays"] = s.graphs->replays();
  }
  run.event("run_end", end);
  run.session_end(true);
  run.flush();
}

}  // namespace dtrain

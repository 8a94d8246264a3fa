#include "train/trainer.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <optional>
#include <thread>

#include <fmt/ranges.h>

#include "core/clock.h"
#include "core/failpoint.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "core/signals.h"
#include "obs/http_server.h"
#include "obs/metrics.h"
#include "obs/nvml.h"
#include "obs/peak_flops.h"
#include "obs/stragglers.h"
#include "parallel/param_sync.h"
#include "train/best_tracker.h"
#include "train/checkpointer.h"
#include "session/dist_setup.h"
#include "session/flops.h"
#include "session/layout.h"
#include "checkpoint/init_from.h"
#include "checkpoint/flat_shards.h"
#include "session/pipeline.h"
#include "train/reporter.h"
#include "train/run_dir.h"
#include "session/step.h"
#include "checkpoint/train_state.h"

namespace dtrain {

namespace stdfs = std::filesystem;

namespace {

std::atomic<int> g_signal{0};
extern "C" void on_stop_signal(int sig) { g_signal.store(sig); }

const char* signal_name(int sig) { return sig == SIGINT ? "SIGINT" : "SIGTERM"; }

}  // namespace

struct Trainer::State {
  TrainRequest req;
  comm::DistEnv env;
  ParallelLayout layout;
  bool lead = true;  // rank 0: the only rank that writes the run directory
  std::unique_ptr<Session> s;
  std::unique_ptr<DistRuntime> d;
  MetricRegistry reg;
  std::unique_ptr<HttpServer> http;
  Nvml nvml;
  double flops_per_unit = 0, peak = 0;  // MFU: model FLOPs per loss unit, the devices' peak
  std::optional<InitReport> init;
  std::unique_ptr<RunDir> run;
  std::unique_ptr<Checkpointer> ckpt;
  std::optional<BestTracker> best;
  TrainState ts;
  std::string resumed_from;  // the checkpoint directory this session resumed from (or "")
  // a resume: the newest valid checkpoint this rank found (checksums read once, in setup) and
  // why newer ones were passed over; rank 0's choice is the one every rank loads
  std::string resume_candidate;
  std::vector<std::string> resume_notes;
  std::vector<std::string> hosts;
  std::optional<Reporter> report;  // console, metrics, TensorBoard, Prometheus, events
  Clock::time_point t_start;
  int64_t last_ckpt = 0;
  double wall0 = 0;
  bool stopped_early = false;

  State(TrainRequest r, const comm::DistEnv& e)
      : req(std::move(r)), env(e), lead(e.rank == 0), reg(req.cfg.run.name, e.rank) {}
  const Config& cfg() const { return req.cfg; }
  parallel::DataParallel* dp() { return d ? d->dp.get() : nullptr; }
  bool zero3() const { return d && d->zero_stage == 3; }
  // every rank takes part in an evaluation (collectives inside the forward): ZeRO-3, tensor parallel
  bool eval_all() const { return zero3() || (d && (d->tp || d->pp_comm)); }
};

Trainer::Trainer(TrainRequest req, const comm::DistEnv& env) : st_(std::make_unique<State>(std::move(req), env)) {}
Trainer::~Trainer() = default;

int Trainer::run() {
  setup();
  if (!loop()) return 0;  // preempted: checkpointed
  finish();
  return 0;
}

// ---------------------------------------------------------------------------- setup

void Trainer::setup() {
  State& S = *st_;
  const Config& cfg = S.cfg();
  const comm::DistEnv& env = S.env;
  if (S.lead && S.req.resume && S.req.resume_dir && !stdfs::exists(S.req.run_dir))
    user_error("cannot resume: run directory {} does not exist", S.req.run_dir);

  // Everything that can fail on bad input comes before the run directory is touched, so a
  // corrected rerun does not trip over an empty run. The layout checks every parallelism rule
  // at once; a resume on another number of data ranks keeps the checkpoint's global batch.
  if (S.req.resume) S.resume_candidate = CheckpointManager(S.req.run_dir).latest_valid(&S.resume_notes);
  const CheckpointBatch resumed = checkpoint_batch(S.resume_candidate, cfg.train.grad_accum);
  S.layout = resolve_layout(S.req.cfg, env.distributed ? env.world_size : 1, resumed.global_batch, resumed.data_ranks);
  if (S.lead && !S.layout.batch_note.empty()) log::warn("{}", S.layout.batch_note);
  SessionOptions so;
  if (env.distributed) {
    so = S.layout.session_options(env.rank);
    // only rank 0 evaluates and reports; under ZeRO-3, tensor and pipeline parallelism every
    // rank takes part (the parameters are gathered, the layers' collectives, the stages) and
    // rank 0 reports
    so.with_eval_data = S.lead || S.layout.zero == 3 || S.layout.tensor > 1 || S.layout.pipeline > 1;
    so.device_index = env.local_rank;
  }
  S.s = make_session(cfg, so);
  Session& s = *S.s;
  if (env.distributed) {
    S.d = connect(env, cfg, S.layout, *s.be);
    s.tp = S.d->tp.get();
    if (s.pipe) s.pipe->attach(S.d->pp_comm.get());
    check_same_config(*S.d, cfg.hash());
    s.rank_cpu_threads = gather_cpu_threads(*S.d, s.cpu_threads);
  }
  if (const std::vector<int> threads = job_cpu_threads(s); S.lead && threads.size() > 1)
    log::warn("ranks run with different CPU thread counts ({}): losses will not be bit-identical to a run whose "
              "ranks all use one count (run.threads or OMP_NUM_THREADS sets it)",
              describe_cpu_threads(threads));
  // Metrics: the trainer publishes one snapshot per log step; the HTTP handler only reads it.
  if (S.lead && cfg.observability.prometheus_port > 0)
    S.http = std::make_unique<HttpServer>(cfg.observability.bind, int(cfg.observability.prometheus_port),
                                          metrics_handler(S.reg));
  // MFU: model FLOPs per loss unit over the peak of the devices in the run. No peak (a CPU, or
  // a GPU missing from the table) and no observability.peak_tflops: no MFU.
  S.flops_per_unit = train_flops_per_unit(s);
  S.peak = session_peak_flops(s, S.nvml, env.local_rank);
  S.peak *= double(env.distributed ? env.world_size : 1);  // the rate is summed over ranks

  const bool keep_best = cfg.checkpoint.keep_best;  // its recipe rules: config_cross_check
  if (keep_best && S.lead && !s.task->has_eval())
    user_error("{}: checkpoint.keep_best needs an evaluation split (data.kind = \"{}\" has none)", cfg.source(),
               cfg.data.kind);
  // model.init_from: a fresh run reads the weights now; a resumed one only when it finds no
  // checkpoint (resume_or_init). Every rank reads the same file, so the replicas start equal.
  const std::string init_from = cfg.model.init_from;
  // LoRA: the frozen model is not in the checkpoint (only the adapters are), so a resume reads it too.
  if (!init_from.empty() && (!S.req.resume || s.base)) S.init = init_model_from(s, init_from, cfg.model.init_strict);

  if (S.lead) {
    S.run = std::make_unique<RunDir>(S.req.run_dir, !S.req.resume, cfg.log.tensorboard);
    if (!S.req.resume || !stdfs::exists(S.run->file("config.toml")))
      fs::write_file_atomic(S.run->file("config.toml"), cfg.to_toml());
    S.run->hparams(cfg, cfg.run.name);
  }
  S.ckpt = std::make_unique<Checkpointer>(s, S.d.get(), S.req.run_dir, S.run.get(), S.reg);
  resume_or_init();
  if (S.d) attach(*S.d, s, cfg.parallel.bucket_mb);
  if (S.d) S.d->dp->set_step(S.ts.step);  // PowerSGD's warm-up counts optimizer steps
  if (S.d && !S.resumed_from.empty() && S.d->compression.kind == parallel::GradCompression::PowerSGD) {
    // this rank's error feedback and Q as the checkpoint left them, so the run continues bit
    // for bit; a checkpoint of another world size or bucket layout (or without PowerSGD)
    // starts them again (E = 0, Q from the seed)
    const std::string why = read_powersgd_state(S.resumed_from, S.d->comm->rank(), S.d->comm->size(),
                                                [&](const TensorLookup& l) { return S.d->dp->load_compression_state(l); });
    if (!why.empty()) log::warn("PowerSGD's error feedback and Q start again: {}", why);
  }
  if (S.d) S.hosts = gather_hostnames(*S.d);
  S.best.emplace(keep_best, cfg.train.early_stop_patience, cfg.eval.every_steps);
  S.best->restore(S.ckpt->manager());  // every rank: each must know when early stopping ends the run
  if (S.best->have()) S.reg.set_eval_best(S.best->value());
  S.stopped_early = S.best->exhausted(S.ts.step);  // a run that had stopped early stays stopped
  S.report.emplace(Reporter::Parts{s, S.d.get(), S.run.get(), S.reg, S.nvml, S.layout, S.hosts, S.flops_per_unit,
                                   S.peak, env.distributed ? env.world_size : 1});
  S.report->start(S.req.run_dir, S.ts);
}

void Trainer::resume_or_init() {
  State& S = *st_;
  Session& s = *S.s;
  const Config& cfg = S.cfg();
  std::string ck = S.resume_candidate;
  if (S.d) ck = share_from_rank0(*S.d, "resume_from", ck);
  if (S.req.resume) {
    for (auto& n : S.lead ? S.resume_notes : std::vector<std::string>{}) {
      log::warn("{}", n);
      S.reg.add_checkpoint_failure();
      S.run->event("checkpoint_invalid", {{"note", n}});
    }
    if (ck.empty()) {
      if (S.lead) {
        log::warn("{}: no valid checkpoint to resume from; starting from step 0", S.req.run_dir);
        S.run->event("resume", {{"from", nullptr}, {"reason", "no valid checkpoint"}, {"restart_count", S.env.restart_count}});
      }
    } else {
      S.ts = load_checkpoint(s, ck);
      S.resumed_from = ck;
      log::info("resumed from {} at step {}", ck, S.ts.step);
      const std::vector<int> threads = job_cpu_threads(s), written = S.ts.written_cpu_threads;
      if (S.lead && !threads.empty() && !written.empty() && threads != written) {
        log::warn("resuming with {}, but the checkpoint was written with {}: losses will not be bit-identical to "
                  "an uninterrupted run (run.threads or OMP_NUM_THREADS sets the count)",
                  describe_cpu_threads(threads), describe_cpu_threads(written));
        S.run->event("cpu_threads_changed", {{"step", S.ts.step}, {"checkpoint", written}, {"now", threads}});
      }
      S.reg.add_resume();
      S.reg.set_step(S.ts.step);
      if (S.lead)
        S.run->event("resume", {{"from", ck}, {"step", S.ts.step}, {"fallbacks", S.resume_notes.size()},
                                {"restart_count", S.env.restart_count}});
    }
  }
  // TensorBoard: this process writes the steps after the checkpoint again (from step 1 when it
  // found none); the earlier files' events at those steps are dropped (RunDir::restart_at)
  if (S.req.resume && S.lead) S.run->restart_at(S.ts.step + 1);
  S.reg.add_restarts(S.env.restart_count);  // the launcher's restarts of this group so far
  const std::string init_from = cfg.model.init_from;
  if (ck.empty() && !init_from.empty()) {
    if (!S.init) S.init = init_model_from(s, init_from, cfg.model.init_strict);
    const InitReport& ir = *S.init;
    if (S.lead) {
      log::info("initialised from {}: {} tensors{}{}", ir.file, ir.loaded,
                ir.kept.empty() ? "" : fmt::format("; kept this model's own {}", fmt::join(ir.kept, ", ")),
                ir.ignored.empty() ? "" : fmt::format("; ignored {}", fmt::join(ir.ignored, ", ")));
      S.run->event("init_from", {{"file", ir.file}, {"loaded", ir.loaded}, {"kept", ir.kept}, {"ignored", ir.ignored}});
    }
  }
}

// ---------------------------------------------------------------------------- loop

bool Trainer::loop() {
  State& S = *st_;
  Session& s = *S.s;
  const Config& cfg = S.cfg();
  // SIGINT/SIGTERM (preemption) set a flag; the loop finishes the step, checkpoints and exits 0
  g_signal.store(0);
  StopSignalScope guard(on_stop_signal);
  const int64_t ckpt_every = cfg.checkpoint.every_steps;
  const int64_t eval_every = cfg.eval.every_steps;
  const auto* slow = failpoint::get(failpoint::Point::SlowStep);  // {rank, ms}
  const int64_t slow_ms = slow && (*slow)[0] == S.env.rank ? (*slow)[1] : 0;
  S.wall0 = S.ts.wall_time_s;
  S.t_start = Clock::now();
  S.report->begin_window();
  S.last_ckpt = S.ts.step;
  while (S.ts.step < s.total_steps && !S.stopped_early) {
    const double lr = s.schedule->lr(S.ts.step);
    int sig = g_signal.load();
    if (failpoint::hits(failpoint::Point::StopAtStep, S.ts.step + 1)) sig = SIGTERM;  // a preemption at a known step
    bool stop = sig != 0;
    const auto t_step = Clock::now();
    if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
    const StepStats ss = train_step(s, S.ts.step, lr, S.dp(), S.d ? &stop : nullptr);
    S.report->step(ss, seconds_since(t_step) - ss.sync_s);
    if (S.d && stop && !sig) sig = SIGTERM;  // another rank was signalled: stop at the same step
    if (!S.d && !sig) sig = g_signal.load();  // one process: a signal during the step stops after it
    S.ts.step++;
    s.task->data_state(S.ts.loader, S.ts.position);
    if (ss.skipped)  // every rank says so: the ranks agreed on the overflow
      log::warn("step {}: fp16 gradients overflowed (inf/nan): update skipped, loss scale {} -> {} ({} skipped so far)",
                S.ts.step, ss.loss_scale, s.scaler.scale(), s.scaler.state().skipped_steps);
    if (!std::isfinite(ss.loss)) {
      if (S.lead) {
        S.run->event("run_end", {{"status", "diverged"}, {"step", S.ts.step}});
        S.run->session_end(false);
        S.run->flush();
      }
      fault("loss is {} at step {}: training diverged (lower optim.lr or enable train.clip_grad_norm)", ss.loss,
            S.ts.step);
    }
    S.ts.wall_time_s = S.wall0 + seconds_since(S.t_start);
    S.report->progress(S.ts.step, s.total_steps, ss.loss, S.ts.wall_time_s);
    if (S.ts.step % cfg.log.every_steps == 0 || S.ts.step == s.total_steps)
      S.report->log(S.ts.step, ss, lr, S.ts.wall_time_s);
    S.ckpt->finish_async(false);  // report a background commit that has finished
    const bool last = S.ts.step == s.total_steps;
    if (eval_every > 0 && S.ts.step % eval_every == 0 && !last) S.stopped_early = on_eval(S.ts.step);
    if (sig) {
      if (S.lead) {
        log::warn("received {}: writing a checkpoint at step {} and stopping", signal_name(sig), S.ts.step);
        S.run->event("signal", {{"signal", signal_name(sig)}, {"step", S.ts.step}});
      }
      S.reg.add_preemption();
      if (S.last_ckpt != S.ts.step) S.ckpt->save(S.ts, "preempted");  // else: saved as the best
      S.ckpt->finish_async(true);
      if (S.lead)
        S.run->event("run_end", {{"status", "preempted"}, {"step", S.ts.step}, {"wall_time_s", S.ts.wall_time_s}});
      return false;
    }
    if (ckpt_every > 0 && S.ts.step % ckpt_every == 0 && !last && S.last_ckpt != S.ts.step) {
      S.ckpt->save(S.ts, "periodic");
      S.last_ckpt = S.ts.step;
    }
  }
  return true;
}

bool Trainer::on_eval(int64_t step) {
  State& S = *st_;
  BestTracker& best = *S.best;
  bool improved = false;
  BestMetric m;
  if (S.lead || S.eval_all()) {
    if (auto r = S.report->evaluate(step, S.ts.wall_time_s)) {
      m = r->best;
      improved = best.improves(m);
    }
  }
  // only rank 0 evaluates; saving is collective, so every rank learns its verdict
  if (S.d && best.on()) improved = share_from_rank0(*S.d, fmt::format("best/{}", step), improved ? "1" : "0") == "1";
  if (improved) {
    S.ckpt->save(S.ts, "best");
    S.last_ckpt = step;
    mark_best(step, m);
    return false;
  }
  if (!best.exhausted(step)) return false;
  if (S.lead) {
    log::info("early stop at step {}: {} evaluations without improving on step {}", step, best.patience(), best.step());
    S.run->event("early_stop", {{"step", step}, {"best_step", best.step()}, {"patience", best.patience()}});
  }
  return true;
}

void Trainer::mark_best(int64_t step, const BestMetric& m) {
  State& S = *st_;
  S.best->mark(step, m, S.lead, S.ckpt->manager());
  if (!S.lead) return;
  const std::string dir = S.ckpt->manager().checkpoints_dir() + "/" + CheckpointManager::dir_name(step);
  log::info("best {} {:.6g} at step {}: {}", m.name, m.value, step, dir);
  S.run->event("best", {{"step", step}, {"checkpoint", dir}, {"metric", m.name}, {"value", m.value}});
  S.reg.set_eval_best(m.value);
  S.reg.publish();
}

// ---------------------------------------------------------------------------- finish

void Trainer::finish() {
  State& S = *st_;
  Session& s = *S.s;
  S.ckpt->finish_async(true);  // `latest` is read next
  // every rank agrees whether a final checkpoint is needed (rank 0 sees the files)
  const std::string latest = S.req.run_dir + "/checkpoints/latest";
  bool need_final = S.last_ckpt != S.ts.step || !stdfs::exists(latest);
  if (S.d) need_final = share_from_rank0(*S.d, "final_save", need_final ? "1" : "0") == "1";
  if (need_final) S.ckpt->save(S.ts, "final");
  // the replicas end with equal parameters: one digest all-gather (a rank that skipped an
  // update the others made, or took one they skipped, fails here naming itself)
  if (S.d && !S.zero3()) parallel::verify_params(*S.d->comm, s.params, /*with_buffers=*/false);
  if (!S.lead) {
    if (S.eval_all()) evaluate(s, S.dp());  // the final evaluation's collectives need every rank
    return;
  }
  std::optional<EvalReport> r = S.report->evaluate(S.ts.step, S.ts.wall_time_s);
  // the final checkpoint (saved above, or the periodic one of this step) may be the best
  if (r && S.best->improves(r->best)) mark_best(S.ts.step, r->best);
  S.report->end(S.req.run_dir, S.ts, S.stopped_early, r);
}

}  // namespace dtrain

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
#include "train/dist_setup.h"
#include "train/flops.h"
#include "train/init_from.h"
#include "train/flat_shards.h"
#include "train/pipeline.h"
#include "train/run_dir.h"
#include "train/step.h"
#include "train/train_state.h"

namespace dtrain {

namespace stdfs = std::filesystem;

namespace {

std::atomic<int> g_signal{0};
extern "C" void on_stop_signal(int sig) { g_signal.store(sig); }

std::string hms(double s) {
  if (!(s >= 0) || s > 1e8) return "?";
  int64_t t = int64_t(s + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60);
  return fmt::format("{}:{:02}", t / 60, t % 60);
}

const char* signal_name(int sig) { return sig == SIGINT ? "SIGINT" : "SIGTERM"; }

}  // namespace

struct Trainer::State {
  TrainRequest req;
  comm::DistEnv env;
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
  std::vector<std::string> hosts;
  // the loop's windows since the last log step
  Clock::time_point t_start, t_window;
  int64_t window_samples = 0, rank_samples = 0, last_ckpt = 0;
  std::vector<double> busy_window;  // this rank's busy time per step (step minus gradient sync)
  double wall0 = 0;
  uint64_t grad_bytes = 0;  // this rank's gradient payload bytes over this session's steps
  bool stopped_early = false;

  State(TrainRequest r, const comm::DistEnv& e)
      : req(std::move(r)), env(e), lead(e.rank == 0), reg(req.cfg.s("run.name"), e.rank) {}
  const Config& cfg() const { return req.cfg; }
  parallel::DataParallel* dp() { return d ? d->dp.get() : nullptr; }
  bool zero3() const { return d && d->zero_stage == 3; }
  // every rank takes part in an evaluation (collectives inside the forward): ZeRO-3, tensor parallel
  bool eval_all() const { return zero3() || (d && (d->tp || d->pp_comm)); }
  // pipeline parallelism: the run's waiting and computing time over the stages (run_end)
  double pp_idle_s = 0, pp_busy_s = 0, pp_theory = -1;
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
  // corrected rerun does not trip over an empty run.
  resolve_reduce_dtype(cfg);  // bf16 needs parallel.zero = 3 (also in one process: say so early)
  resolve_grad_compression(cfg);  // and a compression ZeRO-2/3, TP or PP cannot take
  SessionOptions so;
  // tensor parallelism: the T consecutive ranks of a tp group read the same micro-batches (one
  // data-parallel rank); UserError for a T that does not fit before any work
  const int tp = check_tensor_parallel(cfg, env.distributed ? env.world_size : 1);
  // pipeline parallelism: the stages are the outermost mesh dimension (rank = p*(D*T) + d*T + t)
  const int pp = check_pipeline(cfg, env.distributed ? env.world_size : 1).stages;
  if (env.distributed) {
    const int per_stage = env.world_size / pp;
    so.rank = env.rank % per_stage / tp;
    so.world_size = per_stage / tp;
    so.tp_rank = env.rank % tp;
    so.tp_size = tp;
    so.pp_rank = env.rank / per_stage;
    so.pp_size = pp;
    const int64_t zero = cfg.i("parallel.zero");
    // only rank 0 evaluates and reports; under ZeRO-3, tensor and pipeline parallelism every
    // rank takes part (the parameters are gathered, the layers' collectives, the stages) and
    // rank 0 reports
    so.with_eval_data = S.lead || zero == 3 || tp > 1 || pp > 1;
    so.shard_optimizer = zero == 1 || zero == 2;
    so.shard_params = zero == 3;
    so.shard_group_size = resolve_shard_group_size(cfg, so.world_size);  // UserError before any work
    so.device_index = env.local_rank;
  }
  S.s = make_session(cfg, so);
  Session& s = *S.s;
  if (env.distributed) {
    S.d = connect(env, cfg, *s.be);
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
  if (S.lead && cfg.i("observability.prometheus_port") > 0)
    S.http = std::make_unique<HttpServer>(cfg.s("observability.bind"), int(cfg.i("observability.prometheus_port")),
                                          metrics_handler(S.reg));
  // MFU: model FLOPs per loss unit over the peak of the devices in the run. No peak (a CPU, or
  // a GPU missing from the table) and no observability.peak_tflops: no MFU.
  S.flops_per_unit = train_flops_per_unit(s);
  S.peak = session_peak_flops(s, S.nvml, env.local_rank);
  S.peak *= double(env.distributed ? env.world_size : 1);  // the rate is summed over ranks

  const bool keep_best = cfg.b("checkpoint.keep_best");
  const int64_t patience = cfg.i("train.early_stop_patience");
  const int64_t eval_every = cfg.i("eval.every_steps");
  if (patience > 0 && (!keep_best || eval_every == 0))
    user_error("{}: train.early_stop_patience = {} needs checkpoint.keep_best = true and eval.every_steps > 0 (it "
               "ranks the evaluations as keep_best does)",
               cfg.source(), patience);
  if (keep_best && S.lead && !s.task->has_eval())
    user_error("{}: checkpoint.keep_best needs an evaluation split (data.kind = \"{}\" has none)", cfg.source(),
               cfg.s("data.kind"));
  // model.init_from: a fresh run reads the weights now; a resumed one only when it finds no
  // checkpoint (resume_or_init). Every rank reads the same file, so the replicas start equal.
  const std::string init_from = cfg.s("model.init_from");
  if (!init_from.empty() && !S.req.resume) S.init = init_model_from(s, init_from, cfg.b("model.init_strict"));

  if (S.lead) {
    S.run = std::make_unique<RunDir>(S.req.run_dir, !S.req.resume, cfg.b("log.tensorboard"));
    if (!S.req.resume || !stdfs::exists(S.run->file("config.toml")))
      fs::write_file_atomic(S.run->file("config.toml"), cfg.to_toml());
    S.run->hparams(cfg, cfg.s("run.name"));
  }
  S.ckpt = std::make_unique<Checkpointer>(s, S.d.get(), S.req.run_dir, S.run.get(), S.reg);
  resume_or_init();
  if (S.d) attach(*S.d, s, cfg.f("parallel.bucket_mb"));
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
  S.best.emplace(keep_best, patience, eval_every);
  S.best->restore(S.ckpt->manager());  // every rank: each must know when early stopping ends the run
  if (S.best->have()) S.reg.set_eval_best(S.best->value());
  S.stopped_early = S.best->exhausted(S.ts.step);  // a run that had stopped early stays stopped
  announce();
}

void Trainer::resume_or_init() {
  State& S = *st_;
  Session& s = *S.s;
  const Config& cfg = S.cfg();
  std::string ck;
  std::vector<std::string> notes;
  if (S.req.resume && S.lead) ck = S.ckpt->manager().latest_valid(&notes);
  if (S.d) ck = share_from_rank0(*S.d, "resume_from", S.req.resume ? ck : "");
  if (S.req.resume) {
    for (auto& n : notes) {
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
        S.run->event("resume", {{"from", ck}, {"step", S.ts.step}, {"fallbacks", notes.size()},
                                {"restart_count", S.env.restart_count}});
    }
  }
  // TensorBoard: this process writes the steps after the checkpoint again (from step 1 when it
  // found none); the earlier files' events at those steps are dropped (RunDir::restart_at)
  if (S.req.resume && S.lead) S.run->restart_at(S.ts.step + 1);
  S.reg.add_restarts(S.env.restart_count);  // the launcher's restarts of this group so far
  const std::string init_from = cfg.s("model.init_from");
  if (ck.empty() && !init_from.empty()) {
    if (!S.init) S.init = init_model_from(s, init_from, cfg.b("model.init_strict"));
    const InitReport& ir = *S.init;
    if (S.lead) {
      log::info("initialised from {}: {} tensors{}{}", ir.file, ir.loaded,
                ir.kept.empty() ? "" : fmt::format("; kept this model's own {}", fmt::join(ir.kept, ", ")),
                ir.ignored.empty() ? "" : fmt::format("; ignored {}", fmt::join(ir.ignored, ", ")));
      S.run->event("init_from", {{"file", ir.file}, {"loaded", ir.loaded}, {"kept", ir.kept}, {"ignored", ir.ignored}});
    }
  }
}

void Trainer::announce() {
  State& S = *st_;
  if (!S.lead) return;
  const Session& s = *S.s;
  const Config& cfg = S.cfg();
  // the whole model's parameters (a pipeline stage holds part of them)
  const int64_t num_params = s.pipe ? s.pipe->full_layout().universal_num_params() : s.params.universal_num_params();
  log::info("run {} | model {}{} | {} parameters | device {} | {} steps ({} per epoch)", S.req.run_dir,
            cfg.s("model.kind"), cfg.s("model.kind") == "gpt" ? "" : fmt::format(" depth {}", cfg.i("model.depth")),
            num_params, s.be->name(), s.total_steps, s.steps_per_epoch);
  if (s.params.mixed())
    log::info("precision {}: forward/backward in 16 bits on a cast copy of the f32 master weights{}{}",
              cfg.s("precision.dtype"),
              s.scaler.enabled() ? fmt::format(", dynamic loss scale from {}", s.scaler.scale()) : "",
              s.be->device().is_cuda() ? "" : " (emulated on the CPU: for testing, slower than fp32)");
  if (s.opt && s.opt->offloaded())
    log::info("offload: optimizer state, f32 master weights and gradient staging in host memory ({:.1f} MiB per rank, "
              "{} chunks per update); the device holds no optimizer state",
              double(s.opt->host_bytes()) / (1 << 20), s.opt->offload_chunks());
  if (S.d) {
    // what each rank holds (ZeRO-1/2 shard the optimizer state; parameters and gradients stay
    // full-size unless ZeRO-3 shards them too)
    const double mib = 1.0 / (1 << 20);
    const int64_t np = s.params.sharded() ? s.params.shard_params().numel() : s.params.num_params();
    const int64_t state = s.opt ? s.opt->device_state_bytes() : 0;
    const int zero = S.d->zero_stage;
    log::info("memory per rank: parameters {:.1f} MiB{} | gradients {:.1f} MiB | optimizer state {:.1f} MiB{}",
              double(np) * 4 * mib,
              s.params.mixed() && !s.params.sharded()
                  ? fmt::format(" + {:.1f} MiB {} copy", double(np) * 2 * mib, cfg.s("precision.dtype"))
                  : "",
              double(np) * 4 * mib, double(state) * mib,
              zero > 0 ? fmt::format(" (ZeRO-{}: 1/{} of the full state)", zero,
                                     zero == 3 ? S.d->shard_group_size : S.env.world_size)
                       : "");
    if (const parallel::Zero3* z3 = S.d->dp->zero3()) {
      log::info("ZeRO-3: {} units ({} root), gathered one at a time with the next prefetched | windows {:.1f} MiB",
                s.params.units().size(),
                std::count_if(s.params.units().begin(), s.params.units().end(), [](auto& u) { return u.root; }),
                double(z3->window_bytes()) * mib);
      if (z3->replicas() > 1)
        log::info("ZeRO-3 hybrid sharding: shard groups of {} ranks, {} replicas (gradients all-reduced across them)",
                  z3->shard_group_size(), z3->replicas());
    }
    const auto* buckets = S.d->dp->buckets();
    log::info("data parallel: {} ranks ({}) | {} per rank, {} global batch | zero {} | {} gradient buckets",
              s.world, S.d->comm->backend_name(), cfg.i("train.batch_size"),
              cfg.i("train.batch_size") * cfg.i("train.grad_accum") * s.world, zero,
              buckets ? buckets->buckets().size() : 0);
    if (S.d->tp)
      log::info("tensor parallel: {} ranks per group ({} x {} mesh, tensor innermost) | {} of {} parameters per rank{}",
                s.tp_size, s.world, s.tp_size, s.params.num_params(), s.params.universal_num_params(),
                cfg.b("parallel.sequence") ? " | sequence parallel" : "");
    if (s.pipe) log::info("{}", s.pipe->describe(s.world, s.tp_size, cfg.i("train.grad_accum")));
  }
  // CPU threads as state.json records them: rank 0's count (null on CUDA), every rank's when they differ
  const std::vector<int> threads = job_cpu_threads(s);
  nlohmann::json start = {{"config_hash", cfg.hash()}, {"world_size", S.env.world_size},
                          {"version", DTRAIN_VERSION}, {"device", s.be->name()}, {"start_step", S.ts.step},
                          {"total_steps", s.total_steps}, {"num_params", num_params},
                          {"cpu_threads", threads.empty() ? nlohmann::json(nullptr) : nlohmann::json(threads[0])},
                          {"cpu_threads_from", s.cpu_threads_source}};
  if (threads.size() > 1) start["cpu_threads_per_rank"] = threads;
  {  // rank 0's bytes (every rank holds the same amounts, up to ZeRO's last shard)
    const int64_t held = s.params.sharded() ? s.params.shard_params().numel() : s.params.num_params();
    const parallel::Zero3* z3 = S.d ? S.d->dp->zero3() : nullptr;
    start["memory"] = {{"parameters", held * 4 + (s.params.mixed() && !z3 ? held * 2 : 0)},
                       {"gradients", held * 4},
                       {"optimizer_state", s.opt ? s.opt->device_state_bytes() : 0},
                       {"offload_host", s.opt ? s.opt->host_bytes() : 0},
                       {"zero3_windows", z3 ? z3->window_bytes() : 0}};
    if (z3) start["zero3"] = {{"shard_group_size", z3->shard_group_size()}, {"replicas", z3->replicas()}};
  }
  S.run->event("run_start", start);
}

// ---------------------------------------------------------------------------- loop

bool Trainer::loop() {
  State& S = *st_;
  Session& s = *S.s;
  const Config& cfg = S.cfg();
  // SIGINT/SIGTERM (preemption) set a flag; the loop finishes the step, checkpoints and exits 0
  g_signal.store(0);
  StopSignalScope guard(on_stop_signal);
  const int64_t ckpt_every = cfg.i("checkpoint.every_steps");
  const int64_t eval_every = cfg.i("eval.every_steps");
  const auto* slow = failpoint::get(failpoint::Point::SlowStep);  // {rank, ms}
  const int64_t slow_ms = slow && (*slow)[0] == S.env.rank ? (*slow)[1] : 0;
  S.wall0 = S.ts.wall_time_s;
  S.t_start = S.t_window = Clock::now();
  S.last_ckpt = S.ts.step;
  while (S.ts.step < s.total_steps && !S.stopped_early) {
    const double lr = s.schedule->lr(S.ts.step);
    int sig = g_signal.load();
    if (failpoint::hits(failpoint::Point::StopAtStep, S.ts.step + 1)) sig = SIGTERM;  // a preemption at a known step
    bool stop = sig != 0;
    const auto t_step = Clock::now();
    if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
    const StepStats ss = train_step(s, S.ts.step, lr, S.dp(), S.d ? &stop : nullptr);
    S.busy_window.push_back(seconds_since(t_step) - ss.sync_s);
    if (S.d) S.grad_bytes += S.d->dp->grad_bytes();
    S.rank_samples += ss.local_samples;  // train_step reports samples summed over ranks
    S.pp_idle_s += ss.pp_idle_s;
    S.pp_busy_s += ss.pp_busy_s;
    S.pp_theory = ss.pp_bubble_theory;
    if (S.d && stop && !sig) sig = SIGTERM;  // another rank was signalled: stop at the same step
    if (!S.d && !sig) sig = g_signal.load();  // one process: a signal during the step stops after it
    S.ts.step++;
    s.task->data_state(S.ts.loader, S.ts.position);
    if (ss.skipped)  // every rank says so: the ranks agreed on the overflow
      log::warn("step {}: fp16 gradients overflowed (inf/nan): update skipped, loss scale {} -> {} ({} skipped so far)",
                S.ts.step, ss.loss_scale, s.scaler.scale(), s.scaler.state().skipped_steps);
    if (s.scaler.enabled()) S.reg.set_loss_scale(s.scaler.scale(), s.scaler.state().skipped_steps);
    S.window_samples += ss.samples;
    {  // the job's samples (sequences for GPT, whose loss units are tokens) and tokens
      const bool tokens = s.task->unit() == "tok";
      S.reg.record_step({ss.t.total_s, ss.t.data_s, ss.t.forward_s, ss.t.backward_s, ss.sync_s, ss.t.optimizer_s,
                         ss.samples / std::max<int64_t>(1, s.task->units_per_sample()), tokens ? ss.samples : 0});
    }
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
    if (S.lead && log::stdout_is_terminal()) {
      const int width = 30;
      const int filled = int(double(width) * double(S.ts.step) / double(s.total_steps));
      log::progress(fmt::format("[{}{}] {}/{} | loss {:.4f} | {}", std::string(size_t(filled), '#'),
                                std::string(size_t(width - filled), '.'), S.ts.step, s.total_steps, ss.loss,
                                hms(S.ts.wall_time_s)));
    }
    on_log(S.ts.step, ss, lr);
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

void Trainer::on_log(int64_t step, const StepStats& ss, double lr) {
  State& S = *st_;
  Session& s = *S.s;
  if (step % S.cfg().i("log.every_steps") != 0 && step != s.total_steps) return;
  nlohmann::json extra = nlohmann::json::object();
  if (S.d) {  // collective: every rank, same step
    const double p50 = quantile(S.busy_window, 0.5);
    auto ranks = gather_rank_stats(*S.d, *s.be, {p50, double(S.rank_samples)});
    std::vector<double> p50s;
    nlohmann::json rj = nlohmann::json::array();
    for (size_t r = 0; r < ranks.size(); ++r) {
      p50s.push_back(ranks[r].p50_s);
      rj.push_back({{"rank", r}, {"host", S.hosts.at(r)}, {"step_p50_s", ranks[r].p50_s},
                    {"samples", int64_t(ranks[r].samples)}});
    }
    extra["ranks"] = rj;
    auto slow = find_stragglers(p50s, 0.2);
    if (S.lead && !slow.empty()) {
      nlohmann::json sj = nlohmann::json::array();
      for (auto& sg : slow) {
        log::warn("straggler: rank {} on host {}: step p50 {:.1f} ms is {:.0f}% above the median rank's {:.1f} ms",
                  sg.rank, S.hosts.at(size_t(sg.rank)), 1e3 * sg.p50_s, 100 * sg.excess, 1e3 * sg.median_s);
        sj.push_back(sg.rank);
      }
      S.reg.add_stragglers(int64_t(slow.size()));
      extra["stragglers"] = sj;
      S.run->event("straggler", {{"step", step}, {"ranks", sj}});
    }
  }
  S.busy_window.clear();
  if (!S.lead) return;
  const auto now = Clock::now();
  const double win = std::chrono::duration<double>(now - S.t_window).count();
  const double ips = win > 0 ? double(S.window_samples) / win : 0;
  const double eta = ips > 0 ? double(s.total_steps - step) * double(ss.samples) / ips : 0;
  const double mfu = mfu_ratio(S.flops_per_unit > 0 ? S.flops_per_unit * ips : kUnknown, S.peak);
  const double epoch = double(step) / double(s.steps_per_epoch);
  const std::string unit = s.task->unit();  // img | tok
  const std::string rate_key = unit == "tok" ? "tokens_per_s" : "images_per_s";
  const std::string mfu_s = std::isfinite(mfu) ? fmt::format(" | mfu {:.1f}%", 100 * mfu) : "";
  log::console(fmt::format("step {:>6}/{} | epoch {:6.2f} | loss {:.4f} | lr {:.5f} | {:7.1f} {}/s{} | elapsed {} | eta {}",
                           step, s.total_steps, epoch, ss.loss, lr, ips, unit, mfu_s, hms(S.ts.wall_time_s), hms(eta)));
  RunDir& run = *S.run;
  nlohmann::json row = {{"kind", "train"}, {"step", step}, {"epoch", epoch}, {"loss", ss.loss}, {"lr", lr},
                        {rate_key, ips}, {"elapsed_s", S.ts.wall_time_s},
                        {"step_s", ss.t.total_s}, {"data_s", ss.t.data_s}, {"forward_s", ss.t.forward_s},
                        {"backward_s", ss.t.backward_s}, {"optimizer_s", ss.t.optimizer_s}};
  // measured on this rank (rank 0): the high-water mark of its allocations and of the activations
  row["mem_peak_bytes"] = s.be->alloc_counts().peak_bytes;
  row["activation_bytes"] = int64_t(s.arena->high_water() + (s.scratch_arena ? s.scratch_arena->high_water() : 0));
  if (s.world > 1) {
    row["sync_s"] = ss.sync_s;
    row["world_size"] = s.world;
    if (!S.zero3()) row["comm_bytes"] = S.d->dp->grad_bytes();  // this rank's, this step's gradients
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
  S.reg.set_mfu(mfu);
  S.reg.set_loss(ss.loss);
  S.reg.set_lr(lr);
  S.reg.set_arena_high_water(double(s.arena->high_water()));
  if (S.nvml.available()) S.reg.set_gpus(S.nvml.sample());
  S.reg.publish();
  // the step-time quantiles of the window /metrics serves (its last 100 steps)
  if (const auto snap = S.reg.snapshot(); snap && snap->window_steps > 0) {
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
  S.t_window = now;
  S.window_samples = 0;
}

namespace {

// Rank 0's evaluation: console, metrics.jsonl, TensorBoard and the Prometheus gauges.
// ZeRO-3: every rank evaluates, and the others pass run = nullptr (no report).
// `elapsed_s`: the run's wall time when the evaluated step ended (eval rows carry it, so a
// time to target reads off metrics.jsonl).
std::optional<EvalReport> evaluate_and_report(Session& s, parallel::DataParallel* dp, int64_t step, double elapsed_s,
                                              RunDir* run_dir, MetricRegistry& reg) {
  const auto t0 = Clock::now();
  const EvalStats ev = evaluate(s, dp);
  const double secs = seconds_since(t0);
  if (!ev.samples || !run_dir) return std::nullopt;
  RunDir& run = *run_dir;
  EvalReport r = s.task->report(ev);
  log::console(fmt::format("eval  step {:>6} | {} | {:.1f}s", step, r.line, secs));
  nlohmann::json row = {{"kind", "eval"},      {"step", step},           {"eval_loss", ev.loss},
                        {"eval_samples", ev.samples}, {"elapsed_s", elapsed_s}};
  for (auto& [k, v] : r.fields.items()) row[k] = v;
  run.scalar("eval/loss", ev.loss, step);
  for (auto& [tag, v] : r.scalars) run.scalar(tag, v, step);
  run.metrics(row);
  run.flush();
  reg.set_eval(step, ev.loss, r.gauge, r.gauge_value);
  reg.publish();
  r.end_fields["eval_loss"] = ev.loss;
  return r;
}

}  // namespace

bool Trainer::on_eval(int64_t step) {
  State& S = *st_;
  BestTracker& best = *S.best;
  bool improved = false;
  BestMetric m;
  if (S.lead || S.eval_all()) {
    if (auto r = evaluate_and_report(*S.s, S.dp(), step, S.ts.wall_time_s, S.lead ? S.run.get() : nullptr, S.reg)) {
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
  RunDir& run = *S.run;
  nlohmann::json end = {{"status", "completed"}, {"step", S.ts.step}, {"wall_time_s", S.ts.wall_time_s}};
  if (S.stopped_early) end["early_stopped"] = true;
  if (S.pp_theory >= 0) {  // pipeline: the bubble over this session's steps
    end["pp_bubble_theory"] = S.pp_theory;
    end["pp_bubble_measured"] = S.pp_busy_s > 0 ? S.pp_idle_s / S.pp_busy_s : 0.0;
  }
  if (auto r = evaluate_and_report(s, S.dp(), S.ts.step, S.ts.wall_time_s, &run, S.reg)) {
    // the final checkpoint (saved above, or the periodic one of this step) may be the best
    if (S.best->improves(r->best)) mark_best(S.ts.step, r->best);
    for (auto& [k, v] : r->end_fields.items()) end[k] = v;
    log::console(fmt::format("done: {} steps in {} | {} | run dir {}", S.ts.step, hms(S.ts.wall_time_s), r->summary,
                             S.req.run_dir));
  } else {
    log::console(fmt::format("done: {} steps in {} | run dir {}", S.ts.step, hms(S.ts.wall_time_s), S.req.run_dir));
  }
  if (S.d) {  // rank 0's payload bytes: the gradients over this session, every collective by kind
    auto kinds = [](const comm::CommBytes& b) {
      return nlohmann::json{{"allreduce", b.allreduce}, {"reduce_scatter", b.reduce_scatter},
                            {"allgather", b.allgather}, {"broadcast", b.broadcast}, {"p2p", b.p2p}};
    };
    end["comm_bytes"] = kinds(S.d->comm->bytes_sent());
    end["comm_bytes"]["gradients"] = S.grad_bytes;
    end["comm_bytes"]["grad_compression"] = S.cfg().s("parallel.grad_compression");
    // model parallelism: what this rank sent in its tensor and pipeline groups, by kind
    if (S.d->tp_comm) end["comm_bytes"]["tp"] = kinds(S.d->tp_comm->bytes_sent());
    if (S.d->pp_comm) end["comm_bytes"]["pp"] = kinds(S.d->pp_comm->bytes_sent());
  }
  if (const parallel::Zero3* z3 = S.d ? S.d->dp->zero3() : nullptr) {  // rank 0's pass collectives
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

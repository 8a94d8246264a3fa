// dtrain train: the training loop, run directory, checkpoints, resume and preemption.
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <unistd.h>

#include <fmt/ranges.h>

#include "cli/commands.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "dist/launcher.h"
#include "obs/http_server.h"
#include "obs/metrics.h"
#include "obs/nvml.h"
#include "obs/peak_flops.h"
#include "obs/stragglers.h"
#include "train/async_commit.h"
#include "train/checkpoint.h"
#include "train/dist_checkpoint.h"
#include "train/dist_setup.h"
#include "train/flops.h"
#include "train/init_from.h"
#include "train/optim_shards.h"
#include "train/run_dir.h"
#include "train/step.h"
#include "train/train_state.h"

namespace dtrain {

namespace stdfs = std::filesystem;

namespace {

std::atomic<int> g_signal{0};
extern "C" void on_stop_signal(int sig) { g_signal.store(sig); }

struct SignalGuard {
  struct sigaction old_int{}, old_term{};
  SignalGuard() {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
  }
  ~SignalGuard() {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  }
};

std::string hms(double s) {
  if (!(s >= 0) || s > 1e8) return "?";
  int64_t t = int64_t(s + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60);
  return fmt::format("{}:{:02}", t / 60, t % 60);
}

// Resolves the recipe and the run directory of a train invocation.
struct Resolved {
  std::optional<Config> cfg;
  std::string run_dir;
  bool resume = false;
};

Resolved resolve(const TrainArgs& a) {
  Resolved r;
  r.resume = a.resume;
  if (!a.config.empty()) {
    r.cfg = Config::load(a.config, a.overrides);
    r.run_dir = r.cfg->s("run.out_dir") + "/" + r.cfg->s("run.name");
    if (a.resume && !a.resume_dir.empty()) r.run_dir = a.resume_dir;
  } else if (a.resume && !a.resume_dir.empty()) {
    std::string cfg_path = a.resume_dir + "/config.toml";
    if (!stdfs::exists(cfg_path))
      user_error("cannot resume {}: {} not found (is it a dtrain run directory?)", a.resume_dir, cfg_path);
    r.cfg = Config::load(cfg_path, a.overrides);
    r.run_dir = a.resume_dir;
  } else {
    user_error("dtrain train: give a recipe (dtrain train CONFIG) or a run to resume (dtrain train --resume RUN_DIR)");
  }
  if (!a.device.empty()) r.cfg->set("run.device", "\"" + a.device + "\"");
  while (r.run_dir.size() > 1 && r.run_dir.back() == '/') r.run_dir.pop_back();
  return r;
}

// mfu: NaN = unknown (left out); extra: more fields of the metrics.jsonl row.
void log_line(const Session& s, int64_t step, const StepStats& st, double lr, double imgs_per_s, double elapsed,
              double eta, double mfu, const nlohmann::json& extra, RunDir& run) {
  double epoch = double(step) / double(s.steps_per_epoch);
  const std::string unit = s.task->unit();  // img | tok
  const std::string rate_key = unit == "tok" ? "tokens_per_s" : "images_per_s";
  const std::string mfu_s = std::isfinite(mfu) ? fmt::format(" | mfu {:.1f}%", 100 * mfu) : "";
  log::console(fmt::format("step {:>6}/{} | epoch {:6.2f} | loss {:.4f} | lr {:.5f} | {:7.1f} {}/s{} | elapsed {} | eta {}",
                           step, s.total_steps, epoch, st.loss, lr, imgs_per_s, unit, mfu_s, hms(elapsed), hms(eta)));
  nlohmann::json row = {{"kind", "train"}, {"step", step}, {"epoch", epoch}, {"loss", st.loss}, {"lr", lr},
                        {rate_key, imgs_per_s}, {"elapsed_s", elapsed},
                        {"step_s", st.t.total_s}, {"data_s", st.t.data_s}, {"forward_s", st.t.forward_s},
                        {"backward_s", st.t.backward_s}, {"optimizer_s", st.t.optimizer_s}};
  if (s.world > 1) {
    row["sync_s"] = st.sync_s;
    row["world_size"] = s.world;
  }
  if (st.grad_norm >= 0) row["grad_norm"] = st.grad_norm;
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
  run.metrics(row);
  run.scalar("train/loss", st.loss, step);
  run.scalar("train/lr", lr, step);
  run.scalar("train/" + rate_key, imgs_per_s, step);
  run.flush();
}

EvalStats run_eval(Session& s, int64_t step, RunDir& run) {
  auto t0 = std::chrono::steady_clock::now();
  EvalStats ev = evaluate(s);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!ev.samples) return ev;
  nlohmann::json row = {{"kind", "eval"}, {"step", step}, {"eval_loss", ev.loss}, {"eval_samples", ev.samples}};
  run.scalar("eval/loss", ev.loss, step);
  const std::string kind = s.task->kind();
  if (kind == "lm") {
    log::console(fmt::format("eval  step {:>6} | val loss {:.4f} | val perplexity {:.3f} | {} tokens | {:.1f}s", step,
                             ev.loss, ev.perplexity, ev.tokens, secs));
    row["eval_perplexity"] = ev.perplexity;
    row["eval_tokens"] = ev.tokens;
    run.scalar("eval/perplexity", ev.perplexity, step);
  } else if (kind == "segment") {
    std::string per_class;
    for (size_t k = 0; k < ev.class_iou.size(); ++k)
      per_class += fmt::format("{}{:.3f}", k ? " " : "", ev.class_iou[k]);
    log::console(fmt::format("eval  step {:>6} | val loss {:.4f} | mIoU {:.4f} | mDice {:.4f} | IoU per class [{}] | "
                             "{} samples | {:.1f}s",
                             step, ev.loss, ev.mean_iou, ev.mean_dice, per_class, ev.samples, secs));
    row["eval_miou"] = ev.mean_iou;
    row["eval_dice"] = ev.mean_dice;
    row["eval_pixel_accuracy"] = ev.pixel_accuracy;
    nlohmann::json ious = nlohmann::json::array();
    for (size_t k = 0; k < ev.class_iou.size(); ++k) {
      const double v = ev.class_iou[k];
      ious.push_back(std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr));
      if (std::isfinite(v)) run.scalar(fmt::format("eval/iou_class_{}", k), v, step);
    }
    row["eval_class_iou"] = ious;
    run.scalar("eval/miou", ev.mean_iou, step);
    run.scalar("eval/dice", ev.mean_dice, step);
  } else {
    const std::string top5 = ev.accuracy_top5 >= 0 ? fmt::format(" | top-5 {:.2f}%", 100 * ev.accuracy_top5) : "";
    log::console(fmt::format("eval  step {:>6} | test loss {:.4f} | test accuracy {:.2f}%{} | {} samples | {:.1f}s",
                             step, ev.loss, 100 * ev.accuracy, top5, ev.samples, secs));
    row["eval_accuracy"] = ev.accuracy;
    run.scalar("eval/accuracy", ev.accuracy, step);
    if (ev.accuracy_top5 >= 0) {
      row["eval_accuracy_top5"] = ev.accuracy_top5;
      run.scalar("eval/accuracy_top5", ev.accuracy_top5, step);
    }
  }
  run.metrics(row);
  run.flush();
  return ev;
}

// checkpoint.keep_best: the evaluation's metric (name, value, higher is better) by task:
// accuracy (classification), mIoU (segmentation), val loss (language model, lower is better).
struct BestMetric {
  std::string name;
  double value = 0;
  bool higher = true;
};
BestMetric best_metric(const Session& s, const EvalStats& ev) {
  const std::string kind = s.task->kind();
  if (kind == "lm") return {"eval_loss", ev.loss, false};
  if (kind == "segment") return {"eval_miou", ev.mean_iou, true};
  return {"eval_accuracy", ev.accuracy, true};
}

// The evaluation's numbers for the Prometheus endpoint (dtrain_eval_*).
void publish_eval(MetricRegistry& reg, const Session& s, int64_t step, const EvalStats& ev) {
  if (!ev.samples) return;
  const std::string kind = s.task->kind();
  if (kind == "lm")
    reg.set_eval(step, ev.loss, "perplexity", ev.perplexity);
  else if (kind == "segment")
    reg.set_eval(step, ev.loss, "miou", ev.mean_iou);
  else
    reg.set_eval(step, ev.loss, "accuracy", ev.accuracy);
  reg.publish();
}

// Tracks the best evaluation of the run (rank 0), continued from best.json on resume.
struct BestTracker {
  bool on = false;
  bool have = false;
  double value = 0;
  int64_t step = -1;  // of the best evaluation
  // Resumed from best.json: its value, and the step from which train.early_stop_patience
  // counts the evaluations that did not improve on it.
  void restore(const CheckpointManager& cm) {
    const std::string text = cm.best_json();
    if (text.empty()) return;
    const auto j = nlohmann::json::parse(text);
    if (j.contains("value") && j["value"].is_number()) have = true, value = j["value"].get<double>();
    if (j.contains("step") && j["step"].is_number_integer()) step = j["step"].get<int64_t>();
  }
  // evaluations at multiples of `every` after the best one, up to `now`
  int64_t evals_since(int64_t now, int64_t every) const {
    return have && step >= 0 && every > 0 ? now / every - step / every : 0;
  }
  bool improves(const BestMetric& m) const {
    return on && std::isfinite(m.value) && (!have || (m.higher ? m.value > value : m.value < value));
  }
  // A better evaluation at step `at` (its checkpoint is committed). Every rank keeps the
  // step; rank 0 (`lead`) also writes best.json, logs it and publishes the value.
  void mark(int64_t at, const BestMetric& m, bool lead, const CheckpointManager& cm, RunDir* run_p,
            MetricRegistry& reg) {
    have = true;
    value = m.value;
    step = at;
    if (!lead) return;
    const std::string dir = cm.checkpoints_dir() + "/" + CheckpointManager::dir_name(at);
    cm.mark_best(dir, {{"step", at}, {"metric", m.name}, {"mode", m.higher ? "max" : "min"}, {"value", m.value}});
    log::info("best {} {:.6g} at step {}: {}", m.name, m.value, at, dir);
    if (run_p) run_p->event("best", {{"step", at}, {"checkpoint", dir}, {"metric", m.name}, {"value", m.value}});
    reg.set_eval_best(m.value);
    reg.publish();
  }
};

void checkpoint_failed(RunDir* run_p, MetricRegistry& reg, int64_t step, const Error& e) {
  if (!run_p) return;
  reg.add_checkpoint_failure();
  reg.publish();
  run_p->event("checkpoint_failed", {{"step", step}, {"error", e.what()}});
}

void checkpoint_done(RunDir* run_p, MetricRegistry& reg, const std::string& path, uint64_t bytes, double secs,
                     const std::string& why, double blocked_s = -1) {
  if (!run_p) return;
  reg.add_checkpoint(secs);
  nlohmann::json ev = {{"step", CheckpointManager::step_of(path)}, {"path", path}, {"bytes", bytes},
                       {"seconds", secs}, {"reason", why}};
  if (blocked_s >= 0) {
    ev["async"] = true;
    ev["blocked_seconds"] = blocked_s;
    log::info("checkpoint {} ({:.1f} MB, {:.2f}s, {:.2f}s of it blocking training, {}, async)", path,
              double(bytes) / 1e6, secs, blocked_s, why);
  } else {
    log::info("checkpoint {} ({:.1f} MB, {:.2f}s, {})", path, double(bytes) / 1e6, secs, why);
  }
  run_p->event("checkpoint", ev);
}

// Reports the background commit once it has finished (wait: blocks until it has).
void finish_async(AsyncCommit& ac, RunDir* run_p, MetricRegistry& reg, bool wait) {
  if (!ac.pending()) return;
  const int64_t step = ac.step();
  try {
    if (auto done = ac.poll(wait)) checkpoint_done(run_p, reg, done->path, done->bytes, done->seconds, "periodic",
                                                   done->blocked_s);
  } catch (const Error& e) {
    checkpoint_failed(run_p, reg, step, e);
    throw;
  }
}

// Every rank calls it (collective with data parallelism). Rank 0 (run != null) writes the
// model, state.json and, unless ZeRO shards the optimizer, the one optimizer file; with ZeRO
// every rank writes its own optimizer shard (dist_checkpoint.h). With checkpoint.async, a
// periodic save writes its files here (every rank its own) and rank 0 commits them on `ac`'s
// thread; every other save first waits for a pending commit and is synchronous.
void save(Session& s, DistRuntime* d, CheckpointManager& cm, const TrainState& st, RunDir* run_p,
          const std::string& why, MetricRegistry& reg, AsyncCommit& ac) {
  finish_async(ac, run_p, reg, true);
  auto t0 = std::chrono::steady_clock::now();
  const int keep_last = int(s.cfg.i("checkpoint.keep_last"));
  uint64_t bytes = 0;
  std::string path;
  const bool async = why == "periodic" && s.cfg.b("checkpoint.async");
  if (!d && async) {
    try {
      const std::string tmp = cm.begin(st.step);
      bytes = write_checkpoint_files(s, st, tmp);
      const double blocked = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ac.start(cm, st.step, tmp, keep_last, bytes, t0, blocked);
    } catch (const Error& e) {
      checkpoint_failed(run_p, reg, st.step, e);
      throw;
    }
    return;
  }
  try {
    if (d) {
      const bool sharded = s.opt && d->zero_stage > 0;
      const int shards = sharded ? s.world : 1;
      const int rank = d->env.rank;
      std::function<uint64_t(const std::string&)> mine;
      if (sharded)
        mine = [&](const std::string& dir) { return write_optim_shard(*s.opt, s.params, st.step, dir, rank, shards); };
      std::function<void(const std::string&, uint64_t)> later;
      if (async)  // every rank's files are written; rank 0 commits them on its background thread
        later = [&](const std::string& tmp, uint64_t b) {
          ac.start(cm, st.step, tmp, keep_last, b, t0,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        };
      DistSaveResult res = save_checkpoint_collective(
          *d, cm, st.step, keep_last, sharded ? optim_shard_name(rank, shards) : "", mine,
          [&](const std::string& dir) { return write_checkpoint_files(s, st, dir, s.world, shards); }, later);
      if (async) return;  // reported by finish_async once committed (rank 0)
      path = res.path;
      bytes = res.bytes;
    } else {
      path = cm.save(
          st.step, [&](const std::string& dir) { bytes = write_checkpoint_files(s, st, dir); }, keep_last);
    }
  } catch (const Error& e) {
    checkpoint_failed(run_p, reg, st.step, e);
    throw;
  }
  checkpoint_done(run_p, reg, path, bytes, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                  why);
}

// `dtrain train ... --nproc-per-node N` outside a launcher: start the workers.
// `ambient`: the Slurm or Open MPI variables this launcher runs under (source "none" when
// there are none). With several nodes, each must run one launcher (srun --ntasks-per-node 1):
// the node rank and master address then default to theirs, and under Slurm the port to the
// job's (dist/env.h).
int launch_training(const TrainArgs& a, const dist::DistEnv& ambient) {
  Resolved r = resolve(a);  // bad recipes fail here, once, before any worker starts
  if (!r.resume && stdfs::exists(r.run_dir))
    user_error("run directory {} already exists: resume it with `dtrain train --resume {}`, or pick another run.name "
               "(e.g. --set run.name=NEW)", r.run_dir, r.run_dir);
  dist::LaunchOptions o;
  o.nproc_per_node = a.nproc_per_node;
  o.nnodes = a.nnodes;
  o.node_rank = a.node_rank;
  o.master_addr = a.master_addr;
  o.master_port = a.master_port;
  const TrainArgs defaults;  // flags left at these take the ambient launcher's values
  if (ambient.source != "none" && a.nnodes > 1) {
    if (ambient.world_size != a.nnodes)
      user_error("--nnodes {}: this launcher is task {} of {} ({}); start one dtrain launcher per node (e.g. srun "
                 "--ntasks-per-node 1), or drop --nproc-per-node/--nnodes and let {} start every rank",
                 a.nnodes, ambient.rank, ambient.world_size, ambient.source, ambient.source == "slurm" ? "srun" : "mpirun");
    if (a.node_rank == defaults.node_rank) o.node_rank = ambient.rank;
    if (a.master_addr == defaults.master_addr) o.master_addr = ambient.master_addr;
  }
  // under Slurm the job's own port (15000 + job id % 10000), so two jobs sharing a node do not collide
  if (ambient.source == "slurm" && a.master_port == defaults.master_port) o.master_port = ambient.master_port;
  o.max_restarts = a.max_restarts;
  if (!r.cfg->s("parallel.job_id").empty()) o.job_token = r.cfg->s("parallel.job_id");
  std::vector<std::string> argv = worker_argv_from(dist::current_argv(), dist::self_exe());
  log::info("launching {} worker(s) on node {} of {} (world size {})", a.nproc_per_node, a.node_rank, a.nnodes,
            a.nproc_per_node * a.nnodes);
  return dist::launch(o, argv);
}

}  // namespace

int cmd_train(const TrainArgs& a) {
  const dist::DistEnv env = dist::dist_env();
  // Launcher flags start dtrain's own workers unless this process already is a worker
  // (dtrain's launcher, torchrun, RANK/WORLD_SIZE by hand). Slurm's and Open MPI's variables
  // describe the allocation: `srun --ntasks-per-node 1 dtrain train cfg --nproc-per-node 8`
  // launches, as torchrun under srun does.
  const bool ambient = env.source == "none" || env.source == "slurm" || env.source == "mpi";
  if ((a.nproc_per_node > 1 || a.nnodes > 1) && ambient) return launch_training(a, env);
  if ((a.nproc_per_node > 1 || a.nnodes > 1))
    log::warn("already a worker of a {} launch (RANK {} of {}): ignoring --nproc-per-node/--nnodes", env.source,
              env.rank, env.world_size);
  log::set_rank(env.rank);
  const bool lead = env.rank == 0;  // the only rank that writes the run directory

  Resolved r = resolve(a);
  const Config& cfg = *r.cfg;
  const std::string level = cfg.s("log.level");  // the schema allows debug, info, warn
  log::set_level(level == "debug" ? log::Level::Debug : level == "warn" ? log::Level::Warn : log::Level::Info);
  if (env.restart_count > 0) r.resume = true;  // a restarted group resumes from its latest checkpoint
  bool exists = stdfs::exists(r.run_dir);
  if (r.resume && !exists && a.resume_dir.empty()) r.resume = false;  // --resume on a fresh recipe: start it
  if (lead && r.resume && !exists) user_error("cannot resume: run directory {} does not exist", r.run_dir);

  // Build everything that can fail on bad input before touching the run directory.
  SessionOptions so;
  if (env.distributed) {
    so.rank = env.rank;
    so.world_size = env.world_size;
    so.with_eval_data = lead;  // only rank 0 evaluates and reports
    so.shard_optimizer = cfg.i("parallel.zero") > 0;
    so.device_index = env.local_rank;
  }
  auto s = make_session(cfg, so);
  std::unique_ptr<DistRuntime> d;
  if (env.distributed) {
    d = connect(env, cfg, s->be->device());
    check_same_config(*d, cfg.hash());
  }

  // Metrics: the trainer publishes one snapshot per log step; the HTTP handler only reads
  // it. A port that cannot be used fails here, before the run directory is touched.
  MetricRegistry reg(cfg.s("run.name"), env.rank);
  std::unique_ptr<HttpServer> http;
  if (lead && cfg.i("observability.prometheus_port") > 0)
    http = std::make_unique<HttpServer>(cfg.s("observability.bind"), int(cfg.i("observability.prometheus_port")),
                                        metrics_handler(reg));
  Nvml nvml;

  // MFU: model FLOPs per loss unit (flops.h) over the peak of the devices in the run. No
  // peak (a CPU, or a GPU missing from the table) and no observability.peak_tflops: no MFU.
  const double flops_per_unit = train_flops_per_unit(*s);
  double peak = 0;
  {
    const double override_tf = cfg.f("observability.peak_tflops");
    std::string dev_name;
    if (s->be->device().is_cuda() && nvml.available()) {
      auto gpus = nvml.sample();
      for (auto& g : gpus)
        if (g.index == env.local_rank) dev_name = g.name;
      if (dev_name.empty() && !gpus.empty()) dev_name = gpus.front().name;
    }
    if (s->be->device().is_cuda() || override_tf > 0)
      peak = resolve_peak_flops(dev_name, peak_precision(cfg.s("precision.dtype"), cfg.b("precision.tf32")),
                                override_tf);
    peak *= double(env.distributed ? env.world_size : 1);  // the rate below is summed over ranks
  }

  // User errors that need the session come before the run directory exists, so a bad key
  // leaves nothing behind that a corrected rerun would trip over.
  const bool keep_best = cfg.b("checkpoint.keep_best");
  const int64_t patience = cfg.i("train.early_stop_patience");
  if (patience > 0 && (!keep_best || cfg.i("eval.every_steps") == 0))
    user_error("{}: train.early_stop_patience = {} needs checkpoint.keep_best = true and eval.every_steps > 0 (it "
               "ranks the evaluations as keep_best does)",
               cfg.source(), patience);
  if (keep_best && lead && !s->task->has_eval())
    user_error("{}: checkpoint.keep_best needs an evaluation split (data.kind = \"{}\" has none)", cfg.source(),
               cfg.s("data.kind"));
  // model.init_from: a fresh run reads the weights now; a resumed one only when it finds no
  // checkpoint (below). Every rank reads the same file, so the replicas start equal.
  std::optional<InitReport> init;
  const std::string init_from = cfg.s("model.init_from");
  if (!init_from.empty() && !r.resume) init = init_model_from(*s, init_from, cfg.b("model.init_strict"));

  std::unique_ptr<RunDir> run_p;
  if (lead) {
    run_p = std::make_unique<RunDir>(r.run_dir, !r.resume, cfg.b("log.tensorboard"));
    if (!r.resume || !stdfs::exists(run_p->file("config.toml")))
      fs::write_file_atomic(run_p->file("config.toml"), cfg.to_toml());
  }
  CheckpointManager cm(r.run_dir);
  AsyncCommit ac;  // after cm: its thread uses cm, and its destructor waits for it

  TrainState st;
  std::string ck;
  std::vector<std::string> notes;
  if (r.resume && lead) ck = cm.latest_valid(&notes);
  if (d) ck = share_from_rank0(*d, "resume_from", r.resume ? ck : "");
  if (r.resume) {
    for (auto& n : notes) {
      log::warn("{}", n);
      reg.add_checkpoint_failure();
      run_p->event("checkpoint_invalid", {{"note", n}});
    }
    if (ck.empty()) {
      if (lead) {
        log::warn("{}: no valid checkpoint to resume from; starting from step 0", r.run_dir);
        run_p->event("resume", {{"from", nullptr}, {"reason", "no valid checkpoint"}});
      }
    } else {
      st = load_checkpoint(*s, ck);
      log::info("resumed from {} at step {}", ck, st.step);
      reg.add_resume();
      reg.set_step(st.step);
      if (lead) run_p->event("resume", {{"from", ck}, {"step", st.step}, {"fallbacks", notes.size()},
                                        {"restart_count", env.restart_count}});
    }
  }
  if (ck.empty() && !init_from.empty()) {
    if (!init) init = init_model_from(*s, init_from, cfg.b("model.init_strict"));
    const InitReport& ir = *init;
    if (lead) {
      log::info("initialised from {}: {} tensors{}{}", ir.file, ir.loaded,
                ir.kept.empty() ? "" : fmt::format("; kept this model's own {}", fmt::join(ir.kept, ", ")),
                ir.ignored.empty() ? "" : fmt::format("; ignored {}", fmt::join(ir.ignored, ", ")));
      run_p->event("init_from", {{"file", ir.file}, {"loaded", ir.loaded}, {"kept", ir.kept}, {"ignored", ir.ignored}});
    }
  }
  if (d) attach(*d, *s, cfg.f("parallel.bucket_mb"));
  DistStep* ds = d ? &d->step : nullptr;
  std::vector<std::string> hosts;
  if (d) hosts = gather_hostnames(*d);

  if (lead) {
    log::info("run {} | model {}{} | {} parameters | device {} | {} steps ({} per epoch)", r.run_dir,
              cfg.s("model.kind"), cfg.s("model.kind") == "gpt" ? "" : fmt::format(" depth {}", cfg.i("model.depth")),
              s->params.num_params(), s->be->name(), s->total_steps, s->steps_per_epoch);
    if (s->params.mixed())
      log::info("precision {}: forward/backward in 16 bits on a cast copy of the f32 master weights{}{}",
                cfg.s("precision.dtype"),
                s->scaler.enabled() ? fmt::format(", dynamic loss scale from {}", s->scaler.scale()) : "",
                s->be->device().is_cuda() ? "" : " (emulated on the CPU: for testing, slower than fp32)");
    if (d) {
      // what each rank holds (ZeRO shards only the optimizer state; gradients stay full-size)
      const double mib = 1.0 / (1 << 20);
      const int64_t np = s->params.num_params();
      const int64_t state = s->opt ? s->opt->state_bytes() : 0;
      log::info("memory per rank: parameters {:.1f} MiB{} | gradients {:.1f} MiB | optimizer state {:.1f} MiB{}",
                double(np) * 4 * mib,
                s->params.mixed() ? fmt::format(" + {:.1f} MiB {} copy", double(np) * 2 * mib, cfg.s("precision.dtype"))
                                  : "",
                double(np) * 4 * mib, double(state) * mib,
                d->zero_stage > 0 ? fmt::format(" (ZeRO-{}: 1/{} of the full state)", d->zero_stage, env.world_size)
                                  : "");
    }
    if (d)
      log::info("data parallel: {} ranks ({}) | {} per rank, {} global batch | zero {} | {} gradient buckets",
                env.world_size, d->comm->backend_name(), cfg.i("train.batch_size"),
                cfg.i("train.batch_size") * cfg.i("train.grad_accum") * env.world_size, d->zero_stage,
                d->buckets ? d->buckets->buckets().size() : 0);
    run_p->event("run_start", {{"config_hash", cfg.hash()}, {"world_size", env.world_size},
                               {"version", DTRAIN_VERSION}, {"device", s->be->name()}, {"start_step", st.step},
                               {"total_steps", s->total_steps}, {"num_params", s->params.num_params()}});
  }

  SignalGuard guard;
  g_signal.store(0);
  const int64_t log_every = cfg.i("log.every_steps");
  const int64_t ckpt_every = cfg.i("checkpoint.every_steps");
  const int64_t eval_every = cfg.i("eval.every_steps");
  BestTracker best;
  best.on = keep_best;
  if (best.on) best.restore(cm);  // every rank: each must know when early stopping ends the run
  if (best.on && best.have) reg.set_eval_best(best.value);
  // a run that had already stopped early and is resumed does not train on
  bool stopped_early = patience > 0 && best.evals_since(st.step, eval_every) >= patience;
  const double wall0 = st.wall_time_s;
  const char* stop_env = std::getenv("DTRAIN_TEST_STOP_AT_STEP");
  const int64_t stop_at = stop_env ? std::atoll(stop_env) : 0;
  auto t_start = std::chrono::steady_clock::now();
  auto t_window = t_start;
  int64_t window_samples = 0;
  int64_t last_ckpt = st.step;
  // test hook: rank DTRAIN_TEST_SLOW_RANK sleeps DTRAIN_TEST_SLOW_MS in every step (stragglers)
  const char* slow_rank_env = std::getenv("DTRAIN_TEST_SLOW_RANK");
  const char* slow_ms_env = std::getenv("DTRAIN_TEST_SLOW_MS");
  const int64_t slow_ms = slow_rank_env && slow_ms_env && std::atoi(slow_rank_env) == env.rank ? std::atoll(slow_ms_env) : 0;
  // this rank's busy time per step (the step minus waiting in gradient sync) since the last log
  std::vector<double> busy_window;
  int64_t rank_samples = 0;

  while (st.step < s->total_steps && !stopped_early) {
    double lr = s->schedule->lr(st.step);
    int sig = g_signal.load();
    if (stop_at > 0 && st.step + 1 == stop_at) sig = SIGTERM;  // test hook: deterministic preemption
    if (ds) ds->stop = sig != 0;
    auto t_step = std::chrono::steady_clock::now();
    if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
    StepStats ss = train_step(*s, st.step, lr, ds);
    busy_window.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_step).count() - ss.sync_s);
    // train_step reports samples summed over ranks; every rank runs an equal share
    rank_samples += ss.local_samples;
    if (ds && ds->stop && !sig) sig = SIGTERM;  // another rank was signalled: stop at the same step
    if (!ds && !sig) sig = g_signal.load();  // single process: a signal during the step stops after it
    st.step++;
    s->task->data_state(st.loader, st.position);
    if (ss.skipped && lead)
      log::warn("step {}: fp16 gradients overflowed (inf/nan): update skipped, loss scale {} -> {} ({} skipped so far)",
                st.step, ss.loss_scale, s->scaler.scale(), s->scaler.state().skipped_steps);
    if (s->scaler.enabled()) reg.set_loss_scale(s->scaler.scale(), s->scaler.state().skipped_steps);
    window_samples += ss.samples;
    reg.record_step({ss.t.total_s, ss.t.data_s, ss.t.forward_s, ss.t.backward_s, ss.sync_s, ss.t.optimizer_s, ss.samples, 0});
    if (!std::isfinite(ss.loss)) {
      if (lead) run_p->event("run_end", {{"status", "diverged"}, {"step", st.step}});
      fault("loss is {} at step {}: training diverged (lower optim.lr or enable train.clip_grad_norm)", ss.loss,
            st.step);
    }
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    st.wall_time_s = wall0 + elapsed;
    if (lead && log::stdout_is_terminal()) {
      const int width = 30;
      int filled = int(double(width) * double(st.step) / double(s->total_steps));
      log::progress(fmt::format("[{}{}] {}/{} | loss {:.4f} | {}", std::string(size_t(filled), '#'),
                                std::string(size_t(width - filled), '.'), st.step, s->total_steps, ss.loss,
                                hms(st.wall_time_s)));
    }
    const bool log_step = st.step % log_every == 0 || st.step == s->total_steps;
    nlohmann::json extra = nlohmann::json::object();
    if (d && log_step) {  // collective: every rank, same step
      const double p50 = quantile(busy_window, 0.5);
      busy_window.clear();
      auto ranks = gather_rank_stats(*d, *s->be, {p50, double(rank_samples)});
      std::vector<double> p50s;
      nlohmann::json rj = nlohmann::json::array();
      for (size_t r = 0; r < ranks.size(); ++r) {
        p50s.push_back(ranks[r].p50_s);
        rj.push_back({{"rank", r}, {"host", hosts.at(r)}, {"step_p50_s", ranks[r].p50_s},
                      {"samples", int64_t(ranks[r].samples)}});
      }
      extra["ranks"] = rj;
      auto slow = find_stragglers(p50s, 0.2);
      if (lead && !slow.empty()) {
        nlohmann::json sj = nlohmann::json::array();
        for (auto& sg : slow) {
          log::warn("straggler: rank {} on host {}: step p50 {:.1f} ms is {:.0f}% above the median rank's {:.1f} ms",
                    sg.rank, hosts.at(size_t(sg.rank)), 1e3 * sg.p50_s, 100 * sg.excess, 1e3 * sg.median_s);
          sj.push_back(sg.rank);
        }
        reg.add_stragglers(int64_t(slow.size()));
        extra["stragglers"] = sj;
        run_p->event("straggler", {{"step", st.step}, {"ranks", sj}});
      }
    } else if (log_step) {
      busy_window.clear();
    }
    if (lead && log_step) {
      auto now = std::chrono::steady_clock::now();
      double win = std::chrono::duration<double>(now - t_window).count();
      double ips = win > 0 ? double(window_samples) / win : 0;
      double eta = ips > 0 ? double(s->total_steps - st.step) * double(ss.samples) / ips : 0;
      const double mfu = mfu_ratio(flops_per_unit > 0 ? flops_per_unit * ips : kUnknown, peak);
      log_line(*s, st.step, ss, lr, ips, st.wall_time_s, eta, mfu, extra, *run_p);
      reg.set_mfu(mfu);
      reg.set_loss(ss.loss);
      reg.set_lr(lr);
      reg.set_arena_high_water(double(s->arena->high_water()));
      if (nvml.available()) reg.set_gpus(nvml.sample());
      reg.publish();
      t_window = now;
      window_samples = 0;
    }
    finish_async(ac, run_p.get(), reg, false);  // report a background commit that has finished
    bool last = st.step == s->total_steps;
    if (eval_every > 0 && st.step % eval_every == 0 && !last) {
      bool improved = false;
      BestMetric m;
      if (lead) {
        EvalStats ev = run_eval(*s, st.step, *run_p);
        m = best_metric(*s, ev);
        improved = ev.samples && best.improves(m);
        publish_eval(reg, *s, st.step, ev);
      }
      // only rank 0 evaluates; saving is collective, so every rank learns its verdict
      if (d && best.on) improved = share_from_rank0(*d, fmt::format("best/{}", st.step), improved ? "1" : "0") == "1";
      if (improved) {
        save(*s, d.get(), cm, st, run_p.get(), "best", reg, ac);
        last_ckpt = st.step;
        best.mark(st.step, m, lead, cm, run_p.get(), reg);
      } else if (patience > 0 && best.evals_since(st.step, eval_every) >= patience) {
        stopped_early = true;
        if (lead) {
          log::info("early stop at step {}: {} evaluations without improving on step {}", st.step, patience, best.step);
          run_p->event("early_stop", {{"step", st.step}, {"best_step", best.step}, {"patience", patience}});
        }
      }
    }
    if (sig) {
      if (lead) {
        log::warn("received {}: writing a checkpoint at step {} and stopping",
                  sig == SIGINT ? "SIGINT" : "SIGTERM", st.step);
        run_p->event("signal", {{"signal", sig == SIGINT ? "SIGINT" : "SIGTERM"}, {"step", st.step}});
      }
      reg.add_preemption();
      if (last_ckpt != st.step) save(*s, d.get(), cm, st, run_p.get(), "preempted", reg, ac);  // else: saved as the best
      finish_async(ac, run_p.get(), reg, true);
      if (lead)
        run_p->event("run_end", {{"status", "preempted"}, {"step", st.step}, {"wall_time_s", st.wall_time_s}});
      return 0;
    }
    if (ckpt_every > 0 && st.step % ckpt_every == 0 && !last && last_ckpt != st.step) {
      save(*s, d.get(), cm, st, run_p.get(), "periodic", reg, ac);
      last_ckpt = st.step;
    }
  }
  finish_async(ac, run_p.get(), reg, true);  // `latest` is read next
  // every rank agrees whether a final checkpoint is needed (rank 0 sees the files)
  bool need_final = last_ckpt != st.step;
  if (d) need_final = share_from_rank0(*d, "final_save", need_final || !stdfs::exists(r.run_dir + "/checkpoints/latest") ? "1" : "0") == "1";
  else need_final = need_final || !stdfs::exists(r.run_dir + "/checkpoints/latest");
  if (need_final) save(*s, d.get(), cm, st, run_p.get(), "final", reg, ac);
  if (!lead) return 0;
  RunDir& run = *run_p;
  EvalStats ev = run_eval(*s, st.step, run);
  publish_eval(reg, *s, st.step, ev);
  // the final checkpoint (saved above, or the periodic one of this step) may be the best
  if (const BestMetric m = best_metric(*s, ev); ev.samples && best.improves(m)) best.mark(st.step, m, true, cm, &run, reg);
  nlohmann::json end = {{"status", "completed"}, {"step", st.step}, {"wall_time_s", st.wall_time_s}};
  if (stopped_early) end["early_stopped"] = true;
  if (ev.samples) {
    end["eval_loss"] = ev.loss;
    std::string what;
    if (s->task->kind() == "lm") {
      end["eval_perplexity"] = ev.perplexity;
      what = fmt::format("val loss {:.4f} | val perplexity {:.3f}", ev.loss, ev.perplexity);
    } else if (s->task->kind() == "segment") {
      end["eval_miou"] = ev.mean_iou;
      end["eval_dice"] = ev.mean_dice;
      what = fmt::format("val mIoU {:.4f} | val mDice {:.4f} | val loss {:.4f}", ev.mean_iou, ev.mean_dice, ev.loss);
    } else {
      end["eval_accuracy"] = ev.accuracy;
      what = fmt::format("test accuracy {:.2f}% | test loss {:.4f}", 100 * ev.accuracy, ev.loss);
    }
    log::console(fmt::format("done: {} steps in {} | {} | run dir {}", st.step, hms(st.wall_time_s), what, r.run_dir));
  } else {
    log::console(fmt::format("done: {} steps in {} | run dir {}", st.step, hms(st.wall_time_s), r.run_dir));
  }
  if (s->graphs) {  // train.cuda_graph: how often the micro-batches ran as a replayed graph
    end["cuda_graph_captures"] = s->graphs->captures();
    end["cuda_graph_replays"] = s->graphs->replays();
  }
  run.event("run_end", end);
  return 0;
}

}  // namespace dtrain

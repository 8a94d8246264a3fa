// dtrain train: the training loop, run directory, checkpoints, resume and preemption.
#include <atomic>
#include <cstdlib>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <unistd.h>

#include "cli/commands.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "obs/http_server.h"
#include "obs/metrics.h"
#include "obs/nvml.h"
#include "train/checkpoint.h"
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

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
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

void log_line(const Session& s, int64_t step, const StepStats& st, double lr, double imgs_per_s, double elapsed,
              double eta, RunDir& run) {
  double epoch = double(step) / double(s.steps_per_epoch);
  log::console(fmt::format("step {:>6}/{} | epoch {:6.2f} | loss {:.4f} | lr {:.5f} | {:7.1f} img/s | elapsed {} | eta {}",
                           step, s.total_steps, epoch, st.loss, lr, imgs_per_s, hms(elapsed), hms(eta)));
  nlohmann::json row = {{"kind", "train"}, {"step", step}, {"epoch", epoch}, {"loss", st.loss}, {"lr", lr},
                        {"images_per_s", imgs_per_s}, {"elapsed_s", elapsed},
                        {"step_s", st.t.total_s}, {"data_s", st.t.data_s}, {"forward_s", st.t.forward_s},
                        {"backward_s", st.t.backward_s}, {"optimizer_s", st.t.optimizer_s}};
  if (st.grad_norm >= 0) row["grad_norm"] = st.grad_norm;
  run.metrics(row);
  run.scalar("train/loss", st.loss, step);
  run.scalar("train/lr", lr, step);
  run.scalar("train/images_per_s", imgs_per_s, step);
  run.flush();
}

EvalStats run_eval(Session& s, int64_t step, RunDir& run) {
  auto t0 = std::chrono::steady_clock::now();
  EvalStats ev = evaluate(s);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!ev.samples) return ev;
  log::console(fmt::format("eval  step {:>6} | test loss {:.4f} | test accuracy {:.2f}% | {} samples | {:.1f}s", step,
                           ev.loss, 100 * ev.accuracy, ev.samples, secs));
  run.metrics({{"kind", "eval"}, {"step", step}, {"eval_loss", ev.loss}, {"eval_accuracy", ev.accuracy},
               {"eval_samples", ev.samples}});
  run.scalar("eval/loss", ev.loss, step);
  run.scalar("eval/accuracy", ev.accuracy, step);
  run.flush();
  return ev;
}

void save(Session& s, CheckpointManager& cm, const TrainState& st, RunDir& run, const std::string& why,
          MetricRegistry& reg) {
  auto t0 = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  std::string path;
  try {
    path = cm.save(
        st.step, [&](const std::string& dir) { bytes = write_checkpoint_files(s, st, dir); },
        int(s.cfg.i("checkpoint.keep_last")));
  } catch (const Error& e) {
    reg.add_checkpoint_failure();
    reg.publish();
    run.event("checkpoint_failed", {{"step", st.step}, {"error", e.what()}});
    throw;
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  reg.add_checkpoint(secs);
  log::info("checkpoint {} ({:.1f} MB, {:.2f}s, {})", path, double(bytes) / 1e6, secs, why);
  run.event("checkpoint", {{"step", st.step}, {"path", path}, {"bytes", bytes}, {"seconds", secs}, {"reason", why}});
}

}  // namespace

int cmd_train(const TrainArgs& a) {
  Resolved r = resolve(a);
  const Config& cfg = *r.cfg;
  bool exists = stdfs::exists(r.run_dir);
  if (r.resume && !exists && a.resume_dir.empty()) r.resume = false;  // --resume on a fresh recipe: start it
  if (r.resume && !exists) user_error("cannot resume: run directory {} does not exist", r.run_dir);

  // Build everything that can fail on bad input before touching the run directory.
  auto s = make_session(cfg, SessionOptions{});

  // Metrics: the trainer publishes one snapshot per log step; the HTTP handler only reads
  // it. A port that cannot be used fails here, before the run directory is touched.
  MetricRegistry reg(cfg.s("run.name"), 0);
  std::unique_ptr<HttpServer> http;
  if (cfg.i("observability.prometheus_port") > 0)
    http = std::make_unique<HttpServer>(cfg.s("observability.bind"), int(cfg.i("observability.prometheus_port")),
                                        metrics_handler(reg));
  Nvml nvml;

  RunDir run(r.run_dir, !r.resume, cfg.b("log.tensorboard"));
  if (!r.resume || !stdfs::exists(run.file("config.toml"))) fs::write_file_atomic(run.file("config.toml"), cfg.to_toml());
  CheckpointManager cm(r.run_dir);

  TrainState st;
  if (r.resume) {
    std::vector<std::string> notes;
    std::string ck = cm.latest_valid(&notes);
    for (auto& n : notes) {
      log::warn("{}", n);
      reg.add_checkpoint_failure();
      run.event("checkpoint_invalid", {{"note", n}});
    }
    if (ck.empty()) {
      log::warn("{}: no valid checkpoint to resume from; starting from step 0", r.run_dir);
      run.event("resume", {{"from", nullptr}, {"reason", "no valid checkpoint"}});
    } else {
      st = load_checkpoint(*s, ck);
      log::info("resumed from {} at step {}", ck, st.step);
      reg.add_resume();
      reg.set_step(st.step);
      run.event("resume", {{"from", ck}, {"step", st.step}, {"fallbacks", notes.size()}});
    }
  }

  log::info("run {} | model {} depth {} | {} parameters | device {} | {} steps ({} per epoch)", r.run_dir,
            cfg.s("model.kind"), cfg.i("model.depth"), s->params.num_params(), s->be->name(), s->total_steps,
            s->steps_per_epoch);
  run.event("run_start", {{"config_hash", cfg.hash()}, {"world_size", 1}, {"version", DTRAIN_VERSION},
                          {"device", s->be->name()}, {"start_step", st.step}, {"total_steps", s->total_steps},
                          {"num_params", s->params.num_params()}});

  SignalGuard guard;
  g_signal.store(0);
  const int64_t log_every = cfg.i("log.every_steps");
  const int64_t ckpt_every = cfg.i("checkpoint.every_steps");
  const int64_t eval_every = cfg.i("eval.every_steps");
  const double wall0 = st.wall_time_s;
  const char* stop_env = std::getenv("DTRAIN_TEST_STOP_AT_STEP");
  const int64_t stop_at = stop_env ? std::atoll(stop_env) : 0;
  auto t_start = std::chrono::steady_clock::now();
  auto t_window = t_start;
  int64_t window_samples = 0;
  int64_t last_ckpt = st.step;

  while (st.step < s->total_steps) {
    double lr = s->schedule->lr(st.step);
    StepStats ss = train_step(*s, st.step, lr);
    st.step++;
    if (s->train_data) st.loader = s->train_data->state();
    window_samples += ss.samples;
    reg.record_step({ss.t.total_s, ss.t.data_s, ss.t.forward_s, ss.t.backward_s, 0.0, ss.t.optimizer_s, ss.samples, 0});
    if (!std::isfinite(ss.loss)) {
      run.event("run_end", {{"status", "diverged"}, {"step", st.step}});
      fault("loss is {} at step {}: training diverged (lower optim.lr or enable train.clip_grad_norm)", ss.loss,
            st.step);
    }
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    st.wall_time_s = wall0 + elapsed;
    if (st.step % log_every == 0 || st.step == s->total_steps) {
      auto now = std::chrono::steady_clock::now();
      double win = std::chrono::duration<double>(now - t_window).count();
      double ips = win > 0 ? double(window_samples) / win : 0;
      double eta = ips > 0 ? double(s->total_steps - st.step) * double(ss.samples) / ips : 0;
      log_line(*s, st.step, ss, lr, ips, st.wall_time_s, eta, run);
      reg.set_loss(ss.loss);
      reg.set_lr(lr);
      reg.set_arena_high_water(double(s->arena->high_water()));
      if (nvml.available()) reg.set_gpus(nvml.sample());
      reg.publish();
      t_window = now;
      window_samples = 0;
    }
    bool last = st.step == s->total_steps;
    if (eval_every > 0 && st.step % eval_every == 0 && !last) run_eval(*s, st.step, run);
    int sig = g_signal.load();
    if (stop_at > 0 && st.step == stop_at) sig = SIGTERM;  // test hook: deterministic preemption
    if (sig) {
      log::warn("received {}: writing a checkpoint at step {} and stopping", sig == SIGINT ? "SIGINT" : "SIGTERM",
                st.step);
      run.event("signal", {{"signal", sig == SIGINT ? "SIGINT" : "SIGTERM"}, {"step", st.step}});
      reg.add_preemption();
      save(*s, cm, st, run, "preempted", reg);
      run.event("run_end", {{"status", "preempted"}, {"step", st.step}, {"wall_time_s", st.wall_time_s}});
      return 0;
    }
    if (ckpt_every > 0 && st.step % ckpt_every == 0 && !last) {
      save(*s, cm, st, run, "periodic", reg);
      last_ckpt = st.step;
    }
  }
  EvalStats ev = run_eval(*s, st.step, run);
  if (last_ckpt != st.step || !stdfs::exists(r.run_dir + "/checkpoints/latest")) save(*s, cm, st, run, "final", reg);
  nlohmann::json end = {{"status", "completed"}, {"step", st.step}, {"wall_time_s", st.wall_time_s}};
  if (ev.samples) {
    end["eval_accuracy"] = ev.accuracy;
    end["eval_loss"] = ev.loss;
    log::console(fmt::format("done: {} steps in {} | test accuracy {:.2f}% | test loss {:.4f} | run dir {}", st.step,
                             hms(st.wall_time_s), 100 * ev.accuracy, ev.loss, r.run_dir));
  } else {
    log::console(fmt::format("done: {} steps in {} | run dir {}", st.step, hms(st.wall_time_s), r.run_dir));
  }
  run.event("run_end", end);
  return 0;
}

}  // namespace dtrain

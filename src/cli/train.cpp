// dtrain train: resolves the recipe and the run directory, then either starts dtrain's own
// workers (launcher flags outside a launched job) or trains as this process's rank (Trainer).
#include <filesystem>
#include <optional>

#include "cli/command.h"
#include "comm/env.h"
#include "comm/launcher.h"
#include "core/error.h"
#include "core/failpoint.h"
#include "core/log.h"
#include "config/config.h"
#include "session/layout.h"
#include "train/trainer.h"

namespace dtrain::cli {

namespace stdfs = std::filesystem;

namespace {

struct TrainArgs {
  std::string config;                   // recipe path ("" when resuming from a run dir)
  std::vector<std::string> overrides;   // --set section.key=value (repeatable)
  bool resume = false;                  // --resume given
  std::string resume_dir;               // --resume RUN_DIR ("" = the recipe's run dir)
  std::string device;                   // --device cpu|cuda|auto ("" = recipe's run.device)
  bool help_config = false;
  int metrics_port = -1;
  // launcher
  int nproc_per_node = 1, nnodes = 1, node_rank = 0, max_restarts = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
};

// The recipe (with overrides) and the run directory of the invocation: the recipe given, else
// the resumed run's own config.toml; the run directory given to --resume, else the recipe's.
TrainRequest resolve(const TrainArgs& a) {
  const bool resume_dir = a.resume && !a.resume_dir.empty();
  std::string path = a.config;
  if (path.empty()) {
    if (!resume_dir)
      user_error("dtrain train: give a recipe (dtrain train CONFIG) or a run to resume (dtrain train --resume RUN_DIR)");
    path = a.resume_dir + "/config.toml";
    std::error_code ec;
    if (!stdfs::is_regular_file(path, ec))
      user_error("cannot resume {}: {} not found (is it a dtrain run directory?)", a.resume_dir, path);
  }
  Config cfg = Config::load(path, a.overrides, a.device);
  std::string run_dir = resume_dir ? a.resume_dir : cfg.run.out_dir + "/" + cfg.run.name;
  while (run_dir.size() > 1 && run_dir.back() == '/') run_dir.pop_back();
  return TrainRequest{std::move(cfg), run_dir, a.resume, resume_dir};
}

// `dtrain train ... --nproc-per-node N` outside a launcher: start the workers.
// `ambient`: the Slurm or Open MPI variables this launcher runs under (source "none" when
// there are none). With several nodes, each must run one launcher (srun --ntasks-per-node 1):
// the node rank and master address then default to theirs, and under Slurm the port to the
// job's (comm/env.h).
// `r`: the invocation's recipe, resolved (a bad one fails there, once, before any worker starts).
int launch_training(const TrainArgs& a, const TrainRequest& r, const comm::DistEnv& ambient) {
  {
    Config layout_cfg = r.cfg;  // as does a layout the world cannot hold (every rule at once)
    resolve_layout(layout_cfg, a.nproc_per_node * a.nnodes);
  }
  if (!r.resume && stdfs::exists(r.run_dir))
    user_error("run directory {} already exists: resume it with `dtrain train --resume {}`, or pick another run.name "
               "(e.g. --set run.name=NEW)", r.run_dir, r.run_dir);
  comm::LaunchOptions o;
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
  // run.threads wins over OMP_NUM_THREADS in the workers (comm::cpu_threads); giving it to them
  // as OMP_NUM_THREADS too keeps the launcher from choosing (and announcing) a share of its own
  if (const int64_t t = r.cfg.run.threads; t > 0) o.extra_env["OMP_NUM_THREADS"] = std::to_string(t);
  if (!r.cfg.parallel.job_id.empty()) o.job_token = r.cfg.parallel.job_id;
  const std::vector<std::string> argv = comm::worker_argv(
      comm::current_argv(), comm::self_exe(),
      {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--max-restarts"});
  log::info("launching {} worker(s) on node {} of {} (world size {})", a.nproc_per_node, a.node_rank, a.nnodes,
            a.nproc_per_node * a.nnodes);
  return comm::launch(o, argv);
}

int cmd_train(const TrainArgs& a) {
  const comm::DistEnv env = comm::dist_env();
  // Launcher flags start dtrain's own workers unless this process already is a worker
  // (dtrain's launcher, torchrun, RANK/WORLD_SIZE by hand). Slurm's and Open MPI's variables
  // describe the allocation: `srun --ntasks-per-node 1 dtrain train cfg --nproc-per-node 8`
  // launches, as torchrun under srun does.
  const bool ambient = env.source == "none" || env.source == "slurm" || env.source == "mpi";
  const bool launch_flags = a.nproc_per_node > 1 || a.nnodes > 1;
  if (!(launch_flags && ambient)) {
    if (launch_flags)
      log::warn("already a worker of a {} launch (RANK {} of {}): ignoring --nproc-per-node/--nnodes", env.source,
                env.rank, env.world_size);
    log::set_rank(env.rank);
    if (const auto* fp = failpoint::get(failpoint::Point::WorkerExit);
        fp && (*fp)[0] == env.rank && env.restart_count < (*fp)[1])
      fault("failpoint train.worker_exit: rank {} exits at start (restart count {} < {})", env.rank, env.restart_count,
            (*fp)[1]);
  }
  TrainRequest r = resolve(a);
  if (launch_flags && ambient) return launch_training(a, r, env);
  const std::string level = r.cfg.log.level;  // the schema allows debug, info, warn
  log::set_level(level == "debug" ? log::Level::Debug : level == "warn" ? log::Level::Warn : log::Level::Info);
  if (env.restart_count > 0) r.resume = true;  // a restarted group resumes from its latest checkpoint
  if (r.resume && !r.resume_dir && !stdfs::exists(r.run_dir)) r.resume = false;  // --resume on a fresh recipe: start it
  Trainer trainer(std::move(r), env);
  return trainer.run();
}

}  // namespace

void add_train(CLI::App& app, Run& run) {
  auto a = std::make_shared<TrainArgs>();
  auto* c = app.add_subcommand("train", "train a model from a recipe (or resume a run)");
  c->add_option("config", a->config, "recipe (TOML)")->type_name("CONFIG");
  add_recipe_options(c, a->overrides, a->device);
  auto* resume = c->add_option("--resume", a->resume_dir,
                               "continue a run from its latest checkpoint (RUN_DIR, or the recipe's run directory)")
                     ->type_name("[RUN_DIR]")
                     ->expected(0, 1);
  c->add_flag("--help-config", a->help_config, "print every recipe key with its type, default and range");
  c->add_option("--metrics-port", a->metrics_port,
                "serve Prometheus metrics on this port (same as --set observability.prometheus_port=N)")
      ->check(CLI::Range(0, 65535));
  c->add_option("--nproc-per-node", a->nproc_per_node, "worker processes on this node (each gets OMP_NUM_THREADS = its share of the CPUs unless set)")->check(CLI::Range(1, 1024));
  c->add_option("--nnodes", a->nnodes, "number of nodes")->check(CLI::Range(1, 65536));
  c->add_option("--node-rank", a->node_rank, "rank of this node")->check(CLI::Range(0, 65535));
  c->add_option("--master-addr", a->master_addr, "address of the rendezvous host");
  c->add_option("--master-port", a->master_port, "port of the rendezvous host")->check(CLI::Range(1, 65535));
  c->add_option("--max-restarts", a->max_restarts, "restart failed workers up to K times")
      ->check(CLI::Range(0, 1000000));
  set_examples(c, {"dtrain train configs/resnet20_fmnist.toml",
                   "dtrain train configs/resnet20_fmnist.toml --set optim.lr=0.05 --set train.epochs=2",
                   "dtrain train --resume runs/resnet20_fmnist",
                   "dtrain train configs/resnet20_fmnist.toml --nproc-per-node 2      (data parallel, Gloo on CPU)",
                   "dtrain train cfg.toml --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 8",
                   "dtrain train cfg.toml --set model.init_from=runs/gpt2         (fine-tune)",
                   "dtrain train --help-config        (every recipe key)"});
  c->callback([a, resume, &run] {
    run = [a, resume] {
      if (a->help_config) {
        fmt::print("{}", config_reference());
        return 0;
      }
      TrainArgs t = *a;
      t.resume = resume->count() > 0;
      if (t.metrics_port >= 0) t.overrides.push_back("observability.prometheus_port=" + std::to_string(t.metrics_port));
      // `dtrain train --resume recipe.toml`: the value is the recipe, resume its run dir.
      std::error_code ec;
      if (t.resume && t.config.empty() && stdfs::is_regular_file(t.resume_dir, ec)) {
        t.config = t.resume_dir;
        t.resume_dir.clear();
      }
      if (t.config.empty() && !(t.resume && !t.resume_dir.empty()))
        user_error("dtrain train: give a recipe (dtrain train CONFIG) or a run to resume (--resume RUN_DIR)");
      return cmd_train(t);
    };
  });
}

}  // namespace dtrain::cli

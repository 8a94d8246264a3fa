// dtrain: command-line entry. Parses subcommands with CLI11 into the structs of
// cli/commands.h and calls the cmd_* functions; no logic lives here. Exit codes:
// 0 success, 2 user error (bad recipe, bad command line), 1 runtime fault.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "data/index.h"
#include "data/shapes.h"
#include "dist/bench_collectives.h"
#include "dist/scaling.h"
#include "data/token_shards.h"
#include "obs/report.h"
#include "core/error.h"
#include "train/config.h"

using namespace dtrain;

namespace {

const char* kDevices[] = {"auto", "cpu", "cuda"};

void add_common(CLI::App* c, std::vector<std::string>& overrides, std::string& device) {
  c->add_option("--set", overrides, "override a recipe key: section.key=value (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);
  c->add_option("--device", device, "run on this device (overrides run.device)")
      ->check(CLI::IsMember({kDevices[0], kDevices[1], kDevices[2]}));
}

// Deepest subcommand named on the command line (for "see ... --help" hints).
std::string chosen_path(const CLI::App& app) {
  std::string path = app.get_name();
  const CLI::App* cur = &app;
  for (;;) {
    auto subs = cur->get_subcommands();
    if (subs.empty()) break;
    cur = subs.front();
    path += " " + cur->get_name();
  }
  return path;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain: train ResNet, U-Net and GPT models from TOML recipes, on CPU or CUDA", "dtrain"};
  app.set_version_flag("--version", std::string("dtrain ") + DTRAIN_VERSION);
  app.footer(
      "Examples:\n"
      "  dtrain data fashion-mnist\n"
      "  dtrain train configs/resnet20_fmnist.toml\n"
      "  dtrain train configs/resnet20_fmnist.toml --set optim.lr=0.05 --set train.epochs=2\n"
      "  dtrain train --resume runs/resnet20_fmnist\n"
      "  dtrain train --help-config        (every recipe key)");

  // train
  TrainArgs ta;
  bool help_config = false;
  auto* train = app.add_subcommand("train", "train a model from a recipe (or resume a run)");
  train->add_option("config", ta.config, "recipe (TOML)")->type_name("CONFIG");
  add_common(train, ta.overrides, ta.device);
  auto* resume = train->add_option("--resume", ta.resume_dir,
                                   "continue a run from its latest checkpoint (RUN_DIR, or the recipe's run directory)")
                     ->type_name("[RUN_DIR]")
                     ->expected(0, 1);
  train->add_flag("--help-config", help_config, "print every recipe key with its type, default and range");
  int metrics_port = -1;
  train->add_option("--metrics-port", metrics_port,
                    "serve Prometheus metrics on this port (same as --set observability.prometheus_port=N)")
      ->check(CLI::Range(0, 65535));
  train->add_option("--nproc-per-node", ta.nproc_per_node, "worker processes on this node")
      ->check(CLI::Range(1, 1024));
  train->add_option("--nnodes", ta.nnodes, "number of nodes")->check(CLI::Range(1, 65536));
  train->add_option("--node-rank", ta.node_rank, "rank of this node")->check(CLI::Range(0, 65535));
  train->add_option("--master-addr", ta.master_addr, "address of the rendezvous host");
  train->add_option("--master-port", ta.master_port, "port of the rendezvous host")->check(CLI::Range(1, 65535));
  train->add_option("--max-restarts", ta.max_restarts, "restart failed workers up to K times")
      ->check(CLI::Range(0, 1000000));

  // eval
  EvalArgs ea;
  auto* eval = app.add_subcommand("eval", "evaluate a checkpoint on the recipe's eval split");
  eval->add_option("config", ea.config, "recipe (TOML)")->type_name("CONFIG")->required();
  eval->add_option("--checkpoint", ea.checkpoint,
                   "checkpoint directory, a run directory (its latest), or weights alone: a safetensors file with "
                   "PyTorch names or a Hugging Face model directory")
      ->type_name("DIR")
      ->required();
  add_common(eval, ea.overrides, ea.device);

  // sample
  SampleArgs sa;
  auto* sample = app.add_subcommand("sample", "generate text from a GPT checkpoint");
  sample->add_option("--checkpoint", sa.checkpoint,
                     "checkpoint directory, a run directory (its latest), or a Hugging Face GPT-2 model directory")
      ->type_name("DIR")
      ->required();
  sample->add_option("--prompt", sa.prompt, "text the generation continues")->capture_default_str();
  sample->add_option("--tokens", sa.tokens, "tokens to generate")->capture_default_str()->check(CLI::Range(0, 1000000));
  sample->add_option("--temperature", sa.temperature, "softmax temperature (0 = greedy)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  sample->add_option("--top-k", sa.top_k, "sample among the K most likely tokens (0 = all)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  sample->add_option("--seed", sa.seed, "random seed")->capture_default_str();
  sample->add_flag("--no-kv-cache", sa.no_kv_cache, "recompute the whole context for every token (reference path)");
  sample->add_option("--vocab", sa.vocab, "GPT-2 tokenizer files (encoder.json + vocab.bpe, or vocab.json + merges.txt); default: the checkpoint's own, else those beside the token shards")->type_name("DIR");
  sample->add_option("--device", sa.device, "run on this device (overrides run.device)")
      ->check(CLI::IsMember({kDevices[0], kDevices[1], kDevices[2]}));

  // bench
  BenchArgs ba;
  auto* bench = app.add_subcommand("bench", "measure steady-state training throughput and MFU");
  bench->add_option("config", ba.config, "recipe (TOML); not with --collectives / --predict-scaling")->type_name("CONFIG");
  bool coll = false, predict = false;
  dist::CollectiveBenchArgs cb;
  dist::PredictScalingArgs ps;
  std::string ops_csv;
  bench->add_flag("--collectives", coll, "all-reduce / reduce-scatter / all-gather bandwidth, as nccl-tests reports it");
  bench->add_flag("--predict-scaling", predict, "predicted data-parallel efficiency at 8, 64 and 512 GPUs");
  bench->add_option("--nproc-per-node", cb.nproc_per_node, "--collectives: worker processes")->check(CLI::Range(1, 1024));
  bench->add_option("--min-bytes", cb.min_bytes, "--collectives: smallest message")->check(CLI::Range(int64_t(4), int64_t(1) << 40));
  bench->add_option("--max-bytes", cb.max_bytes, "--collectives: largest message")->check(CLI::Range(int64_t(4), int64_t(1) << 40));
  bench->add_option("--step-factor", cb.step_factor, "--collectives: size multiplier")->check(CLI::Range(2, 1024));
  bench->add_option("--iters", cb.iters, "--collectives: timed calls per size")->check(CLI::Range(1, 100000));
  bench->add_option("--ops", ops_csv, "--collectives: comma-separated subset of allreduce,reduce_scatter,allgather");
  bench->add_option("--master-addr", cb.master_addr, "--collectives: rendezvous host");
  bench->add_option("--master-port", cb.master_port, "--collectives: rendezvous port")->check(CLI::Range(1, 65535));
  bench->add_option("--csv", cb.csv, "--collectives: also write the rows as CSV to this file");
  bench->add_option("--entry", ps.entries, "--predict-scaling: NAME:STEP_S:GRAD_BYTES[:BWD_SHARE[:OVERLAP]] (repeatable)");
  bench->add_option("--measured", ps.measured_csv, "--predict-scaling: collective-bench output to fit a measured link");
  bench->add_option("--warmup", ba.warmup, "untimed steps first")->capture_default_str()->check(CLI::Range(0, 1000000));
  bench->add_option("--steps", ba.steps, "timed steps")->capture_default_str()->check(CLI::Range(1, 1000000));
  bench->add_option("--json", ba.json, "also write the results (throughput, step breakdown, MFU, FLOPs) as JSON to this file")
      ->type_name("FILE");
  add_common(bench, ba.overrides, ba.device);

  // inspect
  InspectArgs ia;
  auto* inspect = app.add_subcommand("inspect", "describe a checkpoint or run directory");
  inspect->add_option("path", ia.path, "checkpoint or run directory, a safetensors file, or a Hugging Face model directory")
      ->type_name("PATH")
      ->required();

  // data
  auto* data = app.add_subcommand("data", "convert datasets into dtrain's shard formats");
  data->require_subcommand(1);
  DataFashionMnistArgs fa;
  auto* fm = data->add_subcommand("fashion-mnist", "Fashion-MNIST IDX files -> WebDataset tar shards");
  fm->add_option("--src", fa.src, "directory with the IDX .gz files")->capture_default_str()->type_name("DIR");
  fm->add_option("--out", fa.out, "output directory")->capture_default_str()->type_name("DIR");
  fm->add_option("--shard-size", fa.shard_size, "samples per shard")->capture_default_str()->check(CLI::Range(1, 100000000));
  DataImagesArgs da;
  auto* im = data->add_subcommand("images", "ImageFolder tree (SRC/<class>/<image>) -> WebDataset tar shards");
  im->add_option("src", da.src, "ImageFolder root")->type_name("SRC")->required();
  im->add_option("--out", da.out, "output directory")->type_name("DIR")->required();
  im->add_option("--split", da.split, "split name of the shards")->capture_default_str();
  im->add_option("--shard-size", da.shard_size, "samples per shard")->capture_default_str()->check(CLI::Range(1, 100000000));

  DataTokenizeArgs tk;
  auto* tok = data->add_subcommand("tokenize", "text files -> llm.c token shards (train_000000.bin, val_000000.bin)");
  tok->add_option("inputs", tk.inputs, "text files (each one document)")->type_name("INPUT...")->required();
  tok->add_option("--out", tk.out, "output directory")->type_name("DIR")->required();
  tok->add_option("--tokenizer", tk.tokenizer, "byte | gpt2")->capture_default_str()->check(CLI::IsMember({"byte", "gpt2"}));
  tok->add_option("--vocab", tk.vocab, "directory with GPT-2's encoder.json and vocab.bpe (copied beside the shards)")->type_name("DIR");
  tok->add_option("--val-fraction", tk.val_fraction, "share of tokens for the validation shard")->capture_default_str()->check(CLI::Range(0.0, 0.9));
  tok->add_option("--shard-tokens", tk.shard_tokens, "tokens per train shard (llm.c's fineweb: 10^8)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(1024), int64_t(2147483647)));
  tok->add_option("--workers", tk.workers, "encoding threads (0 = every core)")->capture_default_str()->check(CLI::Range(0, 1024));
  DataShapesArgs sh;
  auto* shp = data->add_subcommand("shapes", "synthetic segmentation set (circles, rectangles, triangles) -> shards");
  shp->add_option("--out", sh.out, "output directory")->type_name("DIR")->required();
  shp->add_option("--count", sh.count, "images in all")->capture_default_str()->check(CLI::Range(2, 10000000));
  shp->add_option("--size", sh.size, "image side in pixels")->capture_default_str()->check(CLI::Range(8, 4096));
  shp->add_option("--classes", sh.classes, "classes including background")->capture_default_str()->check(CLI::Range(2, 64));
  shp->add_option("--seed", sh.seed, "generator seed")->capture_default_str();
  shp->add_option("--val-fraction", sh.val_fraction, "share of images in the val split")->capture_default_str()->check(CLI::Range(0.0, 0.9));
  DataSegmentationArgs sg;
  auto* seg = data->add_subcommand("segmentation", "IMAGES/ + MASKS/ folders (matching stems) -> shards");
  seg->add_option("images", sg.images, "folder of images")->type_name("IMAGES")->required();
  seg->add_option("masks", sg.masks, "folder of masks (8-bit, value = class)")->type_name("MASKS")->required();
  seg->add_option("--out", sg.out, "output directory")->type_name("DIR")->required();
  seg->add_option("--split", sg.split, "split name")->capture_default_str();

  DataIndexArgs dx;
  auto* idx = data->add_subcommand("index", "write manifest.json for WebDataset shards made by another tool");
  idx->add_option("dir", dx.dir, "dataset directory (splits: DIR/<split>/*.tar, or --split)")->type_name("DIR")->required();
  idx->add_option("--split", dx.splits, "a split and its shards: NAME=GLOB relative to DIR, e.g. train='train-*.tar' (repeatable)")
      ->type_name("NAME=GLOB");
  idx->add_option("--num-classes", dx.num_classes, "number of classes (default: largest label or mask value + 1)")
      ->check(CLI::Range(2, 1000000));
  idx->add_flag("--force", dx.force, "replace an existing manifest.json");

  ImportGpt2Args ig;
  auto* import_ = app.add_subcommand("import", "turn another framework's weights into a dtrain checkpoint");
  import_->require_subcommand(1);
  auto* imp_gpt2 = import_->add_subcommand(
      "gpt2", "Hugging Face GPT-2 model.safetensors or model directory -> run directory with a step-0 checkpoint");
  imp_gpt2->add_option("file", ig.file, "model.safetensors, or a directory with model.safetensors, config.json and "
                                        "the tokenizer's vocab.json + merges.txt")
      ->type_name("FILE|DIR")
      ->required();
  imp_gpt2->add_option("--out", ig.out, "run directory to create")->type_name("DIR")->required();
  imp_gpt2->add_option("--config", ig.config, "recipe whose [model] must fit the file (default: inferred)")
      ->type_name("RECIPE");

  ReportArgs ra;
  auto* report = app.add_subcommand("report", "summarise one run or several side by side");
  report->add_option("runs", ra.runs, "run directories")->type_name("RUN_DIR...")->required();
  report->add_option("--format", ra.format, "text | md | json")->capture_default_str()->check(CLI::IsMember({"text", "md", "json"}));

  auto* info = app.add_subcommand("info", "print the build, libraries and devices");
  auto* version = app.add_subcommand("version", "print the version");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    fmt::print(stderr, "error: {} (see '{} --help')\n", e.what(), chosen_path(app));
    return 2;
  }

  try {
    if (*train) {
      if (help_config) {
        fmt::print("{}", config_reference());
        return 0;
      }
      ta.resume = resume->count() > 0;
      if (metrics_port >= 0) ta.overrides.push_back("observability.prometheus_port=" + std::to_string(metrics_port));
      // `dtrain train --resume recipe.toml`: the value is the recipe, resume its run dir.
      std::error_code ec;
      if (ta.resume && ta.config.empty() && std::filesystem::is_regular_file(ta.resume_dir, ec)) {
        ta.config = ta.resume_dir;
        ta.resume_dir.clear();
      }
      if (ta.config.empty() && !(ta.resume && !ta.resume_dir.empty()))
        throw UserError("dtrain train: give a recipe (dtrain train CONFIG) or a run to resume (--resume RUN_DIR)");
      return cmd_train(ta);
    }
    if (*eval) return cmd_eval(ea);
    if (*sample) return cmd_sample(sa);
    if (*bench) {
      if (coll) {
        cb.device = ba.device.empty() ? "cpu" : ba.device;
        if (bench->count("--warmup")) cb.warmup = ba.warmup;
        if (!ops_csv.empty()) {
          cb.ops.clear();
          size_t start = 0;
          while (start <= ops_csv.size()) {
            size_t comma = ops_csv.find(',', start);
            if (comma == std::string::npos) comma = ops_csv.size();
            if (comma > start) cb.ops.push_back(ops_csv.substr(start, comma - start));
            start = comma + 1;
          }
        }
        return dist::cmd_bench_collectives(cb);
      }
      if (predict) return dist::cmd_predict_scaling(ps);
      if (ba.config.empty()) throw UserError("dtrain bench: give a recipe, or --collectives / --predict-scaling");
      return cmd_bench(ba);
    }
    if (*inspect) return cmd_inspect(ia);
    if (*imp_gpt2) return cmd_import_gpt2(ig);
    if (*fm) return cmd_data_fashion_mnist(fa);
    if (*im) return cmd_data_images(da);
    if (*tok) return cmd_data_tokenize(tk);
    if (*shp) return cmd_data_shapes(sh);
    if (*seg) return cmd_data_segmentation(sg);
    if (*idx) return cmd_data_index(dx);
    if (*report) return cmd_report(ra);
    if (*info) return cmd_info();
    if (*version) return cmd_version();
    fmt::print(stderr, "{}", app.help());
    return 2;
  } catch (const Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}

// ZeRO-3 hybrid sharding (parallel.shard_group_size: FSDP's HYBRID_SHARD, ZeRO++ hpZ) end to
// end, on CPU with Gloo and tiny models:
//  * 4 ranks in 2 shard groups of 2 (GPT; ResNet with BatchNorm) give the per-step losses of
//    ONE process with grad_accum = 4 over 20 steps (the same global batch); the checkpoint holds
//    2 optimizer files (state.json: optimizer.shards = 2), written by the first group only;
//  * that checkpoint resumes on 2 ranks with ZeRO-1, and a 1-process checkpoint on 4 ranks with
//    hybrid sharding, each continuing as the uninterrupted run;
//  * a shard group size the world cannot hold, or one set without ZeRO-3, is a one-line user
//    error (exit 2) naming the key, from the launcher and from a worker started by hand.
//
// Tolerance: 1e-5 relative on every loss, as tests/test_zero3.cpp (the f32 sums differ in
// order only: a reduce-scatter within the group, then an all-reduce across the groups).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include "core/fsutil.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kSrc = DTRAIN_SOURCE_DIR;
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_zero3_hybrid";

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string ckpt(const std::string& name, int64_t step) {
  return run_dir(name) + "/checkpoints/" + CheckpointManager::dir_name(step);
}

// A few KB of text, byte-tokenized, made once under a file lock (ctest runs cases in parallel).
std::string tokens() {
  stdfs::create_directories(kWork);
  const int fd = open((kWork + "/.lock").c_str(), O_CREAT | O_RDWR, 0644);
  REQUIRE(fd >= 0);
  flock(fd, LOCK_EX);
  const std::string d = kWork + "/tokens";
  if (!stdfs::exists(d + "/manifest.json")) {
    auto r = run_cmd(kBin + " data tokenize " + kSrc + "/src/train/step.cpp " + kSrc + "/src/train/session.cpp --out " +
                     d + " --tokenizer byte --val-fraction 0.2");
    CHECK_MESSAGE(r.code == 0, r.all());
  }
  flock(fd, LOCK_UN);
  close(fd);
  return d;
}

std::string model_and_data(const std::string& kind) {
  if (kind == "gpt")
    return "[model]\nkind = \"gpt\"\nn_layer = 3\nn_head = 2\nn_embd = 32\nblock_size = 16\nvocab_size = 256\n"
           "[data]\nkind = \"tokens\"\npath = \"" + tokens() + "\"\neval_split = \"val\"\n"
           "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.01\n"
           "[schedule]\nkind = \"cosine\"\nwarmup_steps = 2\n";
  return "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
         "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
         "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nweight_decay = 5e-4\n";
}

// `steps` steps of batch 2 per rank, a checkpoint every `every`; `extra` goes into [parallel].
// Removes the run directory.
std::string recipe(const std::string& name, const std::string& kind, int steps, int every, const std::string& extra) {
  stdfs::create_directories(kWork);
  stdfs::remove_all(run_dir(name));
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 11\ndevice = \"cpu\"\nthreads = 1\n"
    << model_and_data(kind) << "[train]\nbatch_size = 2\nmax_steps = " << steps << "\nclip_grad_norm = 1.0\n"
    << "[checkpoint]\nevery_steps = " << every << "\nkeep_last = 10\n"
    << "[eval]\nevery_steps = " << (kind == "gpt" ? 10 : 0) << "\nbatch_size = 2\nmax_batches = 2\n"
    << "[log]\nevery_steps = 1\ntensorboard = false\n"
    << "[parallel]\ntimeout_s = 30\n"
    << extra;
  return path;
}

std::string train(const std::string& args) { return kBin + " train " + args; }

std::map<int64_t, double> losses(const std::string& name, const std::string& kind = "train") {
  std::map<int64_t, double> out;
  for (auto& r : read_jsonl(run_dir(name) + "/metrics.jsonl"))
    if (r["kind"] == kind) out[r["step"].get<int64_t>()] = r[kind == "train" ? "loss" : "eval_loss"].get<double>();
  return out;
}

// Every loss of steps [from, to] within 1e-5 relative of the reference's; returns the largest
// relative difference seen (reported by the tests).
double check_losses(const std::string& run, const std::string& ref, int64_t from, int64_t to,
                    const std::string& kind = "train") {
  auto a = losses(run, kind), b = losses(ref, kind);
  double worst = 0;
  for (int64_t s = from; s <= to; ++s) {
    if (kind != "train" && !b.count(s)) continue;
    INFO(run << " " << kind << " step " << s);
    REQUIRE(a.count(s));
    REQUIRE(b.count(s));
    CHECK(std::isfinite(a[s]));
    CHECK(std::abs(a[s] - b[s]) <= 1e-5 * std::abs(b[s]));
    worst = std::max(worst, std::abs(a[s] - b[s]) / std::abs(b[s]));
  }
  return worst;
}

// Every trained tensor of two model.safetensors within 1e-5 of the model's largest weight
// (BatchNorm running statistics are rank 0's own).
void check_weights(const std::string& dir, const std::string& ref_dir) {
  SafetensorsReader a(dir + "/model.safetensors"), b(ref_dir + "/model.safetensors");
  REQUIRE(a.names() == b.names());
  double scale = 0, worst = 0;
  std::string worst_name;
  for (const auto& n : b.names()) {
    if (n.find("running_") != std::string::npos || b.dtype(n) != "F32") continue;
    std::vector<float> u(a.nbytes(n) / 4), v(b.nbytes(n) / 4);
    REQUIRE(u.size() == v.size());
    a.read(n, u.data(), u.size() * 4);
    b.read(n, v.data(), v.size() * 4);
    for (size_t i = 0; i < v.size(); ++i) {
      scale = std::max(scale, double(std::fabs(v[i])));
      if (std::fabs(u[i] - v[i]) > worst) {
        worst = std::fabs(u[i] - v[i]);
        worst_name = n;
      }
    }
  }
  INFO(dir << ": " << worst_name << " differs by " << worst << " (largest weight " << scale << ")");
  CHECK(scale > 0);
  CHECK(worst <= 1e-5 * scale);
}

// A run directory `name` holding `from`'s recipe and its checkpoint at `step` (latest).
std::string copy_run(const std::string& from, const std::string& name, int64_t step) {
  const std::string rd = run_dir(name);
  stdfs::remove_all(rd);
  stdfs::create_directories(rd + "/checkpoints");
  stdfs::copy_file(run_dir(from) + "/config.toml", rd + "/config.toml");
  stdfs::copy(ckpt(from, step), rd + "/checkpoints/" + CheckpointManager::dir_name(step));
  fs::write_file(rd + "/checkpoints/latest", CheckpointManager::dir_name(step) + "\n");
  return rd;
}

const std::string kHybrid = "zero = 3\nshard_group_size = 2\n";

// 1 process with grad_accum 4 (`ref`) and 4 ranks in 2 shard groups of 2 (`hy`), 20 steps each,
// a checkpoint every 10: equal losses and weights, 2 optimizer files.
void equal_losses(const std::string& kind, const std::string& ref, const std::string& hy, int port) {
  auto a = run_cmd(train(recipe(ref, kind, 20, 10, "") + " --set train.grad_accum=4"));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  auto b = run_cmd(train(recipe(hy, kind, 20, 10, kHybrid) + " --nproc-per-node 4 --master-port " +
                         std::to_string(port)));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  CHECK_MESSAGE(b.all().find("ZeRO-3 hybrid sharding: shard groups of 2 ranks, 2 replicas") != std::string::npos,
                b.all());
  CHECK(losses(ref).size() == 20);
  const double worst = check_losses(hy, ref, 1, 20);
  MESSAGE(kind << ": 4 ranks (2 shard groups of 2) vs 1 process, largest relative loss difference " << worst);
  check_losses(hy, ref, 1, 20, "eval");
  check_weights(ckpt(hy, 20), ckpt(ref, 20));
  // the replicas hold the same shards: the first group's 2 ranks write them, the others nothing
  for (int64_t step : {10, 20}) {
    CHECK(entries_with_prefix(ckpt(hy, step), "optim-") ==
          std::vector<std::string>{"optim-00000-of-00002.safetensors", "optim-00001-of-00002.safetensors"});
    const auto st = nlohmann::json::parse(fs::read_file(ckpt(hy, step) + "/state.json"));
    CHECK(st["optimizer"]["shards"] == 2);
    CHECK(st["world_size"] == 4);
    CHECK(CheckpointManager::verify(ckpt(hy, step)) == "");
  }
}

}  // namespace

TEST_SUITE("integration") {

// Then the hybrid checkpoint at step 10 continues on 2 ranks with ZeRO-1, and the 1-process
// checkpoint at step 10 on 4 ranks with hybrid sharding, both as the uninterrupted run.
TEST_CASE("zero3 hybrid: GPT on 4 ranks in 2 shard groups equals 1 process and its checkpoints move both ways") {
  equal_losses("gpt", "hy_gpt_ref", "hy_gpt", 29970);
  CHECK(losses("hy_gpt", "eval").size() == 2);  // steps 10 and 20
  // hybrid -> 2 ranks, ZeRO-1
  std::string rd = copy_run("hy_gpt", "hy_gpt_to_z1", 10);
  auto a = run_cmd(train("--resume " + rd +
                         " --nproc-per-node 2 --master-port 29972 --set train.grad_accum=2 --set parallel.zero=1"));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  MESSAGE("hybrid -> 2 ranks ZeRO-1: largest relative loss difference "
          << check_losses("hy_gpt_to_z1", "hy_gpt_ref", 11, 20));
  check_weights(ckpt("hy_gpt_to_z1", 20), ckpt("hy_gpt_ref", 20));
  CHECK(entries_with_prefix(ckpt("hy_gpt_to_z1", 20), "optim-").size() == 2);
  // 1 process -> hybrid on 4 ranks
  rd = copy_run("hy_gpt_ref", "hy_gpt_from_1", 10);
  auto b = run_cmd(train("--resume " + rd +
                         " --nproc-per-node 4 --master-port 29974 --set train.grad_accum=1 --set parallel.zero=3 "
                         "--set parallel.shard_group_size=2"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  MESSAGE("1 process -> hybrid: largest relative loss difference "
          << check_losses("hy_gpt_from_1", "hy_gpt_ref", 11, 20));
  check_weights(ckpt("hy_gpt_from_1", 20), ckpt("hy_gpt_ref", 20));
  CHECK(entries_with_prefix(ckpt("hy_gpt_from_1", 20), "optim-").size() == 2);
}

TEST_CASE("zero3 hybrid: ResNet with BatchNorm on 4 ranks in 2 shard groups gives the losses of 1 process") {
  equal_losses("resnet", "hy_resnet_ref", "hy_resnet", 29976);
}

// Checked by the launcher before any worker starts, and by a worker started by hand (as
// torchrun would) before it connects.
TEST_CASE("zero3 hybrid: a shard group size the world cannot hold or one set without ZeRO-3 is a one-line user error") {
  struct Bad {
    std::string name, parallel, message;
  };
  const std::vector<Bad> bad = {
      {"hy_bad_divide", "zero = 3\nshard_group_size = 3\n",
       "parallel.shard_group_size = 3 must divide the world size 4"},
      {"hy_bad_zero", "zero = 1\nshard_group_size = 2\n",
       "parallel.shard_group_size = 2 (of 4 ranks) needs parallel.zero = 3, but parallel.zero is 1"},
  };
  const std::string worker_env =
      "env -u OMP_NUM_THREADS -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK -u TORCHELASTIC_RESTART_COUNT "
      "-u TORCHELASTIC_USE_AGENT_STORE -u DTRAIN_LAUNCHER -u DTRAIN_JOB_TOKEN -u SLURM_PROCID -u SLURM_NTASKS "
      "-u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE RANK=1 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29980 ";
  for (const Bad& b : bad) {
    const std::string rec = recipe(b.name, "gpt", 2, 0, b.parallel);
    auto l = run_cmd(train(rec + " --nproc-per-node 4 --master-port 29978"));
    INFO(b.name << ": " << l.all());
    CHECK(l.code == 2);
    CHECK(l.err_lines() == 1);
    CHECK(l.err.find(b.message) != std::string::npos);
    CHECK(!stdfs::exists(run_dir(b.name)));
    auto w = run_cmd(worker_env + train(rec));
    INFO(b.name << " (worker): " << w.all());
    CHECK(w.code == 2);
    CHECK(w.err_lines() == 1);
    CHECK(w.err.find(b.message) != std::string::npos);
  }
}

}  // TEST_SUITE

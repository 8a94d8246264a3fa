// ZeRO-3 (parallel.zero = 3) end to end, on CPU with Gloo and tiny models:
//  * each family (GPT, ResNet with BatchNorm, U-Net) on 2 or 4 ranks gives the per-step losses
//    of ONE process with grad_accum = N over 20 steps (the same global batch);
//  * a 4-rank ZeRO-3 checkpoint resumes on 2 ranks with ZeRO-1, that one on 1 process, and a
//    ZeRO-1 checkpoint on 2 ranks with ZeRO-3, each continuing as the uninterrupted run;
//  * the measured high-water mark of a rank's allocations under ZeRO-3 against ZeRO-0;
//  * hybrid sharding (shard within groups of 2, replicate across) on 4 ranks.
//
// Tolerance: 1e-5 relative on every loss, as the other layouts (tests/train/test_train_dist.cpp).
// The f32 sums differ in order only: a reduce-scatter averages the ranks' gradients where the
// single process adds its micro-batches' in sequence; the weights themselves are gathered
// copies, bit for bit the master shards.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "backend/backend.h"
#include "comm/gloo_comm.h"
#include "comm/store.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "nn/params.h"
#include "run_cmd.h"
#include "checkpoint_fixture.h"
#include "token_fixture.h"
#include "run_readers.h"
#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "session/dist_setup.h"
#include "checkpoint/safetensors.h"
#include "session/session.h"
#include "session/step.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_zero3";

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string ckpt(const std::string& name, int64_t step) {
  return run_dir(name) + "/checkpoints/" + CheckpointManager::dir_name(step);
}
std::string tokens() { return byte_tokens(kWork); }

std::string model_and_data(const std::string& kind) {
  if (kind == "gpt")
    return "[model]\nkind = \"gpt\"\nn_layer = 3\nn_head = 2\nn_embd = 32\nblock_size = 16\nvocab_size = 256\n"
           "[data]\nkind = \"tokens\"\npath = \"" + tokens() + "\"\neval_split = \"val\"\n"
           "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.01\n"
           "[schedule]\nkind = \"cosine\"\nwarmup_steps = 2\n";
  if (kind == "llama")  // the GPT above in the Llama family: grouped-query attention, an untied head
    return "[model]\nkind = \"gpt\"\narch = \"llama\"\nn_layer = 3\nn_head = 2\nn_kv_head = 1\nn_embd = 32\n"
           "intermediate_size = 64\nblock_size = 16\nvocab_size = 256\n"
           "[data]\nkind = \"tokens\"\npath = \"" + tokens() + "\"\neval_split = \"val\"\n"
           "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.01\n"
           "[schedule]\nkind = \"cosine\"\nwarmup_steps = 2\n";
  if (kind == "resnet")
    return "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
           "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
           "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nweight_decay = 5e-4\n";
  return "[model]\nkind = \"unet\"\ndepth = 2\nbase_channels = 4\nin_channels = 1\nnum_classes = 3\n"
         "[data]\nkind = \"synthetic\"\nsynthetic_height = 16\nsynthetic_width = 16\n"
         "[optim]\nname = \"adamw\"\nlr = 3e-3\n";
}

// `steps` steps of batch 2 per rank, a checkpoint every `every`; removes the run directory.
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

// A worker started by hand, as torchrun starts them (no launcher variables of this test's
// own environment leak in); add RANK=, WORLD_SIZE=, MASTER_ADDR=, MASTER_PORT=.
const std::string kWorkerEnv =
    "env -u OMP_NUM_THREADS -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK -u TORCHELASTIC_RESTART_COUNT "
    "-u TORCHELASTIC_USE_AGENT_STORE -u DTRAIN_LAUNCHER -u DTRAIN_JOB_TOKEN -u SLURM_PROCID -u SLURM_NTASKS "
    "-u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE ";

// A run directory `name` holding `from`'s recipe and its checkpoint at `step` (latest).
std::string copy_run(const std::string& from, const std::string& name, int64_t step) {
  return copy_run_at(run_dir(from), run_dir(name), step);
}

void equal_losses(const std::string& kind, int ranks, int port) {
  const std::string ref = "z3_" + kind + "_ref", z3 = "z3_" + kind + "_" + std::to_string(ranks);
  auto a = run_cmd(train(recipe(ref, kind, 20, 10, "") + " --set train.grad_accum=" + std::to_string(ranks)));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  auto b = run_cmd(train(recipe(z3, kind, 20, 10, "zero = 3\n") + " --nproc-per-node " + std::to_string(ranks) +
                         " --master-port " + std::to_string(port)));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  CHECK_MESSAGE(b.all().find("ZeRO-3: ") != std::string::npos, b.all());
  CHECK(losses(ref).size() == 20);
  check_losses(z3, ref, 1, 20);
  check_losses(z3, ref, 1, 20, "eval");
  check_weights(ckpt(z3, 20), ckpt(ref, 20));
  // one optimizer file and one model file per rank, each holding one range per unit: no rank
  // gathered the whole model to save it
  CHECK(entries_with_prefix(ckpt(z3, 20), "optim-").size() == size_t(ranks));
  CHECK(entries_with_prefix(ckpt(z3, 20), "model-").size() == size_t(ranks));
  CHECK(!stdfs::exists(ckpt(z3, 20) + "/model.safetensors"));
  const auto st = nlohmann::json::parse(fs::read_file(ckpt(z3, 20) + "/state.json"));
  CHECK(st["model"]["shards"] == ranks);
  // the checkpoint event counts each rank's bytes once: the files' sizes less their headers
  uint64_t on_disk = 0, reported = 0;
  for (const auto& e : stdfs::directory_iterator(ckpt(z3, 20))) on_disk += e.file_size();
  for (auto& e : read_jsonl(run_dir(z3) + "/events.jsonl"))
    if (e["event"] == "checkpoint" && e["step"] == 20) reported = e["bytes"].get<uint64_t>();
  CHECK(reported <= on_disk);
  CHECK(reported + 64 * 1024 > on_disk);
}

const std::string kHybrid = "zero = 3\nshard_group_size = 2\n";

// 1 process with grad_accum 4 (`ref`) and 4 ranks in 2 shard groups of 2 (`hy`), 20 steps each,
// a checkpoint every 10: equal losses and weights, 2 optimizer files.
void equal_losses_hybrid(const std::string& kind, const std::string& ref, const std::string& hy, int port) {
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
    CHECK(entries_with_prefix(ckpt(hy, step), "model-") ==
          std::vector<std::string>{"model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors"});
    const auto st = nlohmann::json::parse(fs::read_file(ckpt(hy, step) + "/state.json"));
    CHECK(st["optimizer"]["shards"] == 2);
    CHECK(st["world_size"] == 4);
    CHECK(CheckpointManager::verify(ckpt(hy, step)) == "");
  }
}


}  // namespace

TEST_SUITE("integration") {

TEST_CASE("zero3: GPT on 4 ranks gives the losses and evaluations of 1 process with grad_accum 4") {
  equal_losses("gpt", 4, 29951);
  CHECK(losses("z3_gpt_4", "eval").size() == 2);  // steps 10 and 20, evaluated on every rank
}

TEST_CASE("zero3: ResNet with BatchNorm on 2 ranks gives the losses of 1 process with grad_accum 2") {
  equal_losses("resnet", 2, 29953);
}

TEST_CASE("zero3: a Llama (GQA untied) on 2 ranks gives the losses and evaluations of 1 process with grad_accum 2") {
  equal_losses("llama", 2, 29379);
}

TEST_CASE("zero3: U-Net on 2 ranks gives the losses of 1 process with grad_accum 2") {
  equal_losses("unet", 2, 29955);
}

// 4 ranks ZeRO-3 -> 2 ranks ZeRO-1 -> 1 process, and a ZeRO-1 checkpoint back into ZeRO-3:
// each continues as the uninterrupted run (same global batch: grad_accum = 4 / ranks).
TEST_CASE("zero3: checkpoints move between layouts: 4 ranks ZeRO-3 then 2 ranks ZeRO-1 then 1 process") {
  const std::string ref = "z3_move_ref";
  auto r = run_cmd(train(recipe(ref, "gpt", 6, 2, "zero = 3\n") + " --nproc-per-node 4 --master-port 29961"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  // 4 x ZeRO-3 at step 2 -> 2 ranks, ZeRO-3: each reads its pieces from the 4 ranks' model shards
  std::string rd = copy_run(ref, "z3_move_z3", 2);
  auto z = run_cmd(train("--resume " + rd + " --nproc-per-node 2 --master-port 29969 --set train.grad_accum=2"));
  REQUIRE_MESSAGE(z.code == 0, z.all());
  check_losses("z3_move_z3", ref, 3, 6);
  check_weights(ckpt("z3_move_z3", 6), ckpt(ref, 6));
  CHECK(entries_with_prefix(ckpt("z3_move_z3", 6), "model-").size() == 2);
  // 4 x ZeRO-3 at step 2 -> 2 ranks, ZeRO-1
  rd = copy_run(ref, "z3_move_2", 2);
  auto a = run_cmd(train("--resume " + rd +
                         " --nproc-per-node 2 --master-port 29963 --set train.grad_accum=2 --set parallel.zero=1"));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  check_losses("z3_move_2", ref, 3, 6);
  check_weights(ckpt("z3_move_2", 6), ckpt(ref, 6));
  // its step 4 -> 1 process
  rd = copy_run("z3_move_2", "z3_move_1", 4);
  auto b = run_cmd(train("--resume " + rd + " --set train.grad_accum=4 --set parallel.zero=0"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  check_losses("z3_move_1", ref, 5, 6);
  check_weights(ckpt("z3_move_1", 6), ckpt(ref, 6));
  CHECK(entries_with_prefix(ckpt("z3_move_1", 6), "optim-") ==
        std::vector<std::string>{"optim-00000-of-00001.safetensors"});
  // the ZeRO-1 checkpoint at step 4 -> 2 ranks, ZeRO-3
  rd = copy_run("z3_move_2", "z3_move_back", 4);
  auto c = run_cmd(train("--resume " + rd +
                         " --nproc-per-node 2 --master-port 29965 --set train.grad_accum=2 --set parallel.zero=3"));
  REQUIRE_MESSAGE(c.code == 0, c.all());
  check_losses("z3_move_back", ref, 5, 6);
  check_weights(ckpt("z3_move_back", 6), ckpt(ref, 6));
}

// The layout keeps a checkpoint's global batch: a 2-rank ZeRO-3 run resumed on 1 process with
// nothing else changed accumulates 2 micro-batches (before, it continued silently with half the
// global batch and left the uninterrupted run's losses by about 5e-2).
TEST_CASE("zero3: a 2-rank checkpoint resumed on 1 process with only the process count changed keeps the global batch") {
  const std::string ref = "z3_gb_ref";
  auto a = run_cmd(train(recipe(ref, "gpt", 4, 2, "zero = 3\n") + " --nproc-per-node 2 --master-port 29391"));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  const std::string rd = copy_run(ref, "z3_gb_1", 2);
  auto b = run_cmd(train("--resume " + rd));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  CHECK_MESSAGE(b.all().find("train.grad_accum = 2 (was 1): the checkpoint's global batch of 4 (written by 2 data "
                             "ranks) over 1 data rank of 2 sequences") != std::string::npos,
                b.all());
  check_losses("z3_gb_1", ref, 3, 4);
  check_weights(ckpt("z3_gb_1", 4), ckpt(ref, 4));
}

}  // TEST_SUITE

namespace {

// Ranks as threads (each its own CPU session, store client and Gloo communicator) train a
// GPT of 16 thin blocks for 3 steps; returns each rank's high-water mark of the bytes it
// allocated through its backend for the model's state (everything but the activation arena,
// which is the same under every stage: the steps are checked to keep nothing else).
std::vector<int64_t> peak_bytes(int world, int zero, int64_t* window_bytes) {
  comm::StoreServer server("127.0.0.1", 0, "zero3-memory");
  std::vector<int64_t> peak(size_t(world), 0);
  std::vector<std::exception_ptr> errs(static_cast<size_t>(world));
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r)
    th.emplace_back([&, r] {
      try {
        const std::string text = "[run]\nseed = 5\ndevice = \"cpu\"\nthreads = 1\n"
                                 "[model]\nkind = \"gpt\"\nn_layer = 16\nn_head = 2\nn_embd = 32\nblock_size = 8\n"
                                 "vocab_size = 64\n[data]\nkind = \"synthetic\"\n[train]\nbatch_size = 1\n"
                                 "max_steps = 3\n[optim]\nname = \"adamw\"\nlr = 0.001\n[parallel]\nzero = " +
                                 std::to_string(zero) + "\n";
        Config cfg = Config::parse(text, "zero3_memory.toml");
        SessionOptions so;
        so.rank = r;
        so.world_size = world;
        so.shard_optimizer = zero == 1 || zero == 2;
        so.shard_params = zero == 3;
        auto s = make_session(cfg, so);
        DistRuntime d;
        d.env.rank = r;
        d.env.world_size = world;
        d.zero_stage = zero;
        d.store = std::make_unique<comm::StoreClient>("127.0.0.1", server.port(), "zero3-memory",
                                                      std::chrono::milliseconds(20000));
        comm::GlooOptions o;
        o.timeout_s = 30;
        d.comm = std::make_unique<comm::GlooCommunicator>(*d.store, r, world, o);
        attach(d, *s, 25.0);
        // every parameter, gradient, optimizer and window buffer exists now; the steps add
        // the activation arena (lazily, 64 MiB at first) and a few small buffers
        peak[size_t(r)] = s->be->alloc_counts().peak_bytes;
        for (int64_t step = 0; step < 3; ++step) {
          StepStats st = train_step(*s, step, 0.001, d.dp.get());
          if (!std::isfinite(st.loss)) throw std::runtime_error("non-finite loss");
        }
        const int64_t after = s->be->alloc_counts().bytes_in_use - int64_t(s->arena->capacity());
        if (after > peak[size_t(r)] + 64 * 1024)  // the step's loss slots and timers: a few KB
          throw std::runtime_error(fmt::format("steps kept {} bytes beyond the arena", after - peak[size_t(r)]));
        if (r == 0 && d.dp->zero3()) *window_bytes = d.dp->zero3()->window_bytes();
      } catch (...) {
        errs[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : th) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
  return peak;
}

}  // namespace

TEST_SUITE("integration") {

// The high-water mark of the allocations a rank makes through its backend for parameters,
// gradients, optimizer state and the ZeRO-3 windows, measured (Backend::alloc_counts), not
// computed.
// ZeRO-3 holds 1/N of the parameters, gradients and AdamW state, plus the windows: two
// units' parameters and gradients and the root units; with 16 blocks those are ~2/16 of the
// full parameters + gradients, so the bound is 1/N + 2.5/16 of ZeRO-0's peak.
TEST_CASE("zero3: a rank's measured peak allocation under ZeRO-3 is about 1/N of ZeRO-0's") {
  const int N = 4;
  int64_t windows = 0, unused = 0;
  const std::vector<int64_t> z0 = peak_bytes(N, 0, &unused);
  const std::vector<int64_t> z3 = peak_bytes(N, 3, &windows);
  const std::vector<int64_t> z2 = peak_bytes(N, 2, &unused);
  for (int r = 0; r < N; ++r) {
    const double ratio = double(z3[size_t(r)]) / double(z0[size_t(r)]);
    MESSAGE("rank " << r << ": peak ZeRO-0 " << z0[size_t(r)] << " B, ZeRO-2 " << z2[size_t(r)] << " B, ZeRO-3 "
                    << z3[size_t(r)] << " B (" << ratio << " of ZeRO-0; windows " << windows << " B)");
    CHECK(ratio <= 1.0 / N + 2.5 / 16);
    CHECK(ratio >= 0.9 / N);  // nothing is lost: at least the rank's shards
    CHECK(z3[size_t(r)] < z2[size_t(r)]);
  }
}

}  // TEST_SUITE

TEST_SUITE("integration") {

// Two ranks started as torchrun would start them (no dtrain launcher that could stop the
// survivor): rank 1 is SIGKILLed with its first all-gather of step 3 in flight. Rank 0 must
// end (exit 1) well within parallel.timeout_s, its error naming the collective's group and
// the lost rank.
// Each rank writes its own model shard: one that cannot fails the save on every rank, and the
// checkpoint before it stays the latest, valid and loadable.
TEST_CASE("zero3: a rank that cannot write its model shard fails the checkpoint on every rank") {
  const std::string name = "z3_write_fail";
  const std::string rec = recipe(name, "resnet", 4, 2, "zero = 3\n");
  auto r = run_cmd("DTRAIN_FAILPOINTS=checkpoint.write_fail=1:4 " + train(rec + " --nproc-per-node 2 --master-port 29979"));
  INFO(r.all());
  CHECK(r.code == 1);
  const std::string msg = "checkpoint step_00000004 failed: rank 1 could not write model-00001-of-00002.safetensors";
  size_t seen = 0;
  for (size_t at = r.all().find(msg); at != std::string::npos; at = r.all().find(msg, at + 1)) ++seen;
  CHECK(seen == 2);  // rank 0 and rank 1 print the same line
  CHECK(fs::read_file(run_dir(name) + "/checkpoints/latest") == "step_00000002\n");
  CHECK(CheckpointManager::verify(ckpt(name, 2)) == "");
  CHECK(!stdfs::exists(ckpt(name, 4)));
  CHECK(entries_with_prefix(ckpt(name, 2), "model-").size() == 2);
}

TEST_CASE("zero3: a rank killed during an all-gather ends the other within the timeout naming rank and group") {
  const std::string bin = shell_quote(kBin);
  const std::string rec = recipe("z3_kill", "resnet", 6, 2, "zero = 3\n");
  const std::string env =
      kWorkerEnv + "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29967 DTRAIN_FAILPOINTS=zero3.kill_in_gather=1:3 ";
  const std::string o1 = kWork + "/z3_kill.r1.out";
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_cmd(env + "RANK=1 " + bin + " train " + rec + " > " + o1 + " 2>&1 & W1=$!; " + env + "RANK=0 " + bin +
                   " train " + rec + "; echo rc0=$?; wait $W1; echo rc1=$?; cat " + o1);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.all());
  CHECK(r.out.find("rc0=1") != std::string::npos);
  CHECK(r.out.find("rc1=137") != std::string::npos);  // 128 + SIGKILL
  CHECK(secs < 30);  // parallel.timeout_s
  CHECK(r.all().find("allgather") != std::string::npos);
  CHECK(r.all().find("group 'world'") != std::string::npos);
  CHECK(r.all().find("rank 1") != std::string::npos);
  // the checkpoint of step 2 stays the valid latest one
  CHECK(fs::read_file(run_dir("z3_kill") + "/checkpoints/latest") == "step_00000002\n");
  CHECK(CheckpointManager::verify(ckpt("z3_kill", 2)) == "");
}

}  // TEST_SUITE

TEST_SUITE("unit") {

TEST_CASE("zero3: a sharded ParamStore keeps its pieces and resolves parameters through attached windows only") {
  auto be = make_backend("cpu");
  ParamStore ps;
  ps.declare({"emb", Shape{5}, Init::Normal, 0.1f, true});
  const int u = ps.begin_unit("block");
  const int w = ps.declare({"block.w", Shape{2, 3}, Init::Normal, 0.1f, true});
  ps.end_unit();
  ps.set_sharding(1, 2);
  ps.finalize(*be);
  ps.initialize(9);
  ParamStore ref;  // the same model unsharded
  ref.declare({"emb", Shape{5}, Init::Normal, 0.1f, true});
  ref.declare({"block.w", Shape{2, 3}, Init::Normal, 0.1f, true});
  ref.finalize(*be);
  ref.initialize(9);
  REQUIRE(ps.units().size() == 2);
  CHECK(u == 1);
  CHECK(ps.unit_of(w) == 1);
  // rank 1 of 2 owns [3, 5) of "emb" and [8, 11) of "block" (its padding is zero)
  const std::vector<FlatPiece> pieces = ps.shard_pieces();
  REQUIRE(pieces.size() == 2);
  CHECK(pieces[0].global == 3);
  CHECK(pieces[0].count == 2);
  CHECK(pieces[1].global == 8);
  CHECK(pieces[1].count == 3);
  CHECK(ps.shard_params().numel() == 3 + 3);
  std::vector<float> mine(6), all(11);
  be->copy_to_host(mine.data(), ps.shard_params().data, 6 * 4);
  be->copy_to_host(all.data(), ref.flat_params().data, 11 * 4);
  CHECK(mine[0] == all[3]);
  CHECK(mine[1] == all[4]);
  CHECK(mine[2] == 0.f);  // padding of "emb" (5 = 3 + 2 elements)
  CHECK(mine[3] == all[8]);
  CHECK(mine[5] == all[10]);
  // not gathered: a fault naming the parameter and its unit
  try {
    (void)ps.param(w);
    FAIL("param() of an unattached unit");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "ZeRO-3: parameter of 'block.w' used while its unit 'block' is not gathered");
  }
  CHECK_THROWS(ps.flat_params());
  std::vector<float> window(6, 2.f);
  ps.attach_unit(u, window.data(), nullptr, nullptr);
  CHECK(ps.param(w).data == window.data());
  CHECK_THROWS(ps.grad(w));  // attached without gradients (an evaluation)
  ps.detach_unit(u);
  CHECK(!ps.attached(u));
}

}  // TEST_SUITE

// ---- hybrid sharding (parallel.shard_group_size) ----

TEST_SUITE("integration") {

// Then the hybrid checkpoint at step 10 continues on 2 ranks with ZeRO-1, and the 1-process
// checkpoint at step 10 on 4 ranks with hybrid sharding, both as the uninterrupted run.
TEST_CASE("zero3 hybrid: GPT on 4 ranks in 2 shard groups equals 1 process and its checkpoints move both ways") {
  equal_losses_hybrid("gpt", "hy_gpt_ref", "hy_gpt", 29970);
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

// The edge: groups of 1 rank (nothing sharded, everything replicated through ZeRO-3's
// machinery); rank 0 alone writes the one optimizer file, which holds one range per unit.
TEST_CASE("zero3 hybrid: shard groups of 1 equal 1 process and write one optimizer file and model.safetensors") {
  auto a = run_cmd(train(recipe("hy1_ref", "resnet", 6, 6, "") + " --set train.grad_accum=2"));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  auto b = run_cmd(train(recipe("hy1", "resnet", 6, 6, "zero = 3\nshard_group_size = 1\n") +
                         " --nproc-per-node 2 --master-port 29982"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  check_losses("hy1", "hy1_ref", 1, 6);
  check_weights(ckpt("hy1", 6), ckpt("hy1_ref", 6));
  CHECK(entries_with_prefix(ckpt("hy1", 6), "optim-") == std::vector<std::string>{"optim-00000-of-00001.safetensors"});
  CHECK(entries_with_prefix(ckpt("hy1", 6), "model-").empty());  // each rank holds the whole model
  CHECK(stdfs::exists(ckpt("hy1", 6) + "/model.safetensors"));
  CHECK(CheckpointManager::verify(ckpt("hy1", 6)) == "");
}

TEST_CASE("zero3 hybrid: ResNet with BatchNorm on 4 ranks in 2 shard groups gives the losses of 1 process") {
  equal_losses_hybrid("resnet", "hy_resnet_ref", "hy_resnet", 29976);
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
  const std::string worker_env = kWorkerEnv + "RANK=1 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29980 ";
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

// Optimizer shards end to end: with ZeRO every rank writes its own optimizer file, and a
// checkpoint of N ranks resumes on M (4 -> 2, 4 -> 1, 2 -> 1) with the weights of the
// uninterrupted run; a missing shard makes a checkpoint invalid; a rank that cannot write
// its shard fails the checkpoint on every rank. The real binary, Gloo on loopback.
//
// Same global batch on every world size: N ranks with batch B equal one process with
// grad_accum N (test_train_dist*.cpp), so a resume on M ranks uses grad_accum N / M and
// must reproduce the losses (1e-5 relative, as those tests) and the weights of the
// uninterrupted N-rank run.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/fsutil.h"
#include "parallel/zero.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "test_util.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kSrc = DTRAIN_SOURCE_DIR;
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_train_dist_shards";

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string ckpt(const std::string& name, int64_t step) {
  return run_dir(name) + "/checkpoints/" + CheckpointManager::dir_name(step);
}

// ctest runs test cases as parallel processes: shared fixtures are made under a file lock.
struct Lock {
  int fd;
  Lock() {
    stdfs::create_directories(kWork);
    fd = open((kWork + "/.lock").c_str(), O_CREAT | O_RDWR, 0644);
    REQUIRE(fd >= 0);
    flock(fd, LOCK_EX);
  }
  ~Lock() {
    flock(fd, LOCK_UN);
    close(fd);
  }
};

// A few KB of text, byte-tokenized (call under the lock).
std::string tokens() {
  const std::string d = kWork + "/tokens";
  if (!stdfs::exists(d + "/manifest.json")) {
    auto r = run_cmd(kBin + " data tokenize " + kSrc + "/src/session/step.cpp " + kSrc + "/src/session/session.cpp --out " +
                     d + " --tokenizer byte --val-fraction 0.2");
    REQUIRE_MESSAGE(r.code == 0, r.all());
  }
  return d;
}

// kind "gpt" (AdamW: two state buffers) or "resnet" (SGD with momentum, 12x12 synthetic
// images); 4 steps, a checkpoint every 2, all kept. Removes the run directory.
std::string recipe(const std::string& name, const std::string& kind, const std::string& extra) {
  stdfs::create_directories(kWork);
  stdfs::remove_all(run_dir(name));
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 5\ndevice = \"cpu\"\nthreads = 1\n";
  if (kind == "gpt")
    f << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\nvocab_size = 256\n"
      << "[data]\nkind = \"tokens\"\npath = \"" << tokens() << "\"\neval_split = \"val\"\n"
      << "[train]\nbatch_size = 4\nmax_steps = 4\n"
      << "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.01\n"
      << "[schedule]\nkind = \"cosine\"\nwarmup_steps = 2\n";
  else
    f << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
      << "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
      << "[train]\nbatch_size = 8\nmax_steps = 4\n"
      << "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nweight_decay = 5e-4\n";
  f << "[checkpoint]\nevery_steps = 2\nkeep_last = 10\n"
    << "[eval]\nevery_steps = 0\nbatch_size = 4\nmax_batches = 1\n"
    << "[log]\nevery_steps = 1\ntensorboard = false\n"
    << "[parallel]\ntimeout_s = 30\n"
    << extra;
  return path;
}

std::string train(const std::string& args) { return kBin + " train " + args; }

std::vector<nlohmann::json> jsonl(const std::string& path) { return read_jsonl(path); }

// step -> loss of the run's train rows
std::map<int64_t, double> losses(const std::string& name) {
  std::map<int64_t, double> out;
  for (auto& r : jsonl(run_dir(name) + "/metrics.jsonl"))
    if (r["kind"] == "train") out[r["step"].get<int64_t>()] = r["loss"].get<double>();
  return out;
}

std::vector<nlohmann::json> events(const std::string& name, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (auto& r : jsonl(run_dir(name) + "/events.jsonl"))
    if (r.value("event", r.value("kind", "")) == kind) out.push_back(r);
  return out;
}

// Losses of the resumed steps equal the uninterrupted run's (1e-5 relative).
void check_losses(const std::string& resumed, const std::string& ref, int64_t from, int64_t to) {
  auto a = losses(resumed), b = losses(ref);
  for (int64_t s = from; s <= to; ++s) {
    INFO(resumed << " step " << s);
    REQUIRE(a.count(s));
    REQUIRE(b.count(s));
    CHECK(std::isfinite(a[s]));
    CHECK(std::abs(a[s] - b[s]) <= 1e-5 * std::abs(b[s]));
  }
  CHECK(a.size() == size_t(to - from + 1));  // nothing before the resume point was retrained
}

// Every trained tensor of two model.safetensors agrees within 1e-5 of the model's largest
// weight. The scale is the model's, not each tensor's: GPT's attention key biases get a
// gradient that is zero in exact arithmetic (softmax ignores a constant added to a row of
// scores), so they hold only AdamW-normalised rounding noise (~1e-6) that no two summation
// orders share; every other element agrees far closer (~1e-9). BatchNorm running
// statistics are left out: they are rank 0's own (per-rank statistics), so they depend on
// the world size by design and never enter the training losses.
void check_weights(const std::string& dir, const std::string& ref_dir) {
  SafetensorsReader a(dir + "/model.safetensors"), b(ref_dir + "/model.safetensors");
  REQUIRE(a.names() == b.names());
  std::vector<std::pair<std::string, std::vector<float>>> x, y;
  double scale = 0;
  for (const auto& n : b.names()) {
    if (n.find("running_") != std::string::npos || b.dtype(n) != "F32") continue;
    std::vector<float> u(a.nbytes(n) / 4), v(b.nbytes(n) / 4);
    REQUIRE(u.size() == v.size());
    a.read(n, u.data(), u.size() * 4);
    b.read(n, v.data(), v.size() * 4);
    for (float f : v) scale = std::max(scale, double(std::fabs(f)));
    x.emplace_back(n, std::move(u));
    y.emplace_back(n, std::move(v));
  }
  REQUIRE(x.size() > 4);
  double worst_all = 0;
  for (size_t t = 0; t < x.size(); ++t) {
    double worst = 0;
    for (size_t i = 0; i < x[t].second.size(); ++i)
      worst = std::max(worst, double(std::fabs(x[t].second[i] - y[t].second[i])));
    INFO(dir << ": " << x[t].first << " differs by " << worst << " (largest weight " << scale << ")");
    CHECK(worst <= 1e-5 * scale);
    worst_all = std::max(worst_all, worst);
  }
  MESSAGE(fs::base_name(fs::parent_dir(fs::parent_dir(dir))) << ": weights within " << worst_all / scale
                                                            << " of the largest weight of the uninterrupted run");
}

// A new run directory `name` holding only `from`'s recipe and its checkpoints at `steps`,
// `latest` naming the last: what a run stopped there looks like.
std::string copy_run(const std::string& from, const std::string& name, const std::vector<int64_t>& steps) {
  const std::string rd = run_dir(name);
  stdfs::remove_all(rd);
  stdfs::create_directories(rd + "/checkpoints");
  stdfs::copy_file(run_dir(from) + "/config.toml", rd + "/config.toml");
  for (int64_t s : steps) stdfs::copy(ckpt(from, s), rd + "/checkpoints/" + CheckpointManager::dir_name(s));
  fs::write_file(rd + "/checkpoints/latest", CheckpointManager::dir_name(steps.back()) + "\n");
  return rd;
}

std::vector<std::string> optim_files(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& e : stdfs::directory_iterator(dir)) {
    std::string n = e.path().filename().string();
    if (n.rfind("optim-", 0) == 0) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The uninterrupted reference: GPT with AdamW on 4 ranks, ZeRO-1, made once per binary
// (the stamp holds the binary's modification time) and shared by the test cases below.
const std::string kRef4 = "z1_ref4";
void ensure_ref4() {
  Lock lock;
  const std::string stamp_path = kWork + "/" + kRef4 + ".stamp";
  const std::string stamp = std::to_string(stdfs::last_write_time(kBin).time_since_epoch().count());
  if (stdfs::exists(stamp_path) && fs::read_file(stamp_path) == stamp && stdfs::exists(ckpt(kRef4, 4))) return;
  stdfs::remove(stamp_path);
  auto r = run_cmd(train(recipe(kRef4, "gpt", "zero = 1\n") + " --nproc-per-node 4 --master-port 29851"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  fs::write_file(stamp_path, stamp);
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("dist: a 4-rank ZeRO-1 run writes one optimizer shard per rank and dtrain inspect lists them") {
  ensure_ref4();
  const std::string d = ckpt(kRef4, 2);
  const std::vector<std::string> want = {"optim-00000-of-00004.safetensors", "optim-00001-of-00004.safetensors",
                                         "optim-00002-of-00004.safetensors", "optim-00003-of-00004.safetensors"};
  CHECK(optim_files(d) == want);
  auto st = nlohmann::json::parse(fs::read_file(d + "/state.json"));
  CHECK(st["world_size"] == 4);
  CHECK(st["optimizer"]["shards"] == 4);
  CHECK(st["optimizer"]["kind"] == "adamw");
  const int64_t total = st["model"]["num_params"].get<int64_t>();
  // each file: exactly its rank's ZeRO range of exp_avg and exp_avg_sq
  for (int r = 0; r < 4; ++r) {
    SafetensorsReader f(d + "/" + want[size_t(r)]);
    const FlatRange fr = parallel::shard_range(total, r, 4);
    const auto& m = f.metadata();
    CHECK(m.at("shard_index") == std::to_string(r));
    CHECK(m.at("shard_count") == "4");
    CHECK(m.at("range_begin") == std::to_string(fr.begin));
    CHECK(m.at("range_end") == std::to_string(fr.end));
    CHECK(m.at("num_params") == std::to_string(total));
    CHECK(m.at("optimizer") == "adamw");
    CHECK(m.at("param_layout").size() == 64);
    CHECK(f.shape("exp_avg") == std::vector<int64_t>{fr.end - fr.begin});
    CHECK(f.shape("exp_avg_sq") == std::vector<int64_t>{fr.end - fr.begin});
    CHECK(f.dtype("step") == "I64");
  }
  CHECK(CheckpointManager::verify(d) == "");
  // the real `safetensors` reader opens every shard; its ranges tile [0, num_params)
  test_util::TmpDir tmp;
  const std::string py = test_util::run_python(tmp.path, R"(
import glob, sys
from safetensors import safe_open
files = sorted(glob.glob(")" + d + R"(/optim-*-of-00004.safetensors"))
assert len(files) == 4, files
end = 0
for i, f in enumerate(files):
    with safe_open(f, framework="numpy") as g:
        m = g.metadata()
        assert int(m["shard_index"]) == i and int(m["range_begin"]) == end, (f, m)
        n = g.get_tensor("exp_avg").shape[0]
        assert g.get_tensor("exp_avg_sq").shape[0] == n
        end += n
        assert end == int(m["range_end"])
print("tiled", end, m["num_params"])
)");
  CHECK_MESSAGE(py.find("tiled " + std::to_string(total) + " " + std::to_string(total)) != std::string::npos, py);
  auto in = run_cmd(kBin + " inspect " + d);
  REQUIRE_MESSAGE(in.code == 0, in.all());
  for (const auto& f : want) CHECK_MESSAGE(in.out.find(f + ": adamw shard") != std::string::npos, in.out);
}

TEST_CASE("dist: a 4-rank ZeRO-1 checkpoint resumes on 2 ranks with the weights of the uninterrupted run") {
  ensure_ref4();
  const std::string rd = copy_run(kRef4, "z1_4to2", {2});
  auto r = run_cmd(train("--resume " + rd + " --nproc-per-node 2 --master-port 29853 --set train.grad_accum=2"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  auto res = events("z1_4to2", "resume");
  REQUIRE(res.size() == 1);
  CHECK(res[0]["step"] == 2);
  check_losses("z1_4to2", kRef4, 3, 4);
  check_weights(ckpt("z1_4to2", 4), ckpt(kRef4, 4));
  // the new checkpoint is sharded for the new world size
  CHECK(optim_files(ckpt("z1_4to2", 4)) ==
        std::vector<std::string>{"optim-00000-of-00002.safetensors", "optim-00001-of-00002.safetensors"});
}

TEST_CASE("dist: a 4-rank ZeRO-1 checkpoint resumes on 1 rank with the weights of the uninterrupted run") {
  ensure_ref4();
  const std::string rd = copy_run(kRef4, "z1_4to1", {2});
  auto r = run_cmd(train("--resume " + rd + " --set train.grad_accum=4"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  CHECK(events("z1_4to1", "resume").size() == 1);
  check_losses("z1_4to1", kRef4, 3, 4);
  check_weights(ckpt("z1_4to1", 4), ckpt(kRef4, 4));
  CHECK(optim_files(ckpt("z1_4to1", 4)) == std::vector<std::string>{"optim-00000-of-00001.safetensors"});
}

// Nothing but the process count changed: the layout derives the accumulation that keeps the
// checkpoint's global batch, says so, and the run continues as the uninterrupted one; a world
// that no whole accumulation fits exits 2 naming the keys.
TEST_CASE("dist: a 4-rank checkpoint resumed on 2 ranks with only --nproc-per-node changed keeps the global batch") {
  ensure_ref4();
  const std::string rd = copy_run(kRef4, "gb_4to2", {2});
  auto r = run_cmd(train("--resume " + rd + " --nproc-per-node 2 --master-port 29393"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  CHECK_MESSAGE(r.all().find("train.grad_accum = 2 (was 1): the checkpoint's global batch of") != std::string::npos,
                r.all());
  check_losses("gb_4to2", kRef4, 3, 4);
  check_weights(ckpt("gb_4to2", 4), ckpt(kRef4, 4));
  const std::string rd3 = copy_run(kRef4, "gb_4to3", {2});
  auto bad = run_cmd(train("--resume " + rd3 + " --nproc-per-node 3 --master-port 29395"));
  CHECK(bad.code == 2);
  CHECK_MESSAGE(bad.err.find("x 3 data ranks cannot make a global batch of") != std::string::npos, bad.all());
}

TEST_CASE("dist: a checkpoint missing one optimizer shard is skipped for the previous one naming the file") {
  ensure_ref4();
  const std::string rd = copy_run(kRef4, "z1_missing", {2, 4});
  stdfs::remove(ckpt("z1_missing", 4) + "/optim-00002-of-00004.safetensors");
  CHECK(CheckpointManager::verify(ckpt("z1_missing", 4)) == "optim-00002-of-00004.safetensors: missing");
  auto r = run_cmd(train("--resume " + rd + " --nproc-per-node 2 --master-port 29855 --set train.grad_accum=2"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  const std::string note = "checkpoints/step_00000004: optim-00002-of-00004.safetensors: missing; falling back to step_00000002";
  CHECK_MESSAGE(r.all().find(note) != std::string::npos, r.all());
  auto inv = events("z1_missing", "checkpoint_invalid");
  REQUIRE(inv.size() == 1);
  CHECK(inv[0]["note"] == note);
  auto res = events("z1_missing", "resume");
  REQUIRE(res.size() == 1);
  CHECK(res[0]["step"] == 2);
  // steps 3 and 4 trained again from step 2: the same weights as the uninterrupted run
  check_weights(ckpt("z1_missing", 4), ckpt(kRef4, 4));
  CHECK(CheckpointManager::verify(ckpt("z1_missing", 4)) == "");
}

TEST_CASE("dist: a 2-rank ZeRO-2 checkpoint resumes on 1 rank with the weights of the uninterrupted run") {
  auto ref = run_cmd(train(recipe("z2_ref2", "resnet", "zero = 2\n") + " --nproc-per-node 2 --master-port 29857"));
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  CHECK(optim_files(ckpt("z2_ref2", 2)) ==
        std::vector<std::string>{"optim-00000-of-00002.safetensors", "optim-00001-of-00002.safetensors"});
  const std::string rd = copy_run("z2_ref2", "z2_2to1", {2});
  auto r = run_cmd(train("--resume " + rd + " --set train.grad_accum=2"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  check_losses("z2_2to1", "z2_ref2", 3, 4);
  check_weights(ckpt("z2_2to1", 4), ckpt("z2_ref2", 4));
  // the state of another optimizer is a user error naming the files
  auto bad = run_cmd(train("--resume " + rd + " --set optim.name=adamw --set train.max_steps=6"));
  CHECK(bad.code == 2);
  CHECK_MESSAGE(bad.err.find("/checkpoints/step_00000004/optim-*-of-00001.safetensors: optimizer state of 'sgd' but "
                             "the recipe uses optim.name = \"adamw\"") != std::string::npos,
                bad.all());
}

TEST_CASE("dist: a rank that cannot write its optimizer shard fails the checkpoint on every rank") {
  const std::string name = "z1_fail";
  const std::string rec = recipe(name, "resnet", "zero = 1\n");
  // rank 1's write of the step-4 checkpoint fails (a directory is where its file should go)
  auto r = run_cmd("DTRAIN_FAILPOINTS=checkpoint.write_fail=1:4 " + train(rec + " --nproc-per-node 2 --master-port 29859"));
  INFO(r.all());
  CHECK(r.code == 1);
  const std::string msg = "checkpoint step_00000004 failed: rank 1 could not write optim-00001-of-00002.safetensors: ";
  CHECK(r.all().find(msg) != std::string::npos);
  // every rank fails with the same line (rank 0 and rank 1 both print it)
  size_t seen = 0;
  for (size_t at = r.all().find(msg); at != std::string::npos; at = r.all().find(msg, at + 1)) ++seen;
  CHECK(seen == 2);
  auto failed = events(name, "checkpoint_failed");
  REQUIRE(failed.size() == 1);
  CHECK(failed[0]["error"].get<std::string>().find(msg) == 0);
  // the previous checkpoint is untouched and still the latest; nothing of step 4 is left
  CHECK(fs::read_file(run_dir(name) + "/checkpoints/latest") == "step_00000002\n");
  CHECK(CheckpointManager::verify(ckpt(name, 2)) == "");
  for (auto& e : stdfs::directory_iterator(run_dir(name) + "/checkpoints")) {
    const std::string n = e.path().filename().string();
    CHECK_MESSAGE((n == "latest" || n == "step_00000002"), n);
  }
}

}  // TEST_SUITE

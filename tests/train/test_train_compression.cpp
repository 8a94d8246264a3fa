// parallel.grad_compression end to end: the real binary, 2 worker processes on CPU with Gloo,
// a tiny ResNet on a slice of Fashion-MNIST (one thread per rank).
//  * bf16, fp16 and powersgd runs train (finite losses that fall), report each step's
//    gradient bytes in metrics.jsonl (comm_bytes) and the totals in run_end;
//  * bf16/fp16 send half of "none"'s bytes; powersgd sends "none"'s bytes during its warm-up
//    (parallel.powersgd_start_step) and far fewer after, and a resumed run continues after
//    the warm-up bit for bit (the step count, and each rank's E and Q, are in the checkpoint;
//    with other gradient buckets they start again, with a warning);
//  * combinations it does not support exit 2 naming the keys.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fmnist_fixture.h"
#include "run_cmd.h"
#include "run_readers.h"

namespace stdfs = std::filesystem;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_train_compression";

std::string recipe(const std::string& name, const std::string& parallel, int steps = 10) {
  stdfs::create_directories(kWork);
  stdfs::remove_all(kWork + "/runs/" + name);
  std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 7\ndevice = \"cpu\"\nthreads = 1\n"
    << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 8\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
    << "[data]\npath = \"" << fmnist_slice() << "\"\nmean = [0.286]\nstd = [0.353]\nworkers = 1\n"
    << "[train]\nbatch_size = 16\nmax_steps = " << steps << "\n"
    << "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n"
    << "[checkpoint]\nevery_steps = 5\nkeep_last = 5\n"
    << "[eval]\nevery_steps = 0\nbatch_size = 100\nmax_batches = 1\n"
    << "[log]\nevery_steps = 1\n"
    << "[parallel]\ntimeout_s = 30\n"
    << parallel;
  return path;
}

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }

CmdResult train2(const std::string& rec, int port, const std::string& extra = "") {
  return run_cmd(kBin + " train " + rec + " --nproc-per-node 2 --master-port " + std::to_string(port) + " " + extra);
}

std::vector<uint64_t> step_bytes(const std::string& name) {
  std::vector<uint64_t> out;
  for (auto& r : metric_rows(run_dir(name), "train")) out.push_back(r.value("comm_bytes", uint64_t(0)));
  return out;
}

nlohmann::json run_end(const std::string& name) { return last_event(run_dir(name), "run_end"); }

void check_trains(const std::string& name) {
  INFO(name);
  const auto l = train_losses(run_dir(name));
  REQUIRE(l.size() == 10);
  for (double x : l) CHECK(std::isfinite(x));
  const double first = (l[0] + l[1]) / 2, last = (l[8] + l[9]) / 2;
  CHECK_MESSAGE(last < first, "loss " << first << " -> " << last);
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("compression: bf16 fp16 and powersgd train on 2 ranks and send the expected share of the bytes") {
  auto none = train2(recipe("gc_none", ""), 29721);
  REQUIRE_MESSAGE(none.code == 0, none.all());
  auto bf16 = train2(recipe("gc_bf16", "grad_compression = \"bf16\"\n"), 29722);
  REQUIRE_MESSAGE(bf16.code == 0, bf16.all());
  auto fp16 = train2(recipe("gc_fp16", "grad_compression = \"fp16\"\n"), 29723);
  REQUIRE_MESSAGE(fp16.code == 0, fp16.all());
  auto psgd = train2(recipe("gc_psgd", "grad_compression = \"powersgd\"\npowersgd_rank = 2\npowersgd_start_step = 3\n"),
                     29724);
  REQUIRE_MESSAGE(psgd.code == 0, psgd.all());
  for (auto n : {"gc_none", "gc_bf16", "gc_fp16", "gc_psgd"}) check_trains(n);

  const auto bn = step_bytes("gc_none"), bb = step_bytes("gc_bf16"), bf = step_bytes("gc_fp16"),
             bp = step_bytes("gc_psgd");
  REQUIRE(bn.size() == 10);
  REQUIRE(bb.size() == 10);
  REQUIRE(bp.size() == 10);
  const uint64_t full = bn[0];
  CHECK(full > 0);
  for (size_t i = 0; i < 10; ++i) {
    INFO("step " << i + 1);
    CHECK(bn[i] == full);
    // 16 bits: half, up to the ring's padding of each bucket to 2 x ceil(n/2) elements
    CHECK(bb[i] * 2 >= full);
    CHECK(double(bb[i]) / double(full) == doctest::Approx(0.5).epsilon(0.001));
    CHECK(bf[i] == bb[i]);
    if (i < 3) CHECK(bp[i] == full);  // the warm-up: plain f32 all-reduces
    else CHECK(bp[i] * 3 < full);     // rank 2: P and Q plus the vectors
  }
  // run_end: the gradient bytes of every step, and every collective by kind
  const auto end = run_end("gc_bf16");
  REQUIRE(end.contains("comm_bytes"));
  uint64_t sum = 0;
  for (auto b : bb) sum += b;
  CHECK(end["comm_bytes"]["gradients"].get<uint64_t>() == sum);
  CHECK(end["comm_bytes"]["grad_compression"] == "bf16");
  CHECK(end["comm_bytes"]["allreduce"].get<uint64_t>() >= sum);
  CHECK(end["comm_bytes"]["broadcast"].get<uint64_t>() > 0);  // the parameters from rank 0
}

TEST_CASE("compression: a resumed PowerSGD run continues bit for bit after its warm-up") {
  // 10 steps, checkpoint at 5, warm-up 3: the resumed steps 6-10 are compressed at once
  const std::string par = "grad_compression = \"powersgd\"\npowersgd_rank = 2\npowersgd_start_step = 3\n";
  auto full = train2(recipe("gc_resume_ref", par), 29725);
  REQUIRE_MESSAGE(full.code == 0, full.all());
  auto first = train2(recipe("gc_resume", par), 29726, "--set train.max_steps=5");
  REQUIRE_MESSAGE(first.code == 0, first.all());
  auto again = run_cmd(kBin + " train --resume " + run_dir("gc_resume") +
                       " --nproc-per-node 2 --master-port 29727 --set train.max_steps=10");
  REQUIRE_MESSAGE(again.code == 0, again.all());
  const auto ref = step_bytes("gc_resume_ref"), got = step_bytes("gc_resume");
  REQUIRE(ref.size() == 10);
  REQUIRE(got.size() == 10);
  for (size_t i = 0; i < 10; ++i) {
    INFO("step " << i + 1);
    CHECK(got[i] == ref[i]);
  }
  const auto l = train_losses(run_dir("gc_resume"));
  for (double x : l) CHECK(std::isfinite(x));
  // each rank's error feedback and Q are in the checkpoint, so the resumed steps are the
  // uninterrupted run's, bit for bit
  const std::string ck = run_dir("gc_resume") + "/checkpoints/step_00000005";
  CHECK(stdfs::exists(ck + "/powersgd-00000-of-00002.safetensors"));
  CHECK(stdfs::exists(ck + "/powersgd-00001-of-00002.safetensors"));
  CHECK(l == train_losses(run_dir("gc_resume_ref")));
  CHECK(again.all().find("start again") == std::string::npos);
  // resumed with other gradient buckets, the state does not fit: it starts again, with a warning
  stdfs::remove_all(run_dir("gc_resume_b"));
  stdfs::create_directories(run_dir("gc_resume_b"));
  stdfs::copy(run_dir("gc_resume"), run_dir("gc_resume_b"), stdfs::copy_options::recursive);
  const std::string back = run_dir("gc_resume_b") + "/checkpoints";
  for (const char* step : {"step_00000010"}) stdfs::remove_all(back + "/" + step);
  std::ofstream(back + "/latest") << "step_00000005";
  auto other = run_cmd(kBin + " train --resume " + run_dir("gc_resume_b") +
                       " --nproc-per-node 2 --master-port 29729 --set train.max_steps=10 --set parallel.bucket_mb=0.001");
  REQUIRE_MESSAGE(other.code == 0, other.all());
  CHECK_MESSAGE(other.all().find("PowerSGD's error feedback and Q start again") != std::string::npos, other.all());
  CHECK_MESSAGE(other.all().find("does not fit this run's gradient buckets") != std::string::npos, other.all());
}

TEST_CASE("compression: refused with ZeRO-2 ZeRO-3 tensor or pipeline parallelism fp16 and a rank below 1 (exit 2)") {
  struct Case {
    std::string parallel, extra, want;
  };
  const std::vector<Case> cases = {
      {"grad_compression = \"bf16\"\nzero = 2\n", "", "parallel.zero = 2"},
      {"grad_compression = \"powersgd\"\nzero = 3\n", "", "parallel.zero = 3"},
      {"grad_compression = \"fp16\"\ntensor = 2\n", "", "parallel.tensor = 2"},
      {"grad_compression = \"bf16\"\npipeline = 2\n", "", "parallel.pipeline = 2"},
      {"grad_compression = \"powersgd\"\n", "[precision]\ndtype = \"fp16\"\n", "precision.dtype"},
      {"grad_compression = \"powersgd\"\npowersgd_rank = 0\n", "", "parallel.powersgd_rank"},
      {"grad_compression = \"int8\"\n", "", "parallel.grad_compression"},
  };
  for (const auto& c : cases) {
    auto r = run_cmd(kBin + " train " + recipe("gc_refused", c.parallel + c.extra) + " --nproc-per-node 2 --master-port 29728");
    INFO(c.parallel << c.extra << r.all());
    CHECK(r.code == 2);
    CHECK(r.err.find(c.want) != std::string::npos);
    CHECK(!stdfs::exists(run_dir("gc_refused") + "/metrics.jsonl"));
  }
}

}  // TEST_SUITE

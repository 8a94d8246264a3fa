// Static memory (DESIGN principle 4): after the first steps have planned the arena and the
// backend's workspaces, training steps and evaluations allocate nothing. Counted with
// Backend::alloc_counts(): alloc()/free() through the interface, the backend's own
// workspace/scratch (re)allocations and plans, and the system allocations under them
// (CUDA: cudaMalloc/cudaFree). The tiny recipe of each model family is trained in-process
// on real data; data parallelism on 2 CPU ranks (threads, Gloo) with DDP and ZeRO-2. The
// CUDA cases are labelled gpu and skip visibly without a device.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <filesystem>
#include <sstream>
#include <thread>
#include <vector>

#include "skip.h"
#include "comm/gloo_comm.h"
#include "comm/store.h"
#include "fmnist_fixture.h"
#include "run_cmd.h"
#include "session/dist_setup.h"
#include "session/step.h"

using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kSrc = DTRAIN_SOURCE_DIR;
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_steady_memory";

// Runs `make` once per data directory, under a lock (ctest runs test cases in parallel).
std::string prepare_once(const std::string& dir, const std::string& make) {
  std::filesystem::create_directories(kWork);
  int fd = open((kWork + "/.lock").c_str(), O_CREAT | O_RDWR, 0644);
  REQUIRE(fd >= 0);
  flock(fd, LOCK_EX);
  if (!std::filesystem::exists(dir + "/manifest.json")) {
    auto r = run_cmd(make);
    CHECK_MESSAGE(r.code == 0, r.all());
  }
  flock(fd, LOCK_UN);
  close(fd);
  return dir;
}

std::string tokens() {
  const std::string d = kWork + "/tokens";
  return prepare_once(d, kBin + " data tokenize " + kSrc + "/src/session/step.cpp " + kSrc +
                             "/src/session/session.cpp --out " + d + " --tokenizer byte --val-fraction 0.2");
}

std::string shapes() {
  const std::string d = kWork + "/shapes";
  return prepare_once(d, kBin + " data shapes --out " + d + " --count 48 --size 16 --classes 3 --val-fraction 0.25");
}

std::string str(const AllocCounts& c) {
  std::ostringstream o;
  o << "{allocs " << c.allocs << ", frees " << c.frees << ", internal " << c.internal << ", system allocs "
    << c.system_allocs << ", system frees " << c.system_frees << "}";
  return o.str();
}

// Trains configs/<recipe> on `data` in-process: 2 steps and an evaluation plan the memory;
// then 3 steps, an evaluation and 2 more steps must leave every counter where it was.
void check_steady_state(const std::string& recipe, const std::string& data, const std::string& device) {
  Config cfg = Config::load(kSrc + "/configs/" + recipe,
                            {"data.path=\"" + data + "\"", "run.device=\"" + device + "\"", "run.threads=1"});
  auto s = make_session(cfg, SessionOptions{});
  REQUIRE(s->be->device().str().rfind(device, 0) == 0);
  int64_t step = 0;
  auto train = [&](int n) {
    for (int i = 0; i < n; ++i, ++step) {
      StepStats st = train_step(*s, step, s->schedule->lr(step));
      REQUIRE(std::isfinite(st.loss));
    }
  };
  const AllocCounts built = s->be->alloc_counts();
  train(1);
  const AllocCounts first = s->be->alloc_counts();
  // the counter sees the first step's planning (the arena's blocks at least)
  CHECK_MESSAGE(first.allocs > built.allocs, str(built) << " -> " << str(first));
  train(1);
  EvalStats ev = evaluate(*s);
  REQUIRE(ev.samples > 0);
  const AllocCounts warm = s->be->alloc_counts();
  const int64_t arena_warm = s->arena->device_allocations();
  train(3);
  ev = evaluate(*s);
  REQUIRE(ev.samples > 0);
  train(2);
  const AllocCounts end = s->be->alloc_counts();
  INFO(recipe << " on " << device << ": after warm-up " << str(warm) << ", after 5 more steps and an evaluation "
              << str(end));
  CHECK(end == warm);
  CHECK(s->arena->device_allocations() == arena_warm);
}

// 2 ranks as threads (each its own CPU session, store client and Gloo communicator) train a
// synthetic ResNet with clipping, gathering the rank stats after every step as the trainer
// does at log steps. Returns nothing; fails the test from the threads' results.
void check_steady_state_dist(int zero) {
  const int W = 2;
  comm::StoreServer server("127.0.0.1", 0, "steady-memory");
  std::vector<AllocCounts> warm(W), end(W);
  std::vector<std::exception_ptr> errs(W);
  std::vector<std::thread> th;
  for (int r = 0; r < W; ++r)
    th.emplace_back([&, r] {
      try {
        std::string text = R"(
[run]
seed = 5
device = "cpu"
threads = 1
[model]
kind = "resnet"
depth = 8
width = 4
stem = "cifar"
in_channels = 1
num_classes = 10
[data]
kind = "synthetic"
synthetic_height = 12
synthetic_width = 12
[train]
batch_size = 4
max_steps = 10
clip_grad_norm = 0.5
[optim]
name = "adamw"
lr = 0.001
[parallel]
zero = )" + std::to_string(zero) + "\n";
        Config cfg = Config::parse(text, "steady_memory_dist.toml");
        SessionOptions so;
        so.rank = r;
        so.world_size = W;
        so.shard_optimizer = zero > 0;
        auto s = make_session(cfg, so);
        DistRuntime d;  // after the session: destroyed before it
        d.env.rank = r;
        d.env.world_size = W;
        d.zero_stage = zero;
        d.store = std::make_unique<comm::StoreClient>("127.0.0.1", server.port(), "steady-memory",
                                                      std::chrono::milliseconds(20000));
        comm::GlooOptions o;
        o.timeout_s = 30;
        d.comm = std::make_unique<comm::GlooCommunicator>(*d.store, r, W, o);
        attach(d, *s, /*bucket_mb=*/0.002);  // several buckets
        int64_t step = 0;
        auto train = [&](int n) {
          for (int i = 0; i < n; ++i, ++step) {
            StepStats st = train_step(*s, step, 0.001, d.dp.get());
            if (!std::isfinite(st.loss) || st.grad_norm < 0) throw std::runtime_error("bad step stats");
            gather_rank_stats(d, *s->be, {st.t.total_s, double(st.local_samples)});
          }
        };
        train(2);
        warm[size_t(r)] = s->be->alloc_counts();
        train(4);
        end[size_t(r)] = s->be->alloc_counts();
      } catch (...) {
        errs[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : th) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
  for (int r = 0; r < W; ++r) {
    INFO("zero " << zero << " rank " << r << ": after warm-up " << str(warm[size_t(r)]) << ", after 4 more steps "
                 << str(end[size_t(r)]));
    CHECK(warm[size_t(r)].allocs > 0);
    CHECK(end[size_t(r)] == warm[size_t(r)]);
  }
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("steady state on cpu: tiny ResNet steps and evaluations allocate nothing") {
    check_steady_state("tiny_resnet.toml", fmnist_slice(), "cpu");
  }
  TEST_CASE("steady state on cpu: tiny GPT steps and evaluations allocate nothing") {
    check_steady_state("tiny_gpt.toml", tokens(), "cpu");
  }
  TEST_CASE("steady state on cpu: tiny U-Net steps and evaluations allocate nothing") {
    check_steady_state("tiny_unet.toml", shapes(), "cpu");
  }
  TEST_CASE("steady state on 2 cpu ranks: DDP steps with clipping and rank stats allocate nothing") {
    check_steady_state_dist(0);
  }
  TEST_CASE("steady state on 2 cpu ranks: ZeRO-2 steps with clipping and rank stats allocate nothing") {
    check_steady_state_dist(2);
  }
}

TEST_SUITE("gpu") {
  TEST_CASE("steady state on cuda: tiny ResNet steps and evaluations call no cudaMalloc") {
    GPU_OR_SKIP();
    check_steady_state("tiny_resnet.toml", fmnist_slice(), "cuda");
  }
  TEST_CASE("steady state on cuda: tiny GPT steps and evaluations call no cudaMalloc") {
    GPU_OR_SKIP();
    check_steady_state("tiny_gpt.toml", tokens(), "cuda");
  }
  TEST_CASE("steady state on cuda: tiny U-Net steps and evaluations call no cudaMalloc") {
    GPU_OR_SKIP();
    check_steady_state("tiny_unet.toml", shapes(), "cuda");
  }
}

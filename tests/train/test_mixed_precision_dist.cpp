// Mixed precision with data parallelism: 2 ranks in bf16 (DDP, ZeRO-3) and fp16 (ZeRO-2,
// ZeRO-3) against one process with gradient accumulation, and an fp16 overflow in one rank's
// ZeRO-2 / ZeRO-3 gradient shard (every rank must skip that step).
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>

#include "train_fixtures.h"

TEST_SUITE("integration") {

TEST_CASE("mixed precision: 2 ranks in bf16 (DDP) and fp16 (ZeRO-2) give the losses of 1 process with grad_accum 2") {
  // Synthetic GPT batches are drawn per (micro * world + rank), so 2 ranks compute exactly
  // the micro-batches of one process with grad_accum 2, in the same 16-bit arithmetic; only
  // the f32 summation of the two halves of the gradient differs (all-reduce vs accumulate).
  auto gpt_recipe = [&](const std::string& name, const std::string& dtype) {
    stdfs::create_directories(kWork);
    const std::string path = kWork + "/" + name + ".toml";
    std::ofstream f(path);
    f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 3\ndevice = \"cpu\"\nthreads = 1\n"
      << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 16\nvocab_size = 96\n"
      << "[data]\nkind = \"synthetic\"\n[train]\nbatch_size = 4\nmax_steps = 6\n[optim]\nname = \"adamw\"\nlr = 1e-3\n"
      << "[log]\nevery_steps = 1\n[parallel]\ntimeout_s = 20\n[precision]\ndtype = \"" << dtype << "\"\n";
    return path;
  };
  for (const char* n : {"mpd_ref16b", "mpd_ddp16b", "mpd_ref16", "mpd_z2_16"}) clean(n);
  auto r1 = run_cmd(kBin + " train " + gpt_recipe("mpd_ref16b", "bf16") + " --set train.grad_accum=2");
  REQUIRE_MESSAGE(r1.code == 0, r1.all());
  auto r2 = run_cmd(kBin + " train " + gpt_recipe("mpd_ddp16b", "bf16") + " --nproc-per-node 2 --master-port 29681");
  REQUIRE_MESSAGE(r2.code == 0, r2.all());
  auto r3 = run_cmd(kBin + " train " + gpt_recipe("mpd_ref16", "fp16") + " --set train.grad_accum=2");
  REQUIRE_MESSAGE(r3.code == 0, r3.all());
  auto r4 = run_cmd(kBin + " train " + gpt_recipe("mpd_z2_16", "fp16") +
                    " --set parallel.zero=2 --nproc-per-node 2 --master-port 29682");
  REQUIRE_MESSAGE(r4.code == 0, r4.all());
  auto check_close = [](const std::vector<double>& a, const std::vector<double>& b) {
    REQUIRE(a.size() == 6);
    REQUIRE(b.size() == 6);
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("step " << i + 1 << ": " << a[i] << " vs " << b[i]);
      CHECK(std::abs(a[i] - b[i]) <= 1e-5 * std::abs(b[i]));
    }
  };
  check_close(losses("mpd_ddp16b"), losses("mpd_ref16b"));
  check_close(losses("mpd_z2_16"), losses("mpd_ref16"));
  // ZeRO-3: each unit gathered from the f32 master shards and cast, gradients reduce-scattered
  for (const char* n : {"mpd_z3_16b", "mpd_z3_16"}) clean(n);
  auto r5 = run_cmd(kBin + " train " + gpt_recipe("mpd_z3_16b", "bf16") +
                    " --set parallel.zero=3 --nproc-per-node 2 --master-port 29684");
  REQUIRE_MESSAGE(r5.code == 0, r5.all());
  auto r6 = run_cmd(kBin + " train " + gpt_recipe("mpd_z3_16", "fp16") +
                    " --set parallel.zero=3 --nproc-per-node 2 --master-port 29685");
  REQUIRE_MESSAGE(r6.code == 0, r6.all());
  check_close(losses("mpd_z3_16b"), losses("mpd_ref16b"));
  check_close(losses("mpd_z3_16"), losses("mpd_ref16"));
  // and the precisions are really different computations
  CHECK(losses("mpd_ref16b") != losses("mpd_ref16"));
}

TEST_CASE("mixed precision: an fp16 overflow in one ZeRO-2 rank's gradient shard skips the step on every rank") {
  // Under ZeRO-2 each rank checks only its own reduced shard for inf/nan; the step's flags
  // all-reduce must carry that verdict to every rank, or the rank that overflowed skips the
  // update while the others all-gather (mismatched collectives, diverging replicas). The
  // failpoint puts an inf into rank 1's shard at step 3; the reference is one process with
  // grad_accum 2 and the same inf at step 3.
  auto recipe = [&](const std::string& name) {
    stdfs::create_directories(kWork);
    const std::string path = kWork + "/" + name + ".toml";
    std::ofstream f(path);
    f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 3\ndevice = \"cpu\"\nthreads = 1\n"
      << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 16\nvocab_size = 96\n"
      << "[data]\nkind = \"synthetic\"\n[train]\nbatch_size = 4\nmax_steps = 6\n[optim]\nname = \"adamw\"\nlr = 1e-3\n"
      << "[log]\nevery_steps = 1\n[parallel]\ntimeout_s = 20\n[precision]\ndtype = \"fp16\"\nloss_scale = 256.0\n";
    return path;
  };
  for (const char* n : {"ovf_ref", "ovf_z2", "ovf_z3"}) clean(n);
  auto ref = run_cmd("DTRAIN_FAILPOINTS=step.grad_overflow=0:3 " + kBin + " train " + recipe("ovf_ref") +
                     " --set train.grad_accum=2");
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  auto z2 = run_cmd("DTRAIN_FAILPOINTS=step.grad_overflow=1:3 " + kBin + " train " + recipe("ovf_z2") +
                    " --set parallel.zero=2 --nproc-per-node 2 --master-port 29683");
  REQUIRE_MESSAGE(z2.code == 0, z2.all());  // no hang, and the replicas end equal (checked at the end)
  // ZeRO-3: the inf in rank 1's gradient shard
  auto z3 = run_cmd("DTRAIN_FAILPOINTS=step.grad_overflow=1:3 " + kBin + " train " + recipe("ovf_z3") +
                    " --set parallel.zero=3 --nproc-per-node 2 --master-port 29686");
  REQUIRE_MESSAGE(z3.code == 0, z3.all());
  // every rank skipped step 3 and halved its scale
  const std::string out = z2.all();
  const std::string skip = "step 3: fp16 gradients overflowed (inf/nan): update skipped, loss scale 256 -> 128";
  size_t n = 0;
  for (size_t at = out.find(skip); at != std::string::npos; at = out.find(skip, at + 1)) ++n;
  CHECK_MESSAGE(n == 2, out);
  CHECK(out.find("[rank 1] ") != std::string::npos);
  // rank 0's metrics: the scale halves at step 3 and one step is counted as skipped
  for (const char* run : {"ovf_ref", "ovf_z2", "ovf_z3"}) {
    const auto rows = read_jsonl(run_dir(run) + "/metrics.jsonl");
    std::vector<double> scale;
    int64_t skipped = -1;
    for (const auto& r : rows)
      if (r.value("kind", "") == "train") {
        scale.push_back(r.at("loss_scale").get<double>());
        skipped = r.at("skipped_steps").get<int64_t>();
      }
    REQUIRE(scale.size() == 6);
    CHECK(scale[1] == 256.0);
    CHECK(scale[2] == 128.0);
    CHECK(skipped == 1);
  }
  for (const char* run : {"ovf_z2", "ovf_z3"}) {
    const auto a = losses(run), b = losses("ovf_ref");
    REQUIRE(a.size() == 6);
    REQUIRE(b.size() == 6);
    for (size_t i = 0; i < a.size(); ++i) {
      INFO(run << " step " << i + 1 << ": " << a[i] << " vs " << b[i]);
      CHECK(std::abs(a[i] - b[i]) <= 1e-5 * std::abs(b[i]));
    }
  }
}
}  // TEST_SUITE integration

// parallel.offload = "optimizer" (ZeRO-Offload: optimizer state and f32 master weights in host
// memory, the update on the host in pipelined chunks) end to end on the CPU with the real binary:
//  * the losses, final weights and optimizer state are BIT-identical to parallel.offload = "none"
//    for 1 process, 2 ranks ZeRO-1 and 2 ranks ZeRO-3 (GPT, AdamW), SGD with momentum on a
//    ResNet (1 process, 2 ranks ZeRO-2), and fp16 loss scaling with a skipped overflow step;
//    parallel.offload_chunk_mb is set small so the update runs in many chunks;
//  * a checkpoint of either resumes under the other, continuing bit for bit;
//  * the run_start memory record moves the optimizer state to `offload_host`;
//  * a bad value, and train.cuda_graph with offload, exit 2 naming the key.
// On the CPU backend the "device" and the host share memory: the copies are memcpy, and the
// same kernels run on the same values, so nothing may differ at all.
#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint_fixture.h"
#include "core/fsutil.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "token_fixture.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_offload";
// 0.002 MiB = 524 f32 elements per chunk: the tiny models' updates run in 10-70 chunks
const std::string kOffload = "offload = \"optimizer\"\noffload_chunk_mb = 0.002\n";

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string ckpt(const std::string& name, int64_t step) {
  return run_dir(name) + "/checkpoints/" + CheckpointManager::dir_name(step);
}

std::string model_and_data(const std::string& kind) {
  if (kind == "gpt")
    return "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 16\nvocab_size = 256\n"
           "[data]\nkind = \"tokens\"\npath = \"" + byte_tokens(kWork) + "\"\neval_split = \"val\"\n"
           "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.01\n"
           "[schedule]\nkind = \"cosine\"\nwarmup_steps = 2\n";
  return "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
         "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
         "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nweight_decay = 5e-4\n";
}

// `steps` steps of batch 2 per rank with gradient clipping, a checkpoint every `every`.
std::string recipe(const std::string& name, const std::string& kind, int steps, int every, const std::string& extra,
                   const std::string& parallel = "") {
  stdfs::create_directories(kWork);
  stdfs::remove_all(run_dir(name));
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 7\ndevice = \"cpu\"\nthreads = 1\n"
    << model_and_data(kind) << "[train]\nbatch_size = 2\nmax_steps = " << steps << "\nclip_grad_norm = 0.5\n"
    << "[checkpoint]\nevery_steps = " << every << "\nkeep_last = 10\n"
    << "[eval]\nevery_steps = 0\n[log]\nevery_steps = 1\ntensorboard = false\n"
    << "[parallel]\ntimeout_s = 30\n" << parallel << extra;
  return path;
}

std::string train(const std::string& args) { return kBin + " train " + args; }

std::map<int64_t, double> losses(const std::string& name) {
  std::map<int64_t, double> out;
  for (auto& r : read_jsonl(run_dir(name) + "/metrics.jsonl"))
    if (r["kind"] == "train") out[r["step"].get<int64_t>()] = r["loss"].get<double>();
  return out;
}

// Steps [from, to] logged the same losses (exactly).
void same_losses(const std::string& a, const std::string& b, int64_t from, int64_t to) {
  auto la = losses(a), lb = losses(b);
  for (int64_t s = from; s <= to; ++s) {
    INFO(a << " vs " << b << " step " << s);
    REQUIRE(la.count(s));
    REQUIRE(lb.count(s));
    CHECK(la[s] == lb[s]);
  }
}


// The checkpoints at `step` of two runs: same weights and same optimizer files, bit for bit.
void same_checkpoint(const std::string& a, const std::string& b, int64_t step) {
  CHECK(model_state(ckpt(a, step)) == model_state(ckpt(b, step)));
  for (const char* prefix : {"optim-", "model-"}) {  // ZeRO's optimizer shards, ZeRO-3's model shards
    const auto fa = entries_with_prefix(ckpt(a, step), prefix), fb = entries_with_prefix(ckpt(b, step), prefix);
    REQUIRE(fa == fb);
    if (std::string(prefix) == "optim-") REQUIRE(!fa.empty());
    for (const auto& f : fa) same_tensors(ckpt(a, step) + "/" + f, ckpt(b, step) + "/" + f);
  }
}

nlohmann::json run_start(const std::string& name) {
  for (auto& e : read_jsonl(run_dir(name) + "/events.jsonl"))
    if (e["event"] == "run_start") return e;
  FAIL("no run_start event in " << name);
  return {};
}

// The same run without and with offload: identical losses, weights, optimizer state.
void offload_identical(const std::string& tag, const std::string& kind, const std::string& parallel,
                       const std::string& launch, const std::string& extra = "") {
  const std::string none = "off_" + tag + "_none", on = "off_" + tag + "_on";
  auto a = run_cmd(train(recipe(none, kind, 6, 6, extra, parallel) + launch));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  auto b = run_cmd(train(recipe(on, kind, 6, 6, extra, parallel + kOffload) + launch));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  CHECK_MESSAGE(b.all().find("offload: optimizer state, f32 master weights and gradient staging in host memory") !=
                    std::string::npos,
                b.all());
  same_losses(on, none, 1, 6);
  same_checkpoint(on, none, 6);
  const auto m_none = run_start(none)["memory"], m_on = run_start(on)["memory"];
  CHECK(m_none["optimizer_state"].get<int64_t>() > 0);
  CHECK(m_none["offload_host"] == 0);
  CHECK(m_on["optimizer_state"] == 0);
  // the state moved to the host, with the master copy and gradient staging of the same elements
  const int64_t states = kind == "gpt" ? 2 : 1;
  CHECK(m_on["offload_host"].get<int64_t>() == m_none["optimizer_state"].get<int64_t>() * (states + 2) / states);
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("offload: 1 process - GPT with AdamW: bit-identical losses - weights and optimizer state") {
  offload_identical("gpt1", "gpt", "", "");
}

TEST_CASE("offload: 2 ranks ZeRO-1 and ZeRO-3 - GPT with AdamW: bit-identical to no offload") {
  offload_identical("gpt_z1", "gpt", "zero = 1\n", " --nproc-per-node 2 --master-port 29871");
  offload_identical("gpt_z3", "gpt", "zero = 3\n", " --nproc-per-node 2 --master-port 29873");
}

TEST_CASE("offload: SGD with momentum on a ResNet - 1 process and 2 ranks ZeRO-2: bit-identical") {
  offload_identical("resnet1", "resnet", "", "");
  offload_identical("resnet_z2", "resnet", "zero = 2\n", " --nproc-per-node 2 --master-port 29875");
}

// fp16 (emulated on the CPU): the dynamic loss scale, and an overflow at step 3 that skips the
// update (the optimizer never sees it), with and without offload
TEST_CASE("offload: fp16 loss scaling with a skipped overflow step is bit-identical") {
  const std::string fp16 = "[precision]\ndtype = \"fp16\"\nloss_scale = 1024.0\n";
  struct Failpoint {  // unset even when a REQUIRE ends the test early
    Failpoint() { setenv("DTRAIN_FAILPOINTS", "step.grad_overflow=0:3", 1); }
    ~Failpoint() { unsetenv("DTRAIN_FAILPOINTS"); }
  };
  {
    Failpoint fp;
    offload_identical("fp16", "gpt", "", "", fp16);
  }
  auto rows = metric_rows(run_dir("off_fp16_on"), "train");
  REQUIRE(rows.size() == 6);
  CHECK(rows[1]["loss_scale"].get<double>() == 1024.0);
  CHECK(rows[2]["loss_scale"].get<double>() == 512.0);  // halved by the overflow of step 3
  CHECK(rows[2]["skipped_steps"] == 1);
}

// A checkpoint written without offload resumes with it and the other way round; both continue
// bit for bit as the uninterrupted run (the optimizer files have one format).
TEST_CASE("offload: checkpoints resume across offload none <-> optimizer - bit-identical") {
  const std::string ref = "off_resume_ref", on = "off_resume_on";
  auto r = run_cmd(train(recipe(ref, "gpt", 6, 3, "")));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  auto o = run_cmd(train(recipe(on, "gpt", 6, 3, "", kOffload)));
  REQUIRE_MESSAGE(o.code == 0, o.all());
  same_checkpoint(on, ref, 3);
  for (const auto& [from, name, set] :
       {std::tuple<std::string, std::string, std::string>{ref, "off_resume_to_on",
                                                          " --set parallel.offload=optimizer "
                                                          "--set parallel.offload_chunk_mb=0.002"},
        {on, "off_resume_to_none", " --set parallel.offload=none"}}) {
    const std::string rd = run_dir(name);
    stdfs::remove_all(rd);
    stdfs::create_directories(rd + "/checkpoints");
    stdfs::copy_file(run_dir(from) + "/config.toml", rd + "/config.toml");
    stdfs::copy(ckpt(from, 3), rd + "/checkpoints/" + CheckpointManager::dir_name(3));
    fs::write_file(rd + "/checkpoints/latest", CheckpointManager::dir_name(3) + "\n");
    auto c = run_cmd(train("--resume " + rd + set));
    REQUIRE_MESSAGE(c.code == 0, c.all());
    same_losses(name, ref, 4, 6);
    same_checkpoint(name, ref, 6);
  }
}

TEST_CASE("offload: a bad value and train.cuda_graph with offload exit 2 naming the key") {
  auto a = run_cmd(train(recipe("off_bad", "resnet", 2, 0, "", "offload = \"gpu\"\n")));
  CHECK(a.code == 2);
  CHECK_MESSAGE(a.all().find("parallel.offload: expected one of none, optimizer, got 'gpu'") != std::string::npos,
                a.all());
  auto b = run_cmd(train(recipe("off_graph", "resnet", 2, 0, "", kOffload) + " --set train.cuda_graph=true"));
  CHECK(b.code == 2);
  CHECK_MESSAGE(b.all().find("train.cuda_graph: true does not work with parallel.offload") != std::string::npos,
                b.all());
  auto c = run_cmd(train(recipe("off_chunk", "resnet", 2, 0, "", "offload_chunk_mb = 0\n")));
  CHECK(c.code == 2);
  CHECK_MESSAGE(c.all().find("parallel.offload_chunk_mb: expected a value > 0") != std::string::npos, c.all());
}

}  // TEST_SUITE

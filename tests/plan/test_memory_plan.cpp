// dtrain plan (plan/memory_plan.h): the predicted bytes of a rank against what real sessions
// allocate, measured by the backend's byte counters (Backend::alloc_counts), not computed:
//  * the model's state (parameters, 16-bit copy, gradients, optimizer state, ZeRO-1/2 buffers,
//    ZeRO-3 windows) of rank 0 once DataParallel is attached, for every zero stage on 2 and 4
//    ranks (threads over Gloo), GPT (fp32 and bf16) and ResNet: within 1%;
//  * the activations, measured once at batch 1 and scaled to the recipe's batch, against the
//    arena's high-water mark of a real step at that batch: within 10%;
//  * the command: table, --json, --measure, and one-line exit-2 errors.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "run_cmd.h"
#include "config/config.h"
#include "plan/memory_plan.h"
#include "plan/memory_probe.h"
#include "session/session.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_memory_plan";

std::string gpt_recipe(const std::string& extra = "") {
  return "[run]\nseed = 3\ndevice = \"cpu\"\nthreads = 1\n"
         "[model]\nkind = \"gpt\"\nn_layer = 4\nn_head = 2\nn_embd = 64\nblock_size = 32\nvocab_size = 256\n"
         "[data]\nkind = \"synthetic\"\n[train]\nbatch_size = 8\nmax_steps = 2\n"
         "[optim]\nname = \"adamw\"\nlr = 0.001\n" + extra;
}

std::string resnet_recipe(const std::string& extra = "") {
  return "[run]\nseed = 3\ndevice = \"cpu\"\nthreads = 1\n"
         "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 32\nstem = \"cifar\"\nin_channels = 3\nnum_classes = 10\n"
         "[data]\nkind = \"synthetic\"\nsynthetic_height = 16\nsynthetic_width = 16\n"
         "[train]\nbatch_size = 8\nmax_steps = 2\n"
         "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n" + extra;
}

std::string write_recipe(const std::string& name, const std::string& text) {
  stdfs::create_directories(kWork);
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream(path) << text;
  return path;
}

double rel(double predicted, double measured) { return std::abs(predicted - measured) / measured; }

// Rank 0's predicted state against its measured allocation after attach (before any step:
// the loss slots come with the first step, so they are left out of the prediction here).
// `shard_group`: ZeRO-3's (parallel.shard_group_size in the recipe; 0 = every rank).
void check_state(const std::string& name, const std::string& text, int world, int shard_group = 0) {
  const Config cfg = Config::parse(text, name + ".toml");
  const auto model = declare_model(cfg);
  const int64_t loss_slots = alloc_bytes(8 * 8, AllocRounding::Cpu);
  for (int zero = 0; zero <= 3; ++zero) {
    const StateBytes p =
        predict_state(model->params, cfg, zero, world, AllocRounding::Cpu, zero == 3 ? shard_group : 0);
    const std::vector<RankMemory> m = measure_ranks(cfg, zero, world, "", 0);
    const double predicted = double(p.total() - loss_slots), measured = double(m[0].after_attach);
    MESSAGE(name << " on " << world << " ranks, zero " << zero << ": predicted " << predicted << " B, measured "
                 << measured << " B (" << 100 * rel(predicted, measured) << "%; comm/windows " << p.comm << " B)");
    CHECK(rel(predicted, measured) <= 0.01);
  }
}

// The activation arenas' marks predicted from batch 1 against a real step at the recipe's
// batch, for every train.recompute choice (the step's arena plus the recompute scratch arena).
void check_activations(const std::string& name, const std::string& text, int world) {
  const Config cfg = Config::parse(text, name + ".toml");
  const auto model = declare_model(cfg);
  std::vector<ActivationProfile> profiles;
  for (const std::string& rc : recompute_choices(cfg)) profiles.push_back(measure_activations(cfg, rc, 1));
  const MemoryPlan plan = make_memory_plan(model->params, cfg, world, "cpu", profiles);
  REQUIRE(plan.rows.size() == 4 * profiles.size());
  for (const PlanRow& row : plan.rows) {
    if (row.zero != 0 && row.zero != 3) continue;
    const std::vector<RankMemory> m = measure_ranks(cfg, row.zero, world, row.recompute, 1);
    const double predicted = double(row.activations);
    const double measured = double(m[0].arena_high_water + m[0].scratch_high_water);
    MESSAGE(name << " zero " << row.zero << " recompute " << row.recompute << ": activations predicted " << predicted
                 << " B (scratch " << row.scratch_activations << " B), measured " << measured << " B (scratch "
                 << m[0].scratch_high_water << " B) at batch " << cfg.i("train.batch_size") << " ("
                 << 100 * rel(predicted, measured) << "%)");
    CHECK(rel(predicted, measured) <= 0.10);
    if (m[0].scratch_high_water == 0)
      CHECK(row.scratch_activations == 0);
    else
      CHECK(rel(double(row.scratch_activations), double(m[0].scratch_high_water)) <= 0.10);
  }
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("plan: predicted state bytes of a GPT equal what 2 and 4 ranks allocate under every zero stage") {
  check_state("gpt", gpt_recipe(), 2);
  check_state("gpt", gpt_recipe(), 4);
}

TEST_CASE("plan: predicted state bytes of a bf16 GPT (16-bit copy and windows) equal what 2 ranks allocate") {
  check_state("gpt_bf16", gpt_recipe("[precision]\ndtype = \"bf16\"\n"), 2);
}

TEST_CASE("plan: predicted state bytes of a hybrid-sharded GPT (4 ranks in shard groups of 2) equal what rank 0 allocates") {
  check_state("gpt_hybrid", gpt_recipe("[parallel]\nshard_group_size = 2\n"), 4, 2);
}

// parallel.offload = "optimizer": no optimizer state on the device (the measured bytes drop by
// it), and the host column holds it with the master copy and gradient staging of the same elements
TEST_CASE("plan: with optimizer offload the predicted device bytes equal what 2 ranks allocate - the state on the host") {
  const std::string text = gpt_recipe("[parallel]\noffload = \"optimizer\"\n");
  check_state("gpt_offload", text, 2);
  const Config cfg = Config::parse(text, "gpt_offload.toml"), plain = Config::parse(gpt_recipe(), "gpt.toml");
  const auto model = declare_model(cfg);
  for (int zero = 0; zero <= 3; ++zero) {
    const StateBytes on = predict_state(model->params, cfg, zero, 2, AllocRounding::Cpu);
    const StateBytes off = predict_state(model->params, plain, zero, 2, AllocRounding::Cpu);
    CHECK(on.optimizer == 0);
    CHECK(off.host == 0);
    CHECK(on.total() == off.total() - off.optimizer);
    const int64_t elems = zero == 3 ? zero3_shard_elements(model->params, 2)
                                    : zero > 0 ? (model->params.num_params() + 1) / 2 : model->params.num_params();
    CHECK(on.host == 4 * elems * 4);  // AdamW's 2 states + master + gradient staging
  }
  // the command: a host column and the JSON field
  const std::string rec = write_recipe("cli_offload", gpt_recipe()), json = kWork + "/cli_offload.json";
  auto r = run_cmd(shell_quote(kBin) + " plan " + rec + " --nproc 2 --set parallel.offload=optimizer --json " + json);
  INFO(r.all());
  REQUIRE(r.code == 0);
  CHECK(r.out.find(" host") != std::string::npos);
  CHECK(r.out.find("parallel.offload") != std::string::npos);
  nlohmann::json j = nlohmann::json::parse(std::ifstream(json));
  for (const auto& row : j["rows"]) {
    CHECK(row["optimizer_state"] == 0);
    CHECK(row["offload_host"].get<int64_t>() > 0);
  }
}

TEST_CASE("plan: predicted state bytes of a ResNet equal what 2 and 4 ranks allocate under every zero stage") {
  check_state("resnet", resnet_recipe(), 2);
  check_state("resnet", resnet_recipe(), 4);
}

TEST_CASE("plan: activations measured at batch 1 predict the arena of a GPT and a ResNet step at batch 8") {
  check_activations("gpt", gpt_recipe(), 2);
  check_activations("resnet", resnet_recipe(), 2);
}

TEST_CASE("plan: the command prints every zero stage and writes the same numbers as JSON") {
  const std::string rec = write_recipe("cli_gpt", gpt_recipe());
  const std::string json = kWork + "/cli_gpt.json";
  stdfs::remove(json);
  auto r = run_cmd(shell_quote(kBin) + " plan " + rec + " --nproc 4 --json " + json);
  INFO(r.all());
  REQUIRE(r.code == 0);
  for (const char* row : {"zero 0 (DDP)", "zero 1", "zero 2", "zero 3", "activations", "at batch 1"})
    CHECK(r.out.find(row) != std::string::npos);
  nlohmann::json j = nlohmann::json::parse(std::ifstream(json));
  const size_t variants = recompute_choices(Config::load(rec)).size();  // rows: zero stage x train.recompute choice
  REQUIRE(j["rows"].size() == 4 * variants);
  CHECK(j["world_size"] == 4);
  const Config cfg = Config::load(rec);
  const auto model = declare_model(cfg);
  for (int zero = 0; zero <= 3; ++zero) {
    const nlohmann::json& row = j["rows"][size_t(zero) * variants];
    CHECK(row["zero"] == zero);
    const StateBytes p = predict_state(model->params, cfg, zero, 4, AllocRounding::Cpu);
    CHECK(row["parameters"] == p.params);
    CHECK(row["gradients"] == p.grads);
    CHECK(row["optimizer_state"] == p.optimizer);
    CHECK(row["comm"] == p.comm);
    CHECK(row["total"].get<int64_t>() ==
          p.total() + row["arena"].get<int64_t>() + row["inputs"].get<int64_t>());
    CHECK(row["activations"].get<int64_t>() > 0);
  }
  // ZeRO-3 holds less than ZeRO-2, which holds less than DDP
  auto total = [&](int zero) { return j["rows"][size_t(zero) * variants]["total"].get<int64_t>(); };
  CHECK(total(3) < total(2));
  CHECK(total(2) < total(0));
  // a single process: one row
  auto one = run_cmd(shell_quote(kBin) + " plan " + rec + " --nproc 1");
  REQUIRE_MESSAGE(one.code == 0, one.all());
  CHECK(one.out.find("1 process") != std::string::npos);
  CHECK(one.out.find("zero 3") == std::string::npos);
}

TEST_CASE("plan: --measure prints the measured peak of one real step beside each prediction") {
  const std::string rec = write_recipe("cli_resnet", resnet_recipe());
  const std::string json = kWork + "/cli_resnet.json";
  auto r = run_cmd(shell_quote(kBin) + " plan " + rec + " --nproc 2 --measure --json " + json);
  INFO(r.all());
  REQUIRE(r.code == 0);
  CHECK(r.out.find("measured") != std::string::npos);
  nlohmann::json j = nlohmann::json::parse(std::ifstream(json));
  REQUIRE(j["rows"].size() == 4 * recompute_choices(Config::load(rec)).size());
  for (const auto& row : j["rows"]) {
    const double err = row["relative_error"].get<double>();
    MESSAGE(row["layout"].get<std::string>() << " " << row.value("recompute", std::string()) << ": predicted " << row["total"] << " B, measured " << row["measured_peak"]
                                             << " B (" << 100 * err << "%)");
    CHECK(row["measured_peak"].get<int64_t>() > 0);
    CHECK(std::abs(err) <= 0.02);
  }
}

TEST_CASE("plan: a missing recipe or --nproc below 1 or a bad --set or shard group or --measure beyond 8 ranks exits 2 with one line") {
  const std::string rec = write_recipe("cli_bad", gpt_recipe());
  const std::string bin = shell_quote(kBin);
  struct Case {
    std::string args, says;
  };
  for (const Case& c : {Case{"plan " + kWork + "/missing.toml --nproc 2", "missing.toml"},
                        Case{"plan " + rec + " --nproc 0", "--nproc"},
                        Case{"plan " + rec + " --nproc -3", "--nproc"},
                        Case{"plan " + rec, "--nproc"},
                        Case{"plan " + rec + " --nproc 2 --set train.batch_size=zero", "train.batch_size"},
                        Case{"plan " + rec + " --nproc 2 --set nosuch.key=1", "nosuch"},
                        Case{"plan " + rec + " --nproc 4 --set parallel.shard_group_size=3", "shard_group_size"},
                        Case{"plan " + rec + " --nproc 9 --measure", "at most 8"}}) {
    auto r = run_cmd(bin + " " + c.args);
    INFO(c.args << "\n" << r.all());
    CHECK(r.code == 2);
    CHECK(r.err_lines() == 1);
    CHECK(r.err.find(c.says) != std::string::npos);
  }
}

}  // TEST_SUITE

TEST_SUITE("unit") {

TEST_CASE("plan: allocation rounding follows the CPU and CUDA allocators and the arena's blocks") {
  CHECK(alloc_bytes(0, AllocRounding::Cpu) == 0);
  CHECK(alloc_bytes(1, AllocRounding::Cpu) == 256 + 8);
  CHECK(alloc_bytes(1024, AllocRounding::Cpu) == 1024 + 8);
  CHECK(alloc_bytes(1 << 20, AllocRounding::Cpu) == (1 << 20) + 4096 - 256);  // its own pages
  CHECK(alloc_bytes(1, AllocRounding::Cuda) == 512);
  CHECK(alloc_bytes((16 << 20) + 1, AllocRounding::Cuda) == 18 << 20);
  const int64_t MiB = 1 << 20;
  const auto cpu = AllocRounding::Cpu;
  CHECK(arena_blocks({}, cpu).peak() == 0);
  CHECK(arena_blocks({1000}, cpu).peak() == alloc_bytes(64 * MiB, cpu));
  CHECK(arena_blocks({1000}, cpu).steady == alloc_bytes(64 * MiB, cpu));
  // 150 MiB: three 64 MiB blocks during the first pass, then one of 150 MiB
  CHECK(arena_blocks({150 * MiB}, cpu).peak() == 3 * alloc_bytes(64 * MiB, cpu));
  CHECK(arena_blocks({150 * MiB}, cpu).steady == alloc_bytes(150 * MiB, cpu));
  // an evaluation of 200 MiB after it: a second 150 MiB block, then one of 200 MiB
  CHECK(arena_blocks({150 * MiB, 200 * MiB}, cpu).peak() == 2 * alloc_bytes(150 * MiB, cpu));
  CHECK(arena_blocks({150 * MiB, 200 * MiB}, cpu).steady == alloc_bytes(200 * MiB, cpu));
}

}  // TEST_SUITE

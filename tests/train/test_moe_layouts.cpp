// Mixture-of-experts models (nn/moe.h) under data parallelism and ZeRO, each against one process
// with the same global batch (grad_accum standing in for the data dimension), on CPU with Gloo
// through the launcher: the experts and routers are more entries of the flat buffers, and each
// micro-batch's load-balancing loss is its own, so N ranks equal one process:
//  * a Mixtral (4 experts, top 2, every block) under DP=2 with ZeRO-1, ZeRO-2 and ZeRO-3;
//  * a Qwen2-MoE with a shared expert and every 2nd block sparse, and a GPT-2 with expert MLPs,
//    under DDP on 2 ranks;
//  * block and selective recompute bit-identical to none;
//  * the routing metrics in metrics.jsonl, and tensor parallelism refused with a user error.
// Tolerances: the GPT layouts' (1e-5 relative on every loss and on the weights).
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "checkpoint_fixture.h"
#include "free_port.h"
#include "lm_recipe.h"
#include "process_work_dir.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "token_fixture.h"
#include "checkpoint/checkpoint.h"
#include "core/fsutil.h"

using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = process_work_dir("test_moe_layouts");
constexpr int kSteps = 6;

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string ckpt(const std::string& name) { return run_dir(name) + "/checkpoints/" + CheckpointManager::dir_name(kSteps); }

std::string model_lines(const std::string& arch) {
  const std::string m = "[model]\nkind = \"gpt\"\nn_layer = 4\nn_head = 4\nn_embd = 32\nblock_size = 16\nvocab_size = 256\n";
  if (arch == "mixtral")
    return m + "arch = \"llama\"\nn_kv_head = 2\nintermediate_size = 48\nnum_local_experts = 4\n"
               "num_experts_per_tok = 2\nrouter_aux_loss_coef = 0.01\n";
  if (arch == "qwen2_moe")
    return m + "arch = \"qwen2\"\nn_kv_head = 1\ntie_word_embeddings = true\nintermediate_size = 64\n"
               "num_local_experts = 4\nnum_experts_per_tok = 2\nmoe_intermediate_size = 24\nmoe_every = 2\n"
               "shared_expert_intermediate_size = 32\nnorm_topk_prob = false\nrouter_z_loss_coef = 0.001\n";
  if (arch == "gpt2_moe") return m + "num_local_experts = 3\nnum_experts_per_tok = 1\nmoe_every = 2\n";
  FAIL("unknown arch " << arch);
  return "";
}

std::string recipe(const std::string& name, const std::string& arch, int accum, const std::string& parallel) {
  return write_lm_recipe(kWork, name, LmRecipe{model_lines(arch), accum, kSteps, kSteps, 2, kSteps, parallel});
}

CmdResult train(const std::string& name, const std::string& arch, int accum, const std::string& parallel, int nproc,
                const std::string& args = "") {
  std::string cmd = kBin + " train " + recipe(name, arch, accum, parallel) + args;
  if (nproc > 1) cmd += " --nproc-per-node " + std::to_string(nproc) + " --master-port " + std::to_string(free_port());
  return run_cmd(cmd);
}

void train_ok(const std::string& name, const std::string& arch, int accum, const std::string& parallel, int nproc,
              const std::string& args = "") {
  auto r = train(name, arch, accum, parallel, nproc, args);
  REQUIRE_MESSAGE(r.code == 0, r.all());
}

std::string reference(const std::string& arch, int accum) {
  static std::set<std::string> made;
  const std::string name = "ref_" + arch + "_a" + std::to_string(accum);
  if (made.insert(name).second) train_ok(name, arch, accum, "", 1);
  return name;
}

void check_against(const std::string& name, const std::string& ref) {
  const auto a = train_losses(run_dir(name)), b = train_losses(run_dir(ref));
  check_close(name + " train", a, b, kSteps);
  check_close(name + " eval", eval_losses(run_dir(name)), eval_losses(run_dir(ref)), 1);
  MESSAGE(name << " vs one process (" << ref << ") over " << kSteps << " steps: largest relative loss difference "
               << worst_relative(a, b) << ", tolerance 1e-5");
  check_weights(ckpt(name), ckpt(ref));
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("moe layouts: a Mixtral under DP=2 with ZeRO-1 / ZeRO-2 / ZeRO-3 gives the losses of one process with grad_accum 2") {
  const std::string ref = reference("mixtral", 2);
  for (const char* z : {"1", "2", "3"}) {
    const std::string name = std::string("mx_dp2z") + z;
    train_ok(name, "mixtral", 1, std::string("zero = ") + z + "\n", 2);
    check_against(name, ref);
  }
}

TEST_CASE("moe layouts: a Qwen2-MoE with a shared expert and a GPT-2 with expert MLPs under DDP on 2 ranks give the losses of one process") {
  for (const char* arch : {"qwen2_moe", "gpt2_moe"}) {
    const std::string name = std::string("dp2_") + arch;
    train_ok(name, arch, 1, "", 2);
    check_against(name, reference(arch, 2));
  }
}

TEST_CASE("moe layouts: recompute is bit-identical and metrics.jsonl carries the routing") {
  const std::string ref = reference("mixtral", 1);
  for (const char* rc : {"block", "selective"}) {
    const std::string name = std::string("mx_rc_") + rc;
    train_ok(name, "mixtral", 1, "", 1, std::string(" --set train.recompute=") + rc);
    CHECK(train_losses(run_dir(name)) == train_losses(run_dir(ref)));
    CHECK(model_state(ckpt(name)) == model_state(ckpt(ref)));
  }
  // every logged step: the slots routed to each expert (4 blocks x 2 x 16 tokens x top 2), the
  // load-balancing loss (top_k = 2 when balanced: E sum f P with f near k/E, P near 1/E)
  std::ifstream in(run_dir(ref) + "/metrics.jsonl");
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") != "train") continue;
    ++rows;
    REQUIRE(j.contains("moe_tokens_per_expert"));
    int64_t slots = 0;
    for (const auto& t : j["moe_tokens_per_expert"]) slots += t.get<int64_t>();
    CHECK(j["moe_tokens_per_expert"].size() == 4);
    CHECK(slots == 4 * 2 * 16 * 2);
    CHECK(j["moe_dropped_tokens"].get<int64_t>() == 0);
    CHECK(j["moe_aux_loss"].get<double>() > 1.5);
    CHECK(j["moe_aux_loss"].get<double>() < 3.0);
  }
  CHECK(rows == kSteps);
}

TEST_CASE("moe layouts: tensor parallelism of a mixture of experts is refused with a user error") {
  auto r = train("mx_tp2", "mixtral", 1, "tensor = 2\n", 2);
  CHECK(r.code == 2);
  CHECK_MESSAGE(r.all().find("tensor parallelism of mixture-of-experts layers is not implemented") != std::string::npos,
                r.all());
}

}  // TEST_SUITE("integration")

// LoRA training runs (lora.enabled, docs/finetune.md) on CPU with Gloo through the launcher, a
// tiny Llama (4 blocks of width 32, grouped-query attention, untied head) fine-tuned from a dtrain
// checkpoint of itself (model.init_from) with adapters on q_proj, v_proj, o_proj and down_proj:
//  * the checkpoint holds the adapters alone (model.safetensors in PEFT's names, state.json's
//    parameter count), an optimizer state of their size, adapter_model.safetensors (the same
//    tensors) and adapter_config.json, and no config.json; `dtrain checkpoint merge-lora` writes
//    the base model with W + (alpha/r) B A on the adapted weights and every other tensor
//    bit-identical to the base checkpoint's;
//  * DP=2 with ZeRO-0, 1, 2 and 3 against one process with grad_accum 2, TP=2 against one process
//    (the tolerances of tests/train/test_llama_layouts.cpp: 1e-5 relative on every loss and on the
//    adapters);
//  * GPT-2 (c_attn, both c_proj, c_fc; Conv1D weights, fan_in_fan_out) under TP=2 against one process;
//  * resume: a run stopped at step 3 continues bit-identically; a DP=2 checkpoint resumes on one
//    process (grad_accum derived) with one process's losses;
//  * what is refused (a pipeline, a target the family lacks, rank 0) exits 2 naming the key;
//  * `dtrain plan` prints the LoRA plan and the full fine-tuning one.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "checkpoint_fixture.h"
#include "lm_recipe.h"
#include "core/fsutil.h"
#include "process_work_dir.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/model_tensors.h"
#include "checkpoint/safetensors.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = process_work_dir("test_lora_train");
constexpr int kSteps = 6;
const char* const kTargets = "q_proj,v_proj,o_proj,down_proj";

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string ckpt(const std::string& name, int64_t step = kSteps) {
  return run_dir(name) + "/checkpoints/" + CheckpointManager::dir_name(step);
}

const std::string kModel =
    "[model]\nkind = \"gpt\"\nn_layer = 4\nn_head = 4\nn_embd = 32\nblock_size = 16\nvocab_size = 256\n"
    "intermediate_size = 64\narch = \"llama\"\nn_kv_head = 2\n";

// The base model: 3 steps of full training, made once per test process.
std::string base_run() {
  static bool made = false;
  const std::string name = "lora_base";
  if (!made) {
    auto r = run_cmd(kBin + " train " + write_lm_recipe(kWork, name, LmRecipe{kModel, 1, 3, 3, 2, 3, ""}));
    REQUIRE_MESSAGE(r.code == 0, r.all());
    made = true;
  }
  return run_dir(name);
}

std::string lora_recipe(const std::string& name, int accum, const std::string& parallel, int ckpt_every = kSteps) {
  const std::string model = kModel + "init_from = \"" + base_run() + "\"\n";
  return write_lm_recipe(kWork, name,
                         LmRecipe{model, accum, kSteps, ckpt_every, 2, kSteps,
                                  parallel + "[lora]\nenabled = true\nrank = 4\nalpha = 8.0\ntarget_modules = \"" +
                                      kTargets + "\"\n"});
}

void train(const std::string& name, int accum, const std::string& parallel, int nproc, int port,
           const std::string& args = "", int ckpt_every = kSteps) {
  std::string cmd = kBin + " train " + lora_recipe(name, accum, parallel, ckpt_every) + args;
  if (nproc > 1) cmd += " --nproc-per-node " + std::to_string(nproc) + " --master-port " + std::to_string(port);
  auto r = run_cmd(cmd);
  REQUIRE_MESSAGE(r.code == 0, r.all());
}

std::string reference(int accum) {
  static std::set<int> made;
  const std::string name = "lora_ref_a" + std::to_string(accum);
  if (made.insert(accum).second) train(name, accum, "", 1, 0);
  return name;
}

void check_against(const std::string& name, const std::string& ref) {
  const auto a = train_losses(run_dir(name)), b = train_losses(run_dir(ref));
  check_close(name + " train", a, b, kSteps);
  check_close(name + " eval", eval_losses(run_dir(name)), eval_losses(run_dir(ref)), 1);
  MESSAGE(name << " vs one process (" << ref << "): largest relative loss difference " << worst_relative(a, b)
               << ", tolerance 1e-5");
  check_weights(ckpt(name), ckpt(ref));
  CHECK(CheckpointManager::verify(ckpt(name)) == "");
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("lora train: the checkpoint holds the adapters and their optimizer state in PEFT's files and merge-lora adds them to the base") {
  const std::string ref = reference(2), ck = ckpt(ref);
  SafetensorsReader m(ck + "/model.safetensors");
  int64_t n = 0;
  for (const std::string& t : m.names()) {
    CHECK_MESSAGE(t.rfind("base_model.model.model.layers.", 0) == 0, t);
    CHECK((t.find(".lora_A.weight") != std::string::npos || t.find(".lora_B.weight") != std::string::npos));
    int64_t e = 1;
    for (int64_t d : m.shape(t)) e *= d;
    n += e;
  }
  CHECK(m.names().size() == 4 * 4 * 2);  // 4 layers x 4 targets x (A, B)
  CHECK(m.shape("base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight") == std::vector<int64_t>{4, 32});
  CHECK(m.shape("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight") == std::vector<int64_t>{16, 4});
  CHECK(m.shape("base_model.model.model.layers.3.mlp.down_proj.lora_A.weight") == std::vector<int64_t>{4, 64});
  const nlohmann::json st = nlohmann::json::parse(fs::read_file(ck + "/state.json"));
  CHECK(st["model"]["num_params"].get<int64_t>() == n);
  // AdamW's state: two moments of exactly the adapters' elements
  const auto optim = entries_with_prefix(ck, "optim-");
  REQUIRE(optim.size() == 1);
  SafetensorsReader o(ck + "/" + optim[0]);
  int64_t state = 0;
  for (const std::string& t : o.names()) {
    int64_t e = 1;
    for (int64_t d : o.shape(t)) e *= d;
    CHECK_MESSAGE((e == n || e == 1), t);  // a flat moment of the adapters, or a scalar
    if (e == n) state += e;
  }
  MESSAGE("adapters: " << n << " parameters; optimizer moments " << state << " floats");
  CHECK(state == 2 * n);
  same_tensors(ck + "/model.safetensors", ck + "/adapter_model.safetensors");
  const nlohmann::json ac = nlohmann::json::parse(fs::read_file(ck + "/adapter_config.json"));
  CHECK(ac["peft_type"] == "LORA");
  CHECK(ac["task_type"] == "CAUSAL_LM");
  CHECK(ac["r"] == 4);
  CHECK(ac["lora_alpha"] == 8.0);
  CHECK(ac["fan_in_fan_out"] == false);
  CHECK(ac["target_modules"] == nlohmann::json({"q_proj", "v_proj", "o_proj", "down_proj"}));
  CHECK(ac["base_model_name_or_path"] == stdfs::absolute(base_run()).lexically_normal().string());
  CHECK(!stdfs::exists(ck + "/config.json"));
  // merge-lora: the base model's tensors, the adapted ones moved, the rest bit for bit
  const std::string out = kWork + "/merged";
  stdfs::remove_all(out);
  auto mg = run_cmd(kBin + " checkpoint merge-lora " + run_dir(ref) + " --out " + out);
  REQUIRE_MESSAGE(mg.code == 0, mg.all());
  CHECK_MESSAGE(mg.out.find("(16 weights updated)") != std::string::npos, mg.out);
  CHECK(stdfs::exists(out + "/config.json"));
  const std::string base_ck = resolve_checkpoint_dir(base_run());
  ModelTensors merged(out + "/model.safetensors"), base(base_ck);
  REQUIRE(merged.names() == base.names());
  int moved = 0;
  for (const std::string& t : base.names()) {
    const bool adapted = t.find("q_proj.weight") != std::string::npos || t.find("v_proj.weight") != std::string::npos ||
                         t.find("o_proj.weight") != std::string::npos || t.find("down_proj.weight") != std::string::npos;
    const bool same = read_f32(merged, t) == read_f32(base, t);
    CHECK_MESSAGE(same != adapted, t);
    moved += adapted && !same;
  }
  CHECK(moved == 16);
  // an occupied --out is refused
  auto again = run_cmd(kBin + " checkpoint merge-lora " + run_dir(ref) + " --out " + out);
  CHECK(again.code == 2);
  CHECK_MESSAGE(again.err.find("not an empty directory") != std::string::npos, again.err);
}

TEST_CASE("lora train: dtrain plan shows the LoRA plan beside full fine-tuning") {
  auto r = run_cmd(kBin + " plan " + lora_recipe("lora_plan", 1, "") + " --nproc 2");
  REQUIRE_MESSAGE(r.code == 0, r.all());
  const size_t lora = r.out.find("memory plan (LoRA)"), full = r.out.find("memory plan (full fine-tuning)");
  CHECK_MESSAGE((lora != std::string::npos && full != std::string::npos && lora < full), r.out);
  CHECK_MESSAGE(r.out.find(" frozen ") != std::string::npos, r.out);
  // the trainable counts: the adapters (4 layers: q 4(32+32), v 4(32+16), o 4(32+32), down 4(64+32)) and the model
  CHECK_MESSAGE(r.out.find("| 4352 trainable parameters") != std::string::npos, r.out);
}

TEST_CASE("lora train: DP=2 with ZeRO-0 - 1 - 2 and 3 and TP=2 give the losses of one process") {
  const std::string ref2 = reference(2);
  train("lora_dp2z0", 1, "", 2, 28411);
  check_against("lora_dp2z0", ref2);
  train("lora_dp2z1", 1, "zero = 1\n", 2, 28413);
  check_against("lora_dp2z1", ref2);
  train("lora_dp2z2", 1, "zero = 2\n", 2, 28415);
  check_against("lora_dp2z2", ref2);
  // ZeRO-3: the adapters (one root unit of their store) sharded, gathered for the whole pass; the
  // frozen model replicated; the checkpoint's adapters gathered into model.safetensors
  train("lora_dp2z3", 1, "zero = 3\n", 2, 28421);
  check_against("lora_dp2z3", ref2);
  CHECK(entries_with_prefix(ckpt("lora_dp2z3"), "model-").empty());
  CHECK(stdfs::exists(ckpt("lora_dp2z3") + "/adapter_model.safetensors"));
  // tensor parallel: q/v (column) with lora_A replicated and lora_B cut by rows, o/down (row) with
  // lora_A cut by columns and lora_B replicated; the checkpoint in the universal layout
  train("lora_tp2", 1, "tensor = 2\n", 2, 28417);
  check_against("lora_tp2", reference(1));
}

TEST_CASE("lora train: GPT-2's Conv1D adapters under TP=2 (c_attn's q - k - v blocks) give the losses of one process") {
  const std::string gpt2 =
      "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 4\nn_embd = 32\nblock_size = 16\nvocab_size = 256\n";
  auto b = run_cmd(kBin + " train " + write_lm_recipe(kWork, "lora_gpt2_base", LmRecipe{gpt2, 1, 3, 3, 2, 3, ""}));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  const std::string lora = "[lora]\nenabled = true\nrank = 4\nalpha = 8.0\ntarget_modules = \"c_attn,c_proj,c_fc\"\n";
  for (const auto& [name, parallel] : {std::pair<std::string, std::string>{"lora_gpt2_one", ""}, {"lora_gpt2_tp2", "tensor = 2\n"}}) {
    const std::string recipe = write_lm_recipe(
        kWork, name,
        LmRecipe{gpt2 + "init_from = \"" + run_dir("lora_gpt2_base") + "\"\n", 1, kSteps, kSteps, 2, kSteps, parallel + lora});
    auto r = run_cmd(kBin + " train " + recipe + (parallel.empty() ? "" : " --nproc-per-node 2 --master-port 28423"));
    REQUIRE_MESSAGE(r.code == 0, r.all());
  }
  check_against("lora_gpt2_tp2", "lora_gpt2_one");
  const nlohmann::json ac = nlohmann::json::parse(fs::read_file(ckpt("lora_gpt2_tp2") + "/adapter_config.json"));
  CHECK(ac["fan_in_fan_out"] == true);
  SafetensorsReader m(ckpt("lora_gpt2_tp2") + "/adapter_model.safetensors");
  CHECK(m.shape("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight") == std::vector<int64_t>{96, 4});
  CHECK(m.shape("base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight") == std::vector<int64_t>{4, 128});
}

TEST_CASE("lora train: a run stopped and resumed continues bit-identically and a DP=2 checkpoint resumes on one process") {
  const std::string ref = reference(2);
  train("lora_full", 2, "", 1, 0, "", 3);
  CHECK(train_losses(run_dir("lora_full")) == train_losses(run_dir(ref)));
  const std::string rd = copy_run_at(run_dir("lora_full"), run_dir("lora_resumed"), 3);
  auto r = run_cmd(kBin + " train --resume " + rd);
  REQUIRE_MESSAGE(r.code == 0, r.all());
  const auto all = train_losses(run_dir(ref)), mine = train_losses(rd);
  REQUIRE(all.size() == size_t(kSteps));
  CHECK(mine == std::vector<double>(all.begin() + 3, all.end()));
  CHECK(model_state(ckpt("lora_resumed")) == model_state(ckpt(ref)));
  // 2 ranks' checkpoint at step 3 on one process: grad_accum 2 derived, one process's losses
  train("lora_dp2_ck", 1, "zero = 1\n", 2, 28419, "", 3);
  const std::string r1 = copy_run_at(run_dir("lora_dp2_ck"), run_dir("lora_dp2_to1"), 3);
  auto r2 = run_cmd(kBin + " train --resume " + r1);
  REQUIRE_MESSAGE(r2.code == 0, r2.all());
  CHECK_MESSAGE(r2.all().find("train.grad_accum = 2 (was 1)") != std::string::npos, r2.all());
  check_close("lora_dp2_to1 steps 4-6", train_losses(r1), std::vector<double>(all.begin() + 3, all.end()),
              size_t(kSteps - 3));
  check_weights(ckpt("lora_dp2_to1"), ckpt(ref));
}

TEST_CASE("lora train: a pipeline - a target the family lacks and rank 0 are refused naming the key") {
  struct Case {
    std::string set, key;
  };
  for (const Case& c : {Case{"parallel.pipeline=2", "parallel.pipeline"},
                        Case{"lora.target_modules='c_attn'", "lora.target_modules"},
                        Case{"lora.rank=0", "lora.rank"}}) {
    auto r = run_cmd(kBin + " train " + lora_recipe("lora_bad", 1, "") + " --set \"" + c.set + "\"");
    CHECK_MESSAGE(r.code == 2, c.set << ": " << r.all());
    CHECK_MESSAGE(r.err.find(c.key) != std::string::npos, r.err);
  }
}
}

// The Llama family under the layouts its other tests (tests/session/test_pipeline.cpp,
// tests/train/test_zero3.cpp) do not cover, each against one process with the same global batch
// (grad_accum standing in for the data dimension), on CPU with Gloo through the launcher:
//  * DP=2 with ZeRO-1 and ZeRO-2 (a Llama with grouped-query attention and an untied head; a
//    Qwen2 with q/k/v biases, one key/value head and a tied head under ZeRO-2);
//  * hybrid sharding (ZeRO-3 on 4 ranks in shard groups of 2) and the interleaved pipeline
//    PP=2 V=2 (the Llama, and the Qwen2 whose tied embedding sits on the first chunk of stage 0
//    and the last chunk of stage 1);
//  * optimizer offload under ZeRO-1 and ZeRO-3 on 2 ranks, bit-identical to no offload (losses,
//    weights, optimizer state), the runs without offload within the tolerance of one process;
//  * bf16 (DDP) and fp16 (ZeRO-2) on 2 ranks against one process in the same precision;
//  * TP=2 with sequence parallelism and one key/value head (replicated over the tensor group):
//    a multi-query Llama and the Qwen2;
//  * GPipe PP=2, DP2 x TP2 with ZeRO-1 and ZeRO-3 on 4 ranks, and DP2 x TP2 x PP2 with ZeRO-2
//    on 8 ranks (every dimension at once);
//  * a ZeRO-3 checkpoint of 4 ranks resumed on 2 ranks and on one process (the global batch kept
//    by the derived accumulation); block and selective recompute under TP=2, bit-identical; a bf16
//    ZeRO-3 reduce-scatter within 1e-3 of one process (the GPT test's bound);
//  * greedy `dtrain sample` from a TP=2 checkpoint, and from that checkpoint consolidated
//    (`dtrain checkpoint consolidate`), prints one process's text.
//
// Tolerances: the GPT versions' (1e-5 relative on every loss, run_readers.h check_close, and on
// the weights, checkpoint_fixture.h check_weights; offload bit for bit as tests/train/
// test_offload.cpp; 16-bit data parallelism 1e-5 as tests/train/test_mixed_precision_dist.cpp:
// both sides compute the same 16-bit micro-batches and differ in the f32 sum of the gradients
// only). The models are tiny (4 blocks of width 32, 4 query heads, 6 steps of 2 x 16 byte
// tokens per data rank) so that each run takes a second or two.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "checkpoint_fixture.h"
#include "lm_recipe.h"
#include "core/fsutil.h"
#include "process_work_dir.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "sample_fixture.h"
#include "token_fixture.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = process_work_dir("test_llama_layouts");
constexpr int kSteps = 6;

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string ckpt(const std::string& name, int64_t step = kSteps) {
  return run_dir(name) + "/checkpoints/" + CheckpointManager::dir_name(step);
}

// "llama": grouped-query attention (2 key/value heads for 4 query heads), an untied head;
// "llama_mqa": the same with one key/value head; "qwen2": q/k/v biases, one key/value head, the
// head tied to the embedding.
std::string model_lines(const std::string& arch) {
  std::string m = "[model]\nkind = \"gpt\"\nn_layer = 4\nn_head = 4\nn_embd = 32\nblock_size = 16\nvocab_size = 256\n"
                  "intermediate_size = 64\n";
  if (arch == "llama") return m + "arch = \"llama\"\nn_kv_head = 2\n";
  if (arch == "llama_mqa") return m + "arch = \"llama\"\nn_kv_head = 1\n";
  if (arch == "qwen2") return m + "arch = \"qwen2\"\nn_kv_head = 1\ntie_word_embeddings = true\n";
  FAIL("unknown arch " << arch);
  return "";
}

// kSteps steps of batch 2 per data rank with grad_accum `accum`, clipping on, one evaluation
// and one checkpoint at the end; `parallel` goes under [parallel], `tail` after it (other tables).
std::string recipe(const std::string& name, const std::string& arch, int accum, const std::string& parallel,
                   const std::string& tail = "") {
  return write_lm_recipe(kWork, name, LmRecipe{model_lines(arch), accum, kSteps, kSteps, 2, kSteps, parallel + tail});
}

// `name` trained on `nproc` ranks (1: no launcher); its output must contain `banner`.
void train(const std::string& name, const std::string& arch, int accum, const std::string& parallel, int nproc,
           int port, const std::string& banner = "", const std::string& tail = "", const std::string& args = "") {
  std::string cmd = kBin + " train " + recipe(name, arch, accum, parallel, tail) + args;
  if (nproc > 1) cmd += " --nproc-per-node " + std::to_string(nproc) + " --master-port " + std::to_string(port);
  auto r = run_cmd(cmd);
  REQUIRE_MESSAGE(r.code == 0, r.all());
  if (!banner.empty()) CHECK_MESSAGE(r.all().find(banner) != std::string::npos, banner << "\n" << r.all());
}

// One process's run of `arch` with grad_accum `accum` (and `tail`, e.g. a precision), made once per
// test process.
std::string reference(const std::string& arch, int accum, const std::string& tail = "", const std::string& tag = "") {
  static std::set<std::string> made;
  const std::string name = "ref_" + arch + "_a" + std::to_string(accum) + tag;
  if (made.insert(name).second) train(name, arch, accum, "", 1, 0, "", tail);
  return name;
}

// Per-step training losses, the evaluation and the final weights of `name` against `ref`
// (1e-5 relative, as the GPT layouts); reports the largest relative loss difference.
void check_against(const std::string& name, const std::string& ref) {
  const auto a = train_losses(run_dir(name)), b = train_losses(run_dir(ref));
  check_close(name + " train", a, b, kSteps);
  check_close(name + " eval", eval_losses(run_dir(name)), eval_losses(run_dir(ref)), 1);
  MESSAGE(name << " vs one process (" << ref << ") over " << kSteps << " steps: largest relative loss difference "
               << worst_relative(a, b) << " (eval "
               << worst_relative(eval_losses(run_dir(name)), eval_losses(run_dir(ref))) << "), tolerance 1e-5");
  check_weights(ckpt(name), ckpt(ref));
  CHECK(CheckpointManager::verify(ckpt(name)) == "");
}


// `dtrain sample` greedy text (24 tokens after "int main") from a checkpoint or model directory, as
// hex bytes (a model this small prints control bytes too).
std::string greedy(const std::string& dir) { return greedy_hex(kBin, dir, "int main", 24); }

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("llama layouts: DP=2 with ZeRO-1 and ZeRO-2 gives the losses of one process with grad_accum 2") {
  const std::string ref = reference("llama", 2);
  train("ll_dp2z1", "llama", 1, "zero = 1\n", 2, 29201, "(ZeRO-1: 1/2 of the full state)");
  check_against("ll_dp2z1", ref);
  train("ll_dp2z2", "llama", 1, "zero = 2\n", 2, 29203, "data parallel");
  check_against("ll_dp2z2", ref);
  // Qwen2: q/k/v biases, multi-query, the tied head's gradient reduce-scattered once
  train("qw_dp2z2", "qwen2", 1, "zero = 2\n", 2, 29205, "data parallel");
  check_against("qw_dp2z2", reference("qwen2", 2));
}

TEST_CASE("llama layouts: hybrid ZeRO-3 (4 ranks in shard groups of 2) and PP=2 V=2 give the losses of one process with grad_accum 4") {
  const std::string ref = reference("llama", 4);
  train("ll_hybrid", "llama", 1, "zero = 3\nshard_group_size = 2\n", 4, 29207,
        "ZeRO-3 hybrid sharding: shard groups of 2 ranks, 2 replicas");
  check_against("ll_hybrid", ref);
  // the replicas hold the same shards: the first group's 2 ranks write them
  CHECK(entries_with_prefix(ckpt("ll_hybrid"), "optim-") ==
        std::vector<std::string>{"optim-00000-of-00002.safetensors", "optim-00001-of-00002.safetensors"});
  // interleaved: 4 blocks, one per virtual stage, 4 micro-batches
  train("ll_pp2v2", "llama", 4, "pipeline = 2\nvirtual_stages = 2\n", 2, 29209, "interleaved over 2 chunks");
  check_against("ll_pp2v2", ref);
  // the tied embedding on stage 0's first chunk and stage 1's last
  train("qw_pp2v2", "qwen2", 4, "pipeline = 2\nvirtual_stages = 2\n", 2, 29211, "interleaved over 2 chunks");
  check_against("qw_pp2v2", reference("qwen2", 4));
}

TEST_CASE("llama layouts: GPipe PP=2 and DP2 x TP2 with ZeRO-1 and ZeRO-3 and DP2 x TP2 x PP2 ZeRO-2 give the losses of one process") {
  const std::string ref2 = reference("llama", 2), ref4 = reference("llama", 4);
  // GPipe: every forward of the step, then every backward (2 micro-batches)
  train("ll_pp2_gpipe", "llama", 2, "pipeline = 2\nschedule = \"gpipe\"\n", 2, 29231, "schedule gpipe");
  check_against("ll_pp2_gpipe", ref2);
  // 4 ranks: two tensor groups of 2 (the grouped key/value heads split, one per rank), data-parallel
  // over them with the optimizer state sharded (ZeRO-1) and the parameters too (ZeRO-3)
  train("ll_dp2tp2_z1", "llama", 1, "tensor = 2\nzero = 1\n", 4, 29233, "tensor parallel: 2 ranks per group");
  check_against("ll_dp2tp2_z1", ref2);
  train("ll_dp2tp2_z3", "llama", 1, "tensor = 2\nzero = 3\n", 4, 29235, "tensor parallel: 2 ranks per group");
  check_against("ll_dp2tp2_z3", ref2);
  // 8 ranks, every dimension: 2 stages x 2 data x 2 tensor, ZeRO-2, 2 micro-batches per data rank
  train("ll_3d_z2", "llama", 2, "tensor = 2\npipeline = 2\nzero = 2\n", 8, 29237, "pipeline parallel: 2 stages (2 x 2 x 2 mesh");
  check_against("ll_3d_z2", ref4);
}

TEST_CASE("llama layouts: a ZeRO-3 checkpoint of 4 ranks resumes on 2 ranks and on one process with the global batch kept") {
  const std::string ref = reference("llama", 4);
  train("ll_z3_4", "llama", 1, "zero = 3\n", 4, 29241, "ZeRO-3: ", "", " --set checkpoint.every_steps=3");
  check_against("ll_z3_4", ref);
  struct Case {
    std::string name, launch, note;
  };
  for (const Case& c : {Case{"ll_z3_to2", " --nproc-per-node 2 --master-port 29243", "train.grad_accum = 2 (was 1)"},
                        Case{"ll_z3_to1", "", "train.grad_accum = 4 (was 1)"}}) {
    // step 3's checkpoint alone, resumed with nothing but the process count changed
    const std::string rd = copy_run_at(run_dir("ll_z3_4"), run_dir(c.name), 3);
    auto r = run_cmd(kBin + " train --resume " + rd + c.launch);
    REQUIRE_MESSAGE(r.code == 0, r.all());
    CHECK_MESSAGE(r.all().find(c.note) != std::string::npos, c.note << "\n" << r.all());
    const auto mine = train_losses(rd), all = train_losses(run_dir(ref));
    REQUIRE(all.size() == size_t(kSteps));
    check_close(c.name + " steps 4-6", mine, std::vector<double>(all.begin() + 3, all.end()), size_t(kSteps - 3));
    check_weights(ckpt(c.name), ckpt(ref));
  }
}

TEST_CASE("llama layouts: recompute under TP=2 is bit-identical and a bf16 ZeRO-3 reduce-scatter tracks one process") {
  // block and selective recomputation repeat the forward exactly: the same bits
  train("ll_tp2_none", "llama", 1, "tensor = 2\n", 2, 29245);
  check_against("ll_tp2_none", reference("llama", 1));
  for (const char* rc : {"block", "selective"}) {
    const std::string name = std::string("ll_tp2_rc_") + rc;
    train(name, "llama", 1, "tensor = 2\n", 2, rc[0] == 'b' ? 29247 : 29249, "", "",
          std::string(" --set train.recompute=") + rc);
    CHECK(train_losses(run_dir(name)) == train_losses(run_dir("ll_tp2_none")));
    CHECK(model_state(ckpt(name)) == model_state(ckpt("ll_tp2_none")));
  }
  // bf16 compute with the gradients reduce-scattered in bf16 (3 roundings per element): within
  // 1e-3 of one process in bf16, the GPT test's bound (tests/parallel/test_zero3_dtype.cpp)
  const std::string prec = "[precision]\ndtype = \"bf16\"\n";
  train("ll_z3_r16", "llama", 1, "zero = 3\nreduce_dtype = \"bf16\"\n", 2, 29251, "", prec);
  const auto a = train_losses(run_dir("ll_z3_r16")), b = train_losses(run_dir(reference("llama", 2, prec, "_bf16")));
  check_close("ll_z3_r16", a, b, kSteps, 1e-3);
  MESSAGE("Llama bf16 ZeRO-3 with a bf16 reduce-scatter vs one process in bf16: largest relative loss difference "
          << worst_relative(a, b) << " (bound 1e-3)");
}

TEST_CASE("llama layouts: optimizer offload on 2 ranks with ZeRO-1 and ZeRO-3 is bit-identical to no offload") {
  const std::string ref = reference("llama", 2);
  const std::string offload = "offload = \"optimizer\"\noffload_chunk_mb = 0.002\n";  // the update in many chunks
  struct Case {
    std::string tag, zero;
    int port;
  };
  for (const Case& c : {Case{"z1", "zero = 1\n", 29213}, Case{"z3", "zero = 3\n", 29215}}) {
    const std::string none = "ll_off_" + c.tag + "_none", on = "ll_off_" + c.tag + "_on";
    train(none, "llama", 1, c.zero, 2, c.port);
    train(on, "llama", 1, c.zero + offload, 2, c.port + 1,
          "offload: optimizer state, f32 master weights and gradient staging in host memory");
    // without offload: one process's losses; with: exactly those of without
    check_against(none, ref);
    const auto lon = train_losses(run_dir(on)), lnone = train_losses(run_dir(none));
    CHECK(lon == lnone);
    CHECK(eval_losses(run_dir(on)) == eval_losses(run_dir(none)));
    CHECK(model_state(ckpt(on)) == model_state(ckpt(none)));
    for (const char* prefix : {"optim-", "model-"}) {  // ZeRO's optimizer shards, ZeRO-3's model shards
      const auto fa = entries_with_prefix(ckpt(on), prefix), fb = entries_with_prefix(ckpt(none), prefix);
      REQUIRE(fa == fb);
      if (std::string(prefix) == "optim-") REQUIRE(!fa.empty());
      for (const auto& f : fa) same_tensors(ckpt(on) + "/" + f, ckpt(none) + "/" + f);
    }
    MESSAGE("Llama offload under ZeRO-" << c.tag.substr(1) << ": bit-identical to no offload over " << kSteps
                                        << " steps (losses, weights, optimizer state)");
  }
}

TEST_CASE("llama layouts: bf16 (DDP) and fp16 (ZeRO-2) on 2 ranks give the losses of one process in the same precision") {
  struct Case {
    std::string dtype, parallel;
    int port;
  };
  for (const Case& c : {Case{"bf16", "", 29219}, Case{"fp16", "zero = 2\n", 29221}}) {
    const std::string prec = "[precision]\ndtype = \"" + c.dtype + "\"\n";
    const std::string ref = reference("llama", 2, prec, "_" + c.dtype), name = "ll_dp2_" + c.dtype;
    train(name, "llama", 1, c.parallel, 2, c.port, "data parallel", prec);
    check_against(name, ref);
  }
  // the precisions are really different computations
  CHECK(train_losses(run_dir("ref_llama_a2_bf16")) != train_losses(run_dir("ref_llama_a2_fp16")));
}

TEST_CASE("llama layouts: TP=2 with sequence parallelism and one key/value head replicated gives the losses of one process") {
  // multi-query: T = 2 does not divide the one key/value head, so both ranks hold k_proj and
  // v_proj whole and their gradients are summed over the group (as the norms' under SP)
  train("llmqa_tp2sp", "llama_mqa", 1, "tensor = 2\nsequence = true\n", 2, 29223, "sequence parallel");
  check_against("llmqa_tp2sp", reference("llama_mqa", 1));
  // Qwen2: the replicated k/v biases too, and the tied vocabulary-parallel embedding
  train("qw_tp2sp", "qwen2", 1, "tensor = 2\nsequence = true\n", 2, 29225, "sequence parallel");
  check_against("qw_tp2sp", reference("qwen2", 1));
}

TEST_CASE("llama layouts: greedy sample from a TP=2 checkpoint and from it consolidated prints one process's text") {
  const std::string ref = reference("llama", 1);
  train("ll_tp2", "llama", 1, "tensor = 2\n", 2, 29227, "tensor parallel: 2 ranks per group");
  check_against("ll_tp2", ref);
  // the checkpoint is the universal one: the one-process model's tensors, one optimizer file
  CHECK(entries_with_prefix(ckpt("ll_tp2"), "optim-") == std::vector<std::string>{"optim-00000-of-00001.safetensors"});
  const std::string one = greedy(ckpt(ref)), mine = greedy(ckpt("ll_tp2"));
  CHECK(mine == one);
  // consolidated to a Hugging Face directory (config.json + model.safetensors), read back by sample
  const std::string out = kWork + "/ll_tp2_hf";
  stdfs::remove_all(out);
  auto c = run_cmd(kBin + " checkpoint consolidate " + run_dir("ll_tp2") + " --out " + out);
  REQUIRE_MESSAGE(c.code == 0, c.all());
  const auto config = nlohmann::json::parse(fs::read_file(out + "/config.json"));
  CHECK(config["architectures"][0] == "LlamaForCausalLM");
  CHECK(config["num_key_value_heads"] == 2);
  CHECK(config["tie_word_embeddings"] == false);
  CHECK(greedy(out) == one);
  MESSAGE("greedy sample from the TP=2 Llama checkpoint, from it consolidated and from one process (hex): " << one);
}

}  // TEST_SUITE

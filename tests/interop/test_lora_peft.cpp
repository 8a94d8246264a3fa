// LoRA adapters trained by dtrain judged by Hugging Face PEFT (0.13.2, transformers 4.46.3): a
// small random Llama (grouped-query, untied head, llama3 rope) and a GPT-2 saved by transformers'
// save_pretrained are fine-tuned with lora.enabled from model.init_from = that directory; then
// PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), checkpoint) in float64
// gives dtrain's evaluation loss on the same windows (1e-5 relative, the interop tests' bound)
// and its greedy text equals `dtrain sample` of the checkpoint and of `dtrain checkpoint merge-lora`'s directory, which
// transformers loads as a plain model with PEFT's logits. SKIPPED without DTRAIN_SOURCE_DIR/.venv/bin/python
// or without peft in it (`pip install --no-deps peft==0.13.2 accelerate==0.34.2`).
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

#include "sample_fixture.h"
#include "skip.h"
#include "train_fixtures.h"

namespace {

const std::string kPy = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python";
const std::string kCheck = std::string(DTRAIN_TEST_DIR) + "/lora_peft_check.py";

bool have_peft() {
  static const bool ok = stdfs::exists(kPy) && run_cmd(kPy + " -c 'import peft, transformers'").code == 0;
  return ok;
}

double after(const std::string& text, const std::string& re) {
  std::smatch m;
  REQUIRE_MESSAGE(std::regex_search(text, m, std::regex(re)), "no '" << re << "' in " << text);
  return std::stod(m[1].str());
}

void lora_in_peft(const std::string& kind, const std::string& model_keys, const std::string& targets) {
  const std::string work = std::string(DTRAIN_BUILD_DIR) + "/test_train/lorapeft_" + kind;
  stdfs::remove_all(work);
  stdfs::create_directories(work);
  auto tk = run_cmd(kBin + " data tokenize " + std::string(DTRAIN_SOURCE_DIR) + "/README.md --out " + work +
                    "/tok --tokenizer byte --val-fraction 0.2");
  REQUIRE_MESSAGE(tk.code == 0, tk.all());
  const std::string tok = work + "/tok", hf = work + "/hf";
  auto sv = run_cmd(kPy + " " + kCheck + " save " + hf + " " + kind);
  REQUIRE_MESSAGE(sv.code == 0, sv.all());
  const int steps = 8;
  const std::string recipe = work + "/lora.toml";
  {
    std::ofstream f(recipe);
    f << "[run]\nname = \"lora\"\nout_dir = \"" << work << "/runs\"\ndevice = \"cpu\"\nthreads = 1\nseed = 3\n"
      << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 4\nn_embd = 32\nblock_size = 32\nvocab_size = 256\n"
      << model_keys << "init_from = \"" << hf << "\"\n"
      << "[data]\nkind = \"tokens\"\npath = \"" << tok << "\"\neval_split = \"val\"\n"
      << "[train]\nbatch_size = 4\nmax_steps = " << steps << "\n[optim]\nname = \"adamw\"\nlr = 2e-2\nweight_decay = 0.0\n"
      << "[checkpoint]\nevery_steps = " << steps << "\n"
      << "[eval]\nevery_steps = " << steps << "\nbatch_size = 4\nmax_batches = 3\n[log]\ntensorboard = false\n"
      << "[lora]\nenabled = true\nrank = 4\nalpha = 16.0\ntarget_modules = \"" << targets << "\"\n";
  }
  auto t = run_cmd(kBin + " train " + recipe);
  REQUIRE_MESSAGE(t.code == 0, t.all());
  const std::string run = work + "/runs/lora", ck = run + "/checkpoints/step_00000008", merged = work + "/merged";
  auto mg = run_cmd(kBin + " checkpoint merge-lora " + ck + " --out " + merged);
  REQUIRE_MESSAGE(mg.code == 0, mg.all());
  const std::vector<std::string> prompts = {"The ", "dtrain"};
  auto py = run_cmd(kPy + " " + kCheck + " check " + hf + " " + ck + " " + merged + " " + tok +
                    "/val_000000.bin 32 12 12 '" + prompts[0] + "' '" + prompts[1] + "'");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  const std::vector<double> ev = eval_losses(run);
  REQUIRE(!ev.empty());
  const double loss = ev.back(), peft = after(py.out, "peft_loss ([0-9.]+)"), merged_loss = after(py.out, "merged_loss ([0-9.]+)");
  const double diff = after(py.out, "logits_max_diff ([0-9.e+-]+)"), effect = after(py.out, "adapter_effect ([0-9.e+-]+)");
  MESSAGE(kind << ": dtrain eval loss " << loss << ", PEFT (float64) " << peft << " (relative "
               << std::abs(loss - peft) / peft << "), merged " << merged_loss << "; logits |PEFT - merged| max " << diff
               << ", |PEFT - base| max " << effect);
  CHECK(std::abs(loss - peft) <= 1e-5 * peft);
  CHECK(std::abs(merged_loss - peft) <= 1e-6 * peft);
  CHECK(diff <= 1e-4);
  CHECK(effect > 1e-2);  // the adapters changed the model
  // dtrain's logits over a prompt (sample --logits) from the checkpoint (the frozen model and the
  // adapters) and from the merged directory against PEFT's (float64)
  const std::string text = "dtrain trains GPT-2 and Llama.";
  const std::string ck_logits = work + "/ck.logits.safetensors", mg_logits = work + "/merged.logits.safetensors";
  for (const auto& [dir, file] : {std::pair{ck, ck_logits}, std::pair{merged, mg_logits}}) {
    auto sm = run_cmd(kBin + " sample --checkpoint " + dir + " --prompt '" + text + "' --tokens 0 --logits " + file);
    REQUIRE_MESSAGE(sm.code == 0, sm.all());
  }
  auto lg = run_cmd(kPy + " " + kCheck + " logits " + hf + " " + ck + " '" + text + "' " + ck_logits + " " + mg_logits);
  REQUIRE_MESSAGE(lg.code == 0, lg.all());
  const double ck_diff = after(lg.out, "logits_max_diff 0 ([0-9.e+-]+)"), mg_diff = after(lg.out, "logits_max_diff 1 ([0-9.e+-]+)");
  MESSAGE(kind << ": dtrain's logits over " << text.size() << " tokens vs PEFT's (float64): checkpoint max |d| " << ck_diff
               << ", merged directory " << mg_diff << " (largest |logit| " << after(lg.out, "logits_max_abs ([0-9.e+-]+)")
               << ")");
  CHECK(ck_diff <= 1e-4);
  CHECK(mg_diff <= 1e-4);
  // dtrain sample on the merged directory, and on the LoRA checkpoint itself (the frozen model
  // read from its recipe's model.init_from, the adapters from the checkpoint)
  for (const std::string& dir : {merged, ck})
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::string hex = greedy_hex(kBin, dir, prompts[i], 12);
      CHECK_MESSAGE(py.out.find("greedy " + std::to_string(i) + " " + hex + "\n") != std::string::npos,
                    dir << ": " << py.out << " vs dtrain " << hex);
    }
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("lora peft: a Llama's adapters trained by dtrain load in PEFT with dtrain's loss and merge-lora gives PEFT's model") {
  if (!have_peft()) SKIP_TEST("no peft in " << kPy);
  lora_in_peft("llama",
               "arch = \"llama\"\nn_kv_head = 2\nintermediate_size = 48\nrms_norm_eps = 1e-5\nrope_scaling = \"llama3\"\n"
               "rope_factor = 4.0\nrope_low_freq_factor = 1.0\nrope_high_freq_factor = 2.0\n"
               "rope_original_max_positions = 16\n",
               "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
}

TEST_CASE("lora peft: GPT-2's Conv1D adapters (fan_in_fan_out) trained by dtrain load in PEFT with dtrain's loss and merge") {
  if (!have_peft()) SKIP_TEST("no peft in " << kPy);
  lora_in_peft("gpt2", "", "c_attn,c_proj,c_fc");
}
}

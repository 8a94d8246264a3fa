// Fine-tuning on SFT shards (data.kind = "sft", docs/finetune.md): the loss counts the targets
// only, averaged over the targets of the global batch, so one process with grad_accum 4, one
// micro-batch of 8 rows, 2 ranks with 2 and 4 ranks with 1 give the same losses (1e-5 relative,
// the layouts' tolerance), one example per row and packed alike; packed rows give the losses of unpacked ones when a step
// holds every example (fp32 tolerance); the pipeline (PP=2) and tensor parallelism with sequence
// parallelism (TP=2, GPT-2's gathered positions) give one process's losses on packed rows; bad
// recipes and over-long examples exit 2 with one line.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "process_work_dir.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "sft_fixture.h"
#include "data/sft_loader.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = process_work_dir("test_sft_training");
constexpr int kDocs = 40;

// 40 training examples of 3 to 15 byte tokens, 12 held out
std::string data_dir() {
  static const std::string dir = [] {
    const std::string d = kWork + "/sft_data";
    write_sft_split(d, "train", make_sft_split(kDocs, 3, 15, 7));
    write_sft_split(d, "val", make_sft_split(12, 3, 15, 8));
    return d;
  }();
  return dir;
}

struct SftRecipe {
  std::string arch = "llama";
  int batch = 2, accum = 1, steps = 4;
  bool packing = false;
  std::string extra;  // more lines (a [parallel] table, keys of [train] after it are not allowed)
};

std::string recipe(const std::string& name, const SftRecipe& r) {
  const std::string data = data_dir();
  stdfs::remove_all(kWork + "/runs/" + name);
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 5\ndevice = \"cpu\"\nthreads = 1\n"
    << "[model]\nkind = \"gpt\"\narch = \"" << r.arch << "\"\nn_layer = 2\nn_head = 4\nn_embd = 32\nblock_size = 16\n"
    << "vocab_size = 256\n"
    << (r.arch == "llama" ? "n_kv_head = 2\nintermediate_size = 64\n" : "")
    << "[data]\nkind = \"sft\"\npath = \"" << data << "\"\npacking = " << (r.packing ? "true" : "false") << "\n"
    << "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.01\n"
    << "[train]\nbatch_size = " << r.batch << "\ngrad_accum = " << r.accum << "\nmax_steps = " << r.steps
    << "\nclip_grad_norm = 1.0\n"
    << "[checkpoint]\nevery_steps = 0\n"
    << "[eval]\nevery_steps = " << r.steps << "\nbatch_size = 4\n"
    << "[log]\nevery_steps = 1\ntensorboard = false\n"
    << r.extra;
  return path;
}

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }

void train(const std::string& name, const SftRecipe& r, int nproc = 1, int port = 0) {
  std::string cmd = kBin + " train " + recipe(name, r);
  if (nproc > 1) cmd += " --nproc-per-node " + std::to_string(nproc) + " --master-port " + std::to_string(port);
  const auto res = run_cmd(cmd);
  REQUIRE_MESSAGE(res.code == 0, res.all());
}

void check_same(const std::string& name, const std::string& ref, int steps, double tol = 1e-5) {
  const auto a = train_losses(run_dir(name)), b = train_losses(run_dir(ref));
  check_close(name + " train", a, b, steps, tol);
  check_close(name + " eval", eval_losses(run_dir(name)), eval_losses(run_dir(ref)), 1, tol);
  MESSAGE(name << " vs " << ref << ": largest relative loss difference " << worst_relative(a, b) << " (eval "
               << worst_relative(eval_losses(run_dir(name)), eval_losses(run_dir(ref))) << ")");
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("sft training: one process - 2 ranks and 4 ranks give the same completion-only losses - unpacked and packed") {
  for (bool packing : {false, true}) {
    CAPTURE(packing);
    const std::string p = packing ? "_packed" : "";
    train("sft_1" + p, SftRecipe{"llama", 2, 4, 4, packing});
    // the micro-batches hold different numbers of targets: a mean per micro-batch would differ
    // from one micro-batch of 8 rows; the mean over the step's targets does not
    train("sft_b8" + p, SftRecipe{"llama", 8, 1, 4, packing});
    check_same("sft_b8" + p, "sft_1" + p, 4);
    train("sft_2" + p, SftRecipe{"llama", 2, 2, 4, packing}, 2, packing ? 29311 : 29301);
    check_same("sft_2" + p, "sft_1" + p, 4);
    train("sft_4" + p, SftRecipe{"llama", 2, 1, 4, packing, "[parallel]\nzero = 1\n"}, 4, packing ? 29313 : 29303);
    check_same("sft_4" + p, "sft_1" + p, 4);
  }
  // the loss is over the targets: not the mean over all tokens, which the prompts and padding
  // would pull down (a random model predicts any byte with a loss near ln 256)
  const auto l = train_losses(run_dir("sft_1"));
  REQUIRE(!l.empty());
  CHECK(l[0] > 5.0);
}

TEST_CASE("sft training: packed rows give the losses of one example per row when each step holds every example") {
  SftLoaderOptions o;
  o.seq_len = 16, o.packing = true;
  const int64_t rows = SftLoader({data_dir() + "/train_000000.bin"}, 256, o).rows();
  MESSAGE(kDocs << " examples in " << rows << " packed rows of 16 tokens");
  CHECK(rows < kDocs * 2 / 3);  // 365 tokens: at least 23 rows of 16
  train("sft_all_rows", SftRecipe{"llama", kDocs, 1, 3, false});
  train("sft_all_packed", SftRecipe{"llama", int(rows), 1, 3, true});
  check_same("sft_all_packed", "sft_all_rows", 3);
  train("sft_all_rows_gpt", SftRecipe{"gpt2", kDocs, 1, 3, false});
  train("sft_all_packed_gpt", SftRecipe{"gpt2", int(rows), 1, 3, true});
  check_same("sft_all_packed_gpt", "sft_all_rows_gpt", 3);
}

TEST_CASE("sft training: a pipeline (PP=2) and TP=2 with sequence parallelism give one process's losses on packed rows") {
  train("sft_pp_ref", SftRecipe{"llama", 2, 2, 4, true});
  train("sft_pp2", SftRecipe{"llama", 2, 2, 4, true, "[parallel]\npipeline = 2\n"}, 2, 29305);
  check_same("sft_pp2", "sft_pp_ref", 4);
  train("sft_tp_ref", SftRecipe{"gpt2", 2, 1, 4, true});
  train("sft_tp2", SftRecipe{"gpt2", 2, 1, 4, true, "[parallel]\ntensor = 2\nsequence = true\n"}, 2, 29307);
  check_same("sft_tp2", "sft_tp_ref", 4);
}

TEST_CASE("sft training: bad recipes and over-long examples exit 2 with one line") {
  auto fails = [&](const std::string& name, const SftRecipe& r, const std::string& set, const std::string& want) {
    const auto res = run_cmd(kBin + " train " + recipe(name, r) + set);
    CHECK_MESSAGE(res.code == 2, res.all());
    CHECK_MESSAGE(res.all().find(want) != std::string::npos, want << "\n" << res.all());
  };
  // block_size 8 is shorter than some examples (3 to 15 tokens)
  fails("sft_long", SftRecipe{}, " --set model.block_size=8",
        "is longer than a sequence of 8 tokens (set data.overflow = \"split\" or \"truncate\"");
  fails("sft_graph", SftRecipe{}, " --set train.cuda_graph=true", "train.cuda_graph");
  fails("sft_packing_tokens", SftRecipe{}, " --set data.kind=tokens --set data.packing=true",
        "data.packing: applies to data.kind = \"sft\"");
  // split and truncate train
  for (const char* mode : {"split", "truncate"}) {
    const auto res = run_cmd(kBin + " train " + recipe(std::string("sft_") + mode, SftRecipe{"llama", 2, 1, 2}) +
                             " --set model.block_size=8 --set data.overflow=" + mode);
    CHECK_MESSAGE(res.code == 0, res.all());
  }
}

}  // TEST_SUITE

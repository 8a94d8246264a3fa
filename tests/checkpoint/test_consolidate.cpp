// dtrain checkpoint consolidate (checkpoint/consolidate.h): a checkpoint of a 2-rank ZeRO-3 GPT run
// (each rank wrote its model shard; nobody the whole model) becomes a plain model directory
// that transformers' GPT2LMHeadModel.from_pretrained loads and that gives dtrain eval's loss;
// the shards read by the safetensors package alone hold the consolidated values; eval,
// inspect, sample and model.init_from read the sharded checkpoint as it is; invalid
// checkpoints (a shard missing or altered) and occupied --out directories exit 2.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "checkpoint_fixture.h"
#include "run_cmd.h"
#include "run_readers.h"
#include "skip.h"

namespace stdfs = std::filesystem;

namespace {

const std::string kBin = shell_quote(dtrain_bin());
const std::string kSrc = DTRAIN_SOURCE_DIR;
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_consolidate";
const std::string kPy = kSrc + "/.venv/bin/python";

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A byte-level GPT trained 4 steps on 2 ranks under ZeRO-3, a checkpoint at step 4; returns the recipe.
std::string train_zero3_gpt() {
  stdfs::remove_all(kWork);
  stdfs::create_directories(kWork);
  auto tk = run_cmd(kBin + " data tokenize " + kSrc + "/src/session/step.cpp " + kSrc + "/src/session/session.cpp --out " +
                    kWork + "/tok --tokenizer byte --val-fraction 0.2");
  REQUIRE_MESSAGE(tk.code == 0, tk.all());
  const std::string rec = kWork + "/g.toml";
  std::ofstream(rec) << "[run]\nname = \"g\"\nout_dir = \"" << kWork << "/runs\"\ndevice = \"cpu\"\nseed = 5\nthreads = 1\n"
                     << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 16\nvocab_size = 256\n"
                     << "[data]\nkind = \"tokens\"\npath = \"" << kWork << "/tok\"\neval_split = \"val\"\n"
                     << "[train]\nbatch_size = 4\nmax_steps = 4\n[optim]\nname = \"adamw\"\nlr = 1e-2\n"
                     << "[checkpoint]\nevery_steps = 4\n[eval]\nevery_steps = 0\nbatch_size = 4\nmax_batches = 2\n"
                     << "[log]\nevery_steps = 1\ntensorboard = false\n[parallel]\nzero = 3\ntimeout_s = 60\n";
  auto t = run_cmd(kBin + " train " + rec + " --nproc-per-node 2 --master-port 29991");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  return rec;
}


}  // namespace

TEST_SUITE("integration") {

TEST_CASE("consolidate: a ZeRO-3 GPT run's checkpoint loads with transformers from_pretrained and gives dtrain's loss") {
  if (std::system((kPy + " -c 'import transformers, torch' >/dev/null 2>&1").c_str()) != 0)
    SKIP_TEST("no python with transformers and torch at " << kPy);
  const std::string rec = train_zero3_gpt();
  const std::string run = kWork + "/runs/g";
  const std::string out = kWork + "/hf";
  auto c = run_cmd(kBin + " checkpoint consolidate " + run + " --out " + out);
  REQUIRE_MESSAGE(c.code == 0, c.all());
  CHECK(c.out.find("step_00000004") != std::string::npos);  // the run's latest checkpoint
  // exactly the model directory's files, the model bit for bit the checkpoint's
  std::vector<std::string> names;
  for (const auto& e : stdfs::directory_iterator(out)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"config.json", "model.safetensors"});  // byte tokenizer: no vocabulary files
  const std::string ck = run + "/checkpoints/step_00000004";
  // the checkpoint holds the ranks' model shards, not the model
  CHECK(!stdfs::exists(ck + "/model.safetensors"));
  CHECK(entries_with_prefix(ck, "model-") ==
        std::vector<std::string>{"model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors"});
  // the safetensors package alone: the shards' ranges give the consolidated values
  auto flat = run_cmd(kPy + " " + std::string(DTRAIN_TEST_DIR) + "/interop_check.py shards " + out +
                      "/model.safetensors " + ck);
  REQUIRE_MESSAGE(flat.code == 0, flat.all());
  CHECK(flat.out.find("flat ") != std::string::npos);

  auto ev = run_cmd(kBin + " eval " + rec + " --checkpoint " + ck);
  REQUIRE_MESSAGE(ev.code == 0, ev.all());
  const double loss = number_after(ev.out, "val loss ([0-9.]+)");
  auto py = run_cmd(kPy + " " + std::string(DTRAIN_TEST_DIR) + "/interop_check.py hfgpt2 " + out + " " + kWork +
                    "/tok/val_000000.bin 16 8 '' 0");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  const double hf_loss = number_after(py.out, "loss ([0-9.]+)");
  MESSAGE("dtrain eval loss " << loss << ", transformers on the consolidated directory " << hf_loss);
  CHECK(std::abs(loss - hf_loss) < 2e-4);  // dtrain prints 4 decimals

  // the default output: RUN_DIR/consolidated/step_XXXXXXXX; a second time it is occupied.
  // Progress (stdout is a pipe here; log lines): verification, then the copy in MB with a summary line.
  auto d = run_cmd("DTRAIN_PROGRESS_EVERY_S=0 " + kBin + " checkpoint consolidate " + ck);
  REQUIRE_MESSAGE(d.code == 0, d.all());
  CHECK_MESSAGE(d.all().find("verify " + ck + ": 1 files of ") != std::string::npos, d.all());
  CHECK_MESSAGE(d.all().find("consolidate " + ck + ": ") != std::string::npos, d.all());
  CHECK_MESSAGE(d.all().find(" MB of ") != std::string::npos, d.all());
  CHECK_MESSAGE(d.all().find(" MB in ") != std::string::npos, d.all());  // the summary
  // importing the consolidated directory again counts its tensors
  auto im = run_cmd("DTRAIN_PROGRESS_EVERY_S=0 " + kBin + " import gpt2 " + out + " --out " + kWork + "/imported");
  REQUIRE_MESSAGE(im.code == 0, im.all());
  CHECK_MESSAGE(im.all().find("import " + out + "/model.safetensors: 1 tensors of ") != std::string::npos, im.all());
  CHECK_MESSAGE(im.all().find(" tensors in ") != std::string::npos, im.all());
  CHECK(read(run + "/consolidated/step_00000004/model.safetensors") == read(out + "/model.safetensors"));
  auto again = run_cmd(kBin + " checkpoint consolidate " + ck);
  CHECK(again.code == 2);
  CHECK(again.err_lines() == 1);
  CHECK(again.err.find("not an empty directory") != std::string::npos);

  // the sharded checkpoint read as it is: inspect puts the model together, sample and
  // model.init_from load it (the consolidated weights, bit for bit)
  auto in = run_cmd(kBin + " inspect " + ck);
  REQUIRE_MESSAGE(in.code == 0, in.all());
  CHECK_MESSAGE(in.out.find("model (2 shards " + ck + "/model-*-of-00002.safetensors, put together):") !=
                    std::string::npos, in.out);
  CHECK(in.out.find("transformer.wte.weight") != std::string::npos);
  CHECK(in.out.find("model-00001-of-00002.safetensors: model shard 1 of 2") != std::string::npos);
  auto sa = run_cmd(kBin + " sample --checkpoint " + ck + " --prompt ab --tokens 4 --temperature 0");
  CHECK_MESSAGE(sa.code == 0, sa.all());
  auto fine = run_cmd(kBin + " train " + rec + " --set run.name=ft --set model.init_from=" + ck +
                      " --set train.max_steps=1 --set parallel.zero=0 --set optim.lr=1e-30");  // below every weight's ulp
  REQUIRE_MESSAGE(fine.code == 0, fine.all());
  CHECK(model_state(kWork + "/runs/ft/checkpoints/step_00000001") == model_state(out));
  auto imp = run_cmd(kBin + " import gpt2 " + ck + " --out " + kWork + "/imported_z3");
  REQUIRE_MESSAGE(imp.code == 0, imp.all());
  CHECK(model_state(kWork + "/imported_z3/checkpoints/step_00000000") == model_state(out));

  // a shard missing or altered: exit 2 naming it, nothing written
  const std::string broken = kWork + "/broken";
  stdfs::copy(ck, broken);
  {
    std::fstream f(broken + "/model-00001-of-00002.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  auto altered = run_cmd(kBin + " checkpoint consolidate " + broken + " --out " + kWork + "/o_altered");
  CHECK(altered.code == 2);
  CHECK(altered.err_lines() == 1);
  CHECK_MESSAGE(altered.err.find("model-00001-of-00002.safetensors: checksum mismatch") != std::string::npos,
                altered.err);
  CHECK(!stdfs::exists(kWork + "/o_altered"));
  stdfs::remove(broken + "/model-00001-of-00002.safetensors");
  auto gone = run_cmd(kBin + " eval " + rec + " --checkpoint " + broken);
  CHECK(gone.code == 2);
  CHECK(gone.err_lines() == 1);
  CHECK_MESSAGE(gone.err.find("model-00001-of-00002.safetensors: missing") != std::string::npos, gone.err);
}

TEST_CASE("consolidate: a missing path or a corrupt checkpoint or no subcommand exits 2 with one line") {
  const std::string dir = std::string(DTRAIN_BUILD_DIR) + "/test_consolidate_bad";
  stdfs::remove_all(dir);
  stdfs::create_directories(dir + "/ck");
  auto missing = run_cmd(kBin + " checkpoint consolidate " + dir + "/nothing --out " + dir + "/o1");
  CHECK(missing.code == 2);
  CHECK(missing.err_lines() == 1);
  CHECK(missing.err.find("does not exist") != std::string::npos);
  // a checkpoint whose model file no longer matches SHA256SUMS
  std::ofstream(dir + "/ck/model.safetensors") << "not the file that was hashed";
  std::ofstream(dir + "/ck/state.json") << "{}";
  std::ofstream(dir + "/ck/SHA256SUMS") << std::string(64, '0') << "  model.safetensors\n"
                                        << std::string(64, '0') << "  state.json\n";
  auto bad = run_cmd(kBin + " checkpoint consolidate " + dir + "/ck --out " + dir + "/o2");
  CHECK(bad.code == 2);
  CHECK(bad.err_lines() == 1);
  CHECK(bad.err.find("checksum mismatch") != std::string::npos);
  CHECK(!stdfs::exists(dir + "/o2"));
  // a header whose bytes are not UTF-8: the one error line quotes them escaped, as valid UTF-8
  {
    const std::string header = "{\"w\":{\"dtyp\xc1\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
    std::ofstream(dir + "/bad.safetensors", std::ios::binary) << file << header << std::string(4, '\0');
  }
  auto utf = run_cmd(kBin + " inspect " + dir + "/bad.safetensors");
  CHECK(utf.code == 2);
  CHECK(utf.err_lines() == 1);
  CHECK_MESSAGE(utf.err.find("\\xc1") != std::string::npos, utf.err);
  CHECK(utf.err.find('\xc1') == std::string::npos);
  auto none = run_cmd(kBin + " checkpoint");
  CHECK(none.code == 2);
  CHECK(none.err_lines() == 1);
}

}  // TEST_SUITE

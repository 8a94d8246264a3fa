// End-to-end training of GPT (byte-level, on a few KB of this repository's sources) and
// U-Net (a tiny synthetic-shapes set) through the real binary: metrics, resume, sampling
// and bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <sys/file.h>
#include <unistd.h>

#include "run_cmd.h"
#include "run_readers.h"

namespace stdfs = std::filesystem;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_train_gpt_unet";
const std::string kSrc = DTRAIN_SOURCE_DIR;

// Runs `make` once per directory, under a lock (ctest runs test cases as parallel processes).
void prepare_once(const std::string& dir, const std::string& make) {
  stdfs::create_directories(kWork);
  int fd = open((kWork + "/.lock").c_str(), O_CREAT | O_RDWR, 0644);
  REQUIRE(fd >= 0);
  flock(fd, LOCK_EX);
  if (!stdfs::exists(dir + "/manifest.json")) {
    auto r = run_cmd(make);
    CHECK_MESSAGE(r.code == 0, r.all());
  }
  flock(fd, LOCK_UN);
  close(fd);
}

// A few KB of text: two of the project's source files, byte-tokenized.
std::string tokens() {
  std::string d = kWork + "/tokens";
  prepare_once(d, kBin + " data tokenize " + kSrc + "/src/session/step.cpp " + kSrc +
                      "/src/session/session.cpp --out " + d + " --tokenizer byte --val-fraction 0.2");
  return d;
}

std::string shapes() {
  std::string d = kWork + "/shapes";
  prepare_once(d, kBin + " data shapes --out " + d + " --count 48 --size 16 --classes 3 --val-fraction 0.25");
  return d;
}

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }

std::string set(const std::string& kv) { return " --set " + shell_quote(kv); }

// `dtrain train` of a tiny recipe with the test's run directory and data.
CmdResult train(const std::string& recipe, const std::string& name, const std::string& data,
                const std::string& extra = "", const std::string& env = "") {
  stdfs::remove_all(run_dir(name));
  return run_cmd(env + kBin + " train " + kSrc + "/configs/" + recipe + set("run.name=\"" + name + "\"") +
                 set("run.out_dir=\"" + kWork + "/runs\"") + set("data.path=\"" + data + "\"") + extra);
}

std::vector<nlohmann::json> rows(const std::string& name, const std::string& kind) {
  return metric_rows(run_dir(name), kind);
}

std::vector<double> losses(const std::string& name) { return train_losses(run_dir(name)); }

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string latest(const std::string& name) {
  std::string l = slurp(run_dir(name) + "/checkpoints/latest");
  while (!l.empty() && (l.back() == '\n' || l.back() == ' ')) l.pop_back();
  return run_dir(name) + "/checkpoints/" + l;
}

int error_lines(const std::string& err) {
  int n = 0;
  std::istringstream is(err);
  std::string line;
  while (std::getline(is, line)) n += line.rfind("error:", 0) == 0;
  return n;
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("gpt: trains from token shards / logs tokens/s - val loss and perplexity / resumes bit-identically") {
  const std::string data = tokens();
  auto a = train("tiny_gpt.toml", "gpt_a", data);
  REQUIRE_MESSAGE(a.code == 0, a.all());
  auto la = losses("gpt_a");
  REQUIRE(la.size() == 12);
  CHECK(la.front() > 5.0);  // ~ln(256) at init
  CHECK(la.back() < la.front() - 0.5);
  auto tr = rows("gpt_a", "train");
  CHECK(tr.front().contains("tokens_per_s"));
  CHECK(a.all().find("tok/s") != std::string::npos);
  auto ev = rows("gpt_a", "eval");
  REQUIRE(ev.size() == 2);  // step 6 and the final one
  for (auto& e : ev) {
    double loss = e["eval_loss"].get<double>(), ppl = e["eval_perplexity"].get<double>();
    CHECK(std::isfinite(loss));
    CHECK(ppl == doctest::Approx(std::exp(loss)).epsilon(1e-9));
  }
  CHECK(ev.back()["eval_loss"].get<double>() < std::log(256.0));
  CHECK(a.all().find("val perplexity") != std::string::npos);

  // preempted after step 5 and resumed: the same losses and weights as the straight run
  auto c1 = train("tiny_gpt.toml", "gpt_c", data, "", "DTRAIN_FAILPOINTS=train.stop_at_step=5 ");
  REQUIRE_MESSAGE(c1.code == 0, c1.all());
  auto st = nlohmann::json::parse(slurp(run_dir("gpt_c") + "/checkpoints/step_00000005/state.json"));
  CHECK(st["data"]["position"] == 5);
  auto c2 = run_cmd(kBin + " train --resume " + run_dir("gpt_c"));
  REQUIRE_MESSAGE(c2.code == 0, c2.all());
  CHECK(losses("gpt_c") == la);
  CHECK(slurp(latest("gpt_c") + "/model.safetensors") == slurp(latest("gpt_a") + "/model.safetensors"));

  // eval of the checkpoint with the recipe
  auto e = run_cmd(kBin + " eval " + kSrc + "/configs/tiny_gpt.toml" + set("data.path=\"" + data + "\"") +
                   " --checkpoint " + run_dir("gpt_a"));
  CHECK_MESSAGE(e.code == 0, e.all());
  CHECK(e.out.find("val perplexity") != std::string::npos);
}

// llm.c's dev/data/data_common.py write_datafile(filename, toks, model_desc), as it writes:
// numpy, 256 int32 header (magic, version, count), then the tokens in the model's dtype.
const char* kLlmcWriter =
    "import sys\nimport numpy as np\n"
    "HEADERS_INFO = {'gpt-2': {'magic': 20240520, 'version': 1, 'token_dtype': np.uint16},\n"
    "                'llama-3': {'magic': 20240801, 'version': 7, 'token_dtype': np.uint32}}\n"
    "def write_datafile(filename, toks, model_desc='gpt-2'):\n"
    "    assert len(toks) < 2**31\n"
    "    info = HEADERS_INFO[model_desc]\n"
    "    header = np.zeros(256, dtype=np.int32)\n"
    "    header[0] = info['magic']; header[1] = info['version']; header[2] = len(toks)\n"
    "    toks_np = np.array(toks, dtype=info['token_dtype'])\n"
    "    with open(filename, 'wb') as f:\n"
    "        f.write(header.tobytes()); f.write(toks_np.tobytes())\n";

// Writes the bytes of trainer.cpp as llm.c-named shards (val, two train) into d, each id
// plus `offset`, in model_desc's format.
void write_llmc_shards(const std::string& d, const std::string& model_desc, int offset) {
  stdfs::remove_all(d);
  stdfs::create_directories(d);
  {
    std::ofstream f(d + "/write.py");
    f << kLlmcWriter
      << "desc, off = sys.argv[3], int(sys.argv[4])\n"
         "t = [b + off for b in open(sys.argv[2], 'rb').read()]\n"
         "n = len(t) // 5\n"
         "write_datafile(sys.argv[1] + '/fineweb_val_000000.bin', t[:n], desc)\n"
         "write_datafile(sys.argv[1] + '/fineweb_train_000001.bin', t[n:3 * n], desc)\n"
         "write_datafile(sys.argv[1] + '/fineweb_train_000002.bin', t[3 * n:], desc)\n"
         "open(sys.argv[1] + '/fineweb_trainer_notes.bin', 'wb').write(b'not a shard')\n";
  }
  auto w = run_cmd(std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python " + d + "/write.py " + d + " " + kSrc +
                   "/src/train/trainer.cpp " + model_desc + " " + std::to_string(offset));
  REQUIRE_MESSAGE(w.code == 0, w.all());
}

TEST_CASE("gpt: trains on shards named as llm.c names them (fineweb_train_000001.bin / fineweb_val_000000.bin)") {
  const std::string d = kWork + "/llmc_names";
  write_llmc_shards(d, "gpt-2", 0);
  auto a = train("tiny_gpt.toml", "gpt_llmc", d, set("train.max_steps=4") + set("eval.every_steps=4"));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  CHECK(losses("gpt_llmc").size() == 4);
  CHECK(rows("gpt_llmc", "eval").size() == 1);
  auto none = train("tiny_gpt.toml", "gpt_llmc_none", d, set("data.eval_split=\"test\""));
  CHECK(none.code == 2);
  CHECK_MESSAGE(none.err.find("no token shards for split 'test'") != std::string::npos, none.err);

  // the same tokens in llm.c's llama-3 format (uint32) train to the same losses, bit for bit
  write_llmc_shards(kWork + "/llmc_llama3", "llama-3", 0);
  auto b = train("tiny_gpt.toml", "gpt_llmc_l3", kWork + "/llmc_llama3",
                 set("train.max_steps=4") + set("eval.every_steps=4"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  CHECK(losses("gpt_llmc_l3") == losses("gpt_llmc"));
  CHECK(rows("gpt_llmc_l3", "eval").size() == 1);
}

// A vocabulary beyond uint16 (Llama 3's 128256): ids above 65535 reach the model as they are.
TEST_CASE("gpt: llm.c llama-3 shards with ids above 65535 train with a vocabulary of 128256") {
  const std::string d = kWork + "/llmc_llama3_wide";
  write_llmc_shards(d, "llama-3", 128000);  // bytes 0..255 -> ids 128000..128255
  auto a = train("tiny_gpt.toml", "gpt_llmc_wide", d,
                 set("model.vocab_size=128256") + set("train.max_steps=3") + set("eval.every_steps=0"));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  const auto l = losses("gpt_llmc_wide");
  REQUIRE(l.size() == 3);
  // an untrained model starts near uniform over the vocabulary: ln(128256) = 11.76
  CHECK(l[0] > 11.0);
  CHECK(l[0] < 12.5);
  // the same shards with a vocabulary too small name the file and the id
  auto s = train("tiny_gpt.toml", "gpt_llmc_wide_small", d, set("model.vocab_size=65536"));
  CHECK(s.code == 2);
  CHECK(s.err_lines() == 1);
  CHECK_MESSAGE(s.err.find("fineweb_train_000001.bin: token id 128") != std::string::npos, s.err);
}

TEST_CASE("gpt: dtrain sample prints text - deterministic for a seed") {
  const std::string data = tokens();
  auto a = train("tiny_gpt.toml", "gpt_sample", data, set("train.max_steps=4") + set("eval.every_steps=0"));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  const std::string cmd = kBin + " sample --checkpoint " + run_dir("gpt_sample") +
                          " --prompt 'int main' --tokens 24 --temperature 0.8 --top-k 20 --seed 3";
  auto s1 = run_cmd(cmd), s2 = run_cmd(cmd);
  REQUIRE_MESSAGE(s1.code == 0, s1.all());
  CHECK(s1.out.rfind("int main", 0) == 0);
  CHECK(s1.out.size() == std::string("int main").size() + 24 + 1);  // bytes + newline
  CHECK(s1.out == s2.out);
  auto s3 = run_cmd(kBin + " sample --checkpoint " + run_dir("gpt_sample") + " --prompt x --tokens 24 --seed 4");
  CHECK(s3.code == 0);
  // a ResNet or missing checkpoint is a user error
  auto bad = run_cmd(kBin + " sample --checkpoint " + kWork + "/nope --prompt x");
  CHECK(bad.code == 2);
  CHECK(bad.err_lines() == 1);
}

TEST_CASE("gpt: bad token shards and mismatched recipes exit 2 with one line") {
  const std::string data = tokens();
  // vocab smaller than the byte ids in the shards
  auto v = train("tiny_gpt.toml", "gpt_badvocab", data, set("model.vocab_size=64"));
  CHECK(v.code == 2);
  CHECK(v.err_lines() == 1);
  CHECK(v.err.find("train_000000.bin") != std::string::npos);
  // wrong magic
  std::string bad = kWork + "/tokens_badmagic";
  stdfs::remove_all(bad);
  stdfs::create_directories(bad);
  stdfs::copy(data + "/val_000000.bin", bad + "/val_000000.bin");
  std::string shard = slurp(data + "/train_000000.bin");
  shard[0] ^= 0x5a;
  std::ofstream(bad + "/train_000000.bin", std::ios::binary) << shard;
  auto m = train("tiny_gpt.toml", "gpt_badmagic", bad);
  CHECK(m.code == 2);
  CHECK(m.err_lines() == 1);
  CHECK(m.err.find("magic") != std::string::npos);
  // a GPT on image shards
  auto k = train("tiny_gpt.toml", "gpt_badkind", data, set("data.kind=\"webdataset\""));
  CHECK(k.code == 2);
  CHECK(k.err_lines() == 1);
  CHECK(k.err.find("data.kind") != std::string::npos);
  CHECK_FALSE(stdfs::exists(run_dir("gpt_badkind")));
}

TEST_CASE("unet: trains on shapes / logs mIoU - Dice and per-class IoU / resumes bit-identically") {
  const std::string data = shapes();
  auto a = train("tiny_unet.toml", "unet_a", data);
  REQUIRE_MESSAGE(a.code == 0, a.all());
  auto la = losses("unet_a");
  REQUIRE(la.size() == 8);
  CHECK(la.back() < la.front());
  auto ev = rows("unet_a", "eval");
  REQUIRE(ev.size() == 2);
  for (auto& e : ev) {
    double miou = e["eval_miou"].get<double>(), dice = e["eval_dice"].get<double>();
    CHECK(miou >= 0.0);
    CHECK(miou <= 1.0);
    CHECK(dice >= miou);  // Dice >= IoU class by class
    CHECK(e["eval_class_iou"].size() == 3);
  }
  CHECK(a.all().find("mIoU") != std::string::npos);

  auto c1 = train("tiny_unet.toml", "unet_c", data, "", "DTRAIN_FAILPOINTS=train.stop_at_step=3 ");
  REQUIRE_MESSAGE(c1.code == 0, c1.all());
  auto c2 = run_cmd(kBin + " train --resume " + run_dir("unet_c"));
  REQUIRE_MESSAGE(c2.code == 0, c2.all());
  CHECK(losses("unet_c") == la);
  CHECK(slurp(latest("unet_c") + "/model.safetensors") == slurp(latest("unet_a") + "/model.safetensors"));
  // Dice weight 0: pure cross-entropy, a different loss
  auto ce = train("tiny_unet.toml", "unet_ce", data, set("train.dice_weight=0.0") + set("train.max_steps=2") +
                                                          set("eval.every_steps=0"));
  REQUIRE_MESSAGE(ce.code == 0, ce.all());
  CHECK(losses("unet_ce").front() < la.front());
}

TEST_CASE("unet: a mask whose size differs from its image exits 2 with one line") {
  const std::string data = shapes();
  std::string bad = kWork + "/shapes_badmask";
  stdfs::remove_all(bad);
  // rewrite the first training sample's mask at another size
  const std::string py = kSrc + "/.venv/bin/python";
  const std::string script =
      "import io, json, sys, tarfile\n"
      "from PIL import Image\n"
      "src, dst = sys.argv[1], sys.argv[2]\n"
      "import shutil; shutil.copytree(src, dst)\n"
      "m = json.load(open(dst + '/manifest.json'))\n"
      "for split in m['splits'].values():\n"
      "  for sh in split['shards']:\n"
      "    name = sh['file'] if isinstance(sh, dict) else sh\n"
      "    if not name.startswith('train'): continue\n"
      "    p = dst + '/' + name\n"
      "    members = []\n"
      "    with tarfile.open(p) as t:\n"
      "      for ti in t.getmembers(): members.append((ti, t.extractfile(ti).read()))\n"
      "    done = False\n"
      "    with tarfile.open(p, 'w') as t:\n"
      "      for ti, b in members:\n"
      "        if not done and ti.name.endswith('.mask.png'):\n"
      "          buf = io.BytesIO(); Image.new('L', (8, 8)).save(buf, 'PNG'); b = buf.getvalue(); ti.size = len(b); done = True\n"
      "        t.addfile(ti, io.BytesIO(b))\n";
  std::ofstream(kWork + "/badmask.py") << script;
  auto p = run_cmd(py + " " + kWork + "/badmask.py " + data + " " + bad);
  REQUIRE_MESSAGE(p.code == 0, p.all());
  // found by the loader at the first batch (after the run started): one error line
  auto r = train("tiny_unet.toml", "unet_badmask", bad);
  CHECK(r.code == 2);
  CHECK(error_lines(r.err) == 1);
  CHECK(r.err.find("mask is 8x8 but its image is 16x16") != std::string::npos);
}

}  // TEST_SUITE

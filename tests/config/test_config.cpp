// Recipe parsing and validation (config/config.h): defaults, overrides, round trip, and
// malformed recipes, each a one-line UserError naming file:line:col and the key.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "config/config.h"

using namespace dtrain;

namespace {

const std::string kMinimal = "[model]\nkind = \"resnet\"\n[data]\npath = \"data/x\"\n";

// The UserError message of parsing `text` as x.toml (fails the test when none is thrown).
std::string error_of(const std::string& text, const std::vector<std::string>& ov = {}) {
  try {
    Config::parse(text, "x.toml", ov);
  } catch (const UserError& e) {
    CHECK(e.exit_code() == 2);
    std::string m = e.what();
    CHECK_MESSAGE(m.find('\n') == std::string::npos, m);
    return m;
  } catch (const std::exception& e) {
    FAIL("expected a UserError, got: " << e.what());
  }
  FAIL("expected a UserError for:\n" << text);
  return "";
}

bool has(const std::string& msg, const std::string& part) { return msg.find(part) != std::string::npos; }

// Evaluates `msg` once (doctest stringifies messages lazily, after the check).
#define CHECK_HAS(msg, part)                                                       \
  do {                                                                             \
    const std::string m_ = (msg);                                                  \
    CHECK_MESSAGE(has(m_, part), "message: " << m_ << "\nmissing: " << (part));    \
  } while (0)

}  // namespace

TEST_SUITE("unit") {
// The evaluation split a model family defaults to is resolved into the config, so the
// config.toml a run saves (and --resume reads back) names the split the run used.
TEST_CASE("config: data.eval_split defaults to val for GPT and U-Net and to test for ResNet and survives to_toml") {
  for (const char* kind : {"gpt", "unet", "resnet"}) {
    const std::string text = std::string("[model]\nkind = \"") + kind + "\"\n[data]\npath = \"data/x\"\n";
    Config c = Config::parse(text, "x.toml");
    const std::string want = std::string(kind) == "resnet" ? "test" : "val";
    CHECK(c.s("data.eval_split") == want);
    CHECK_FALSE(c.is_set("data.eval_split"));
    Config back = Config::parse(c.to_toml(), "config.toml");
    CHECK(back.s("data.eval_split") == want);
    CHECK(Config::parse(text + "eval_split = \"dev\"\n", "x.toml").s("data.eval_split") == "dev");
  }
}

TEST_CASE("config: minimal recipe gets every default") {
  Config c = Config::parse(kMinimal, "configs/my_run.toml");
  CHECK(c.s("model.kind") == "resnet");
  CHECK(c.i("train.batch_size") == 128);
  CHECK(c.f("train.epochs") == 1.0);
  CHECK(c.f("optim.weight_decay") == doctest::Approx(5e-4));
  CHECK(c.f("optim.eps") == doctest::Approx(1e-8));
  CHECK(c.b("precision.tf32"));
  CHECK_FALSE(c.b("data.hflip"));
  CHECK(c.s("optim.name") == "sgd");
  CHECK(c.s("run.device") == "auto");
  CHECK(c.s("run.name") == "my_run");  // the file stem
  CHECK(c.s("model.preset") == "");
  CHECK(c.iv("schedule.milestones").empty());
  CHECK(c.fv("data.mean").empty());
  CHECK(c.i("observability.prometheus_port") == 0);
  CHECK(c.is_set("model.kind"));
  CHECK_FALSE(c.is_set("train.batch_size"));
  CHECK_FALSE(c.is_set("run.name"));
  CHECK(c.origin("model.kind") == "configs/my_run.toml:2:1");
  CHECK(c.source() == "configs/my_run.toml");
}

TEST_CASE("config: values / int for float keys / arrays") {
  Config c = Config::parse(kMinimal +
                               "[optim]\nlr = 1\n[schedule]\nkind = \"multistep\"\nmilestones = [100, 200]\n"
                               "[train]\nepochs = 3\n[run]\nname = \"named\"\n",
                           "r.toml");
  CHECK(c.f("optim.lr") == 1.0);
  CHECK(c.f("train.epochs") == 3.0);
  CHECK(c.iv("schedule.milestones") == std::vector<int64_t>{100, 200});
  CHECK(c.s("run.name") == "named");
  Config d = Config::parse(kMinimal, "r.toml", {"model.in_channels=3", "data.mean=[0.5, 1, 0.25]", "data.std=[1,1,1]"});
  CHECK(d.fv("data.mean") == std::vector<double>{0.5, 1.0, 0.25});
}

TEST_CASE("config: overrides") {
  Config c = Config::parse(kMinimal + "[train]\nbatch_size = 32\n", "r.toml",
                           {"train.batch_size=64", "optim.name=adamw", "optim.lr = 3e-4",
                            "run.name=\"quoted name\"", "run.out_dir=123", "data.hflip=true",
                            "schedule.milestones=[5, 9]", "train.batch_size=16"});
  CHECK(c.i("train.batch_size") == 16);  // the last override wins
  CHECK(c.s("optim.name") == "adamw");
  CHECK(c.f("optim.lr") == doctest::Approx(3e-4));
  CHECK(c.s("run.name") == "quoted name");
  CHECK(c.s("run.out_dir") == "123");  // bare text for a string key
  CHECK(c.b("data.hflip"));
  CHECK(c.iv("schedule.milestones") == std::vector<int64_t>{5, 9});
  CHECK(c.origin("train.batch_size") == "--set train.batch_size=16");
  // An override can fix what the file leaves out.
  Config d = Config::parse("[model]\nkind = \"gpt\"\n", "r.toml", {"data.kind=synthetic"});
  CHECK(d.s("data.kind") == "synthetic");
}

TEST_CASE("config: set() validates like an override") {
  Config c = Config::parse(kMinimal, "r.toml");
  c.set("run.device", "cpu");
  CHECK(c.s("run.device") == "cpu");
  c.set("train.max_steps", "7");
  CHECK(c.i("train.max_steps") == 7);
  CHECK_THROWS_AS(c.set("run.device", "gpu"), UserError);
  CHECK_THROWS_AS(c.set("train.nope", "1"), UserError);
  // A set that breaks a cross-key rule is refused and leaves the config unchanged.
  c.set("train.max_steps", "0");
  try {
    c.set("train.epochs", "0");
    FAIL("expected a UserError");
  } catch (const UserError& e) {
    CHECK_HAS(std::string(e.what()), "train.epochs");
  }
  CHECK(c.f("train.epochs") == 1.0);
}

TEST_CASE("config: round trip through to_toml") {
  Config a = Config::parse(kMinimal, "configs/rt.toml",
                           {"optim.lr=0.0123456789", "data.mean=[0.1]", "data.std=[0.3]",
                            "schedule.milestones=[10,20]", "run.name=\"a \\\"q\\\" \\\\ b\"",
                            "optim.eps=1e-12", "precision.loss_scale=1e20"});
  std::string t = a.to_toml();
  Config b = Config::parse(t, "elsewhere/other.toml");
  CHECK(b.to_toml() == t);
  CHECK(b.hash() == a.hash());
  CHECK(a.hash().size() == 64);
  CHECK(b.s("run.name") == "a \"q\" \\ b");
  CHECK(b.f("optim.lr") == 0.0123456789);
  CHECK(b.f("precision.loss_scale") == 1e20);
  CHECK(has(t, "[observability]\n"));
  CHECK(has(t, "\nepochs = 1.0\n"));
  Config c = Config::parse(kMinimal, "configs/rt.toml", {"optim.lr=0.2"});
  CHECK(c.hash() != a.hash());
}

TEST_CASE("config: every shipped recipe loads and round-trips") {
  int n = 0;
  for (auto& e : std::filesystem::directory_iterator(DTRAIN_SOURCE_DIR "/configs")) {
    if (e.path().extension() != ".toml") continue;
    CAPTURE(e.path().string());
    Config c = Config::load(e.path().string());
    CHECK(c.s("run.name") == e.path().stem().string());
    CHECK(Config::parse(c.to_toml(), "rt").hash() == c.hash());
    ++n;
  }
  CHECK(n >= 3);
  Config t = Config::load(DTRAIN_SOURCE_DIR "/configs/tiny_resnet.toml");
  CHECK(t.s("run.device") == "cpu");
  CHECK(t.i("train.max_steps") == 20);
}

TEST_CASE("config: accessor misuse is an internal fault") {
  Config c = Config::parse(kMinimal, "r.toml");
  CHECK_THROWS_AS(c.i("train.batch_sise"), RuntimeFault);
  CHECK_THROWS_AS(c.s("train.batch_size"), RuntimeFault);
  CHECK_THROWS_AS(c.i("optim.lr"), RuntimeFault);
  CHECK_THROWS_AS(c.b("optim.name"), RuntimeFault);
  CHECK_THROWS_AS(c.iv("data.mean"), RuntimeFault);
  CHECK(c.f("train.batch_size") == 128.0);  // int keys read as float are fine
}

TEST_CASE("config: reference lists every key") {
  std::string r = config_reference();
  for (const auto& k : config_schema()) CHECK_MESSAGE(has(r, "| " + std::string(k.key) + " "), k.key);
  CHECK(has(r, "## [train]"));
  // docs/config.md carries the same table (regenerate it with `dtrain train --help-config`).
  std::ifstream f(DTRAIN_SOURCE_DIR "/docs/config.md");
  std::string doc((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK_MESSAGE(has(doc, r.substr(r.find("## [run]"))), "docs/config.md is out of date");
  CHECK(has(r, "sgd, adamw"));
  CHECK(has(r, "(required)"));
}

TEST_CASE("config errors: unknown key with a suggestion") {
  std::string m = error_of(kMinimal + "[train]\nbatch_sise = 32\n");
  CHECK(m == "x.toml:6:1: train.batch_sise: unknown key (did you mean train.batch_size?)");
}

TEST_CASE("config errors: key in the wrong section") {
  std::string m = error_of(kMinimal + "[optim]\nwarmup_steps = 5\n");
  CHECK_HAS(m, "x.toml:6:1: optim.warmup_steps: unknown key (did you mean schedule.warmup_steps?)");
  CHECK_HAS(error_of(kMinimal + "[train]\nzzzz = 1\n"), "train.zzzz: unknown key; [train] has: batch_size");
}

TEST_CASE("config errors: typo'd section") {
  std::string m = error_of(kMinimal + "\n[trian]\nbatch_size = 32\n");
  CHECK(m == "x.toml:6:1: trian: unknown section (did you mean [train]?)");
}

TEST_CASE("config errors: wrong type") {
  CHECK(error_of(kMinimal + "[train]\nbatch_size = \"32\"\n") ==
        "x.toml:6:14: train.batch_size: expected an integer, got a string");
  CHECK_HAS(error_of(kMinimal + "[train]\nbatch_size = 32.0\n"), "train.batch_size: expected an integer, got a float");
  CHECK_HAS(error_of(kMinimal + "[optim]\nlr = \"fast\"\n"), "optim.lr: expected a number, got a string");
  CHECK_HAS(error_of(kMinimal + "[run]\nname = 5\n"), "run.name: expected a string, got an integer");
  CHECK_HAS(error_of(kMinimal + "[run]\nname = 1979-05-27\n"), "x.toml:6:8: run.name: expected a string, got a date");
  CHECK_HAS(error_of(kMinimal + "[train.batch_size]\nx = 1\n"), "train.batch_size: expected an integer, got a table");
}

TEST_CASE("config errors: integer given for a bool") {
  CHECK(error_of("[model]\nkind = \"resnet\"\n[data]\npath = \"p\"\nhflip = 1\n") ==
        "x.toml:5:9: data.hflip: expected a boolean (true or false), got an integer");
}

TEST_CASE("config errors: out of range") {
  CHECK(error_of(kMinimal + "[train]\nbatch_size = -4\n") ==
        "x.toml:6:14: train.batch_size: expected a value >= 1, got -4");
  CHECK_HAS(error_of(kMinimal + "[optim]\nlr = 0\n"), "x.toml:6:6: optim.lr: expected a value > 0, got 0");
  CHECK_HAS(error_of(kMinimal + "[optim]\nmomentum = 1.0\n"), "optim.momentum: expected a value < 1, got 1");
  // thread and buffer counts a machine cannot hold (100000 threads crashed in OpenMP)
  CHECK_HAS(error_of(kMinimal, {"run.threads=100000"}), "run.threads: expected a value <= 4096, got 100000");
  CHECK_HAS(error_of(kMinimal, {"data.workers=2147483647"}), "data.workers: expected a value <= 256");
  CHECK_HAS(error_of(kMinimal, {"data.image_size=100000"}), "data.image_size: expected a value <= 16384");
  CHECK_HAS(error_of(kMinimal + "[observability]\nprometheus_port = 70000\n"),
            "observability.prometheus_port: expected a value <= 65535, got 70000");
  CHECK_HAS(error_of(kMinimal + "[parallel]\nzero = 4\n"), "parallel.zero: expected a value <= 3, got 4");
  CHECK_HAS(error_of(kMinimal + "[train]\nbatch_size = 3000000000\n"),
            "train.batch_size: expected a value <= 2147483647, got 3000000000");
  CHECK_HAS(error_of(kMinimal + "[optim]\nlr = nan\n"), "optim.lr: expected a finite number, got nan");
  CHECK_HAS(error_of(kMinimal, {"data.std=[0.5, 0]", "data.mean=[1,1]"}),
            "data.std: element [1]: expected a value > 0, got 0");
}

TEST_CASE("config errors: integer overflow") {
  CHECK_HAS(error_of(kMinimal + "[run]\nseed = 99999999999999999999\n"), "x.toml:6:");
  CHECK_HAS(error_of(kMinimal + "[run]\nseed = 99999999999999999999\n"), "not representable in 64 bits");
}

TEST_CASE("config errors: bad enum") {
  CHECK(error_of(kMinimal + "[optim]\nname = \"adamx\"\n") ==
        "x.toml:6:8: optim.name: expected one of sgd, adamw, got 'adamx' (did you mean adamw?)");
  CHECK_HAS(error_of(kMinimal, {"model.preset=gpt3"}),
            "model.preset: expected one of \"\", tiny, gpt2");
}

TEST_CASE("config errors: syntax error") {
  std::string m = error_of(kMinimal + "[train]\nbatch_size = \n");
  CHECK_HAS(m, "x.toml:6:");
  CHECK_HAS(m, "expected value");
  CHECK_HAS(error_of("[model\nkind = 1\n"), "x.toml:1:");
  CHECK_HAS(error_of(kMinimal + "[model]\nkind = \"unet\"\n"), "x.toml:5:");  // [model] defined twice
}

TEST_CASE("config errors: empty file and missing required key") {
  CHECK(error_of("") == "x.toml: model.kind: missing required key (one of resnet, unet, gpt)");
  CHECK(error_of("# only a comment\n[train]\nbatch_size = 8\n") ==
        "x.toml: model.kind: missing required key (one of resnet, unet, gpt)");
  // data.path is required unless data.kind = synthetic.
  CHECK(error_of("[model]\nkind = \"resnet\"\n") ==
        "x.toml: data.path: required when data.kind = \"webdataset\" (the dataset directory)");
  CHECK_HAS(error_of("[model]\nkind = \"gpt\"\n[data]\nkind = \"tokens\"\n"), "data.path: required");
  CHECK_NOTHROW(Config::parse("[model]\nkind = \"resnet\"\n[data]\nkind = \"synthetic\"\n", "x.toml"));
}

TEST_CASE("config errors: missing file") {
  try {
    Config::load("/nonexistent/dir/recipe.toml");
    FAIL("expected a UserError");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()) == "cannot read recipe /nonexistent/dir/recipe.toml: No such file or directory");
  }
}

TEST_CASE("config errors: bad overrides") {
  CHECK(error_of(kMinimal, {"train.batch_size"}) ==
        "--set train.batch_size: expected section.key=value (e.g. train.batch_size=64)");
  CHECK(error_of(kMinimal, {"train.batch_sise=3"}) ==
        "--set train.batch_sise=3: train.batch_sise: unknown key (did you mean train.batch_size?)");
  CHECK(error_of(kMinimal, {"train.batch_size=abc"}) ==
        "--set train.batch_size=abc: train.batch_size: expected an integer, got 'abc'");
  CHECK_HAS(error_of(kMinimal, {"trian.batch_size=3"}), "trian.batch_size: unknown section (did you mean [train]?)");
  // run.name is one directory: a path that climbs into another run's directory, or a name that
  // is not one line of UTF-8, is refused
  for (const char* bad : {"a/../b", "..", ".", "x/y", "/abs"})
    CHECK_HAS(error_of(kMinimal, {std::string("run.name=\"") + bad + "\""}), "run.name: expected a directory name");
  CHECK_HAS(error_of(kMinimal, {"run.name=bad\xffname"}), "run.name: expected a one-line value of UTF-8 text");
  CHECK_HAS(error_of("[run]\nname = \"a\\nb\"\n" + kMinimal), "run.name: expected a directory name");
  // a word of the key, not a short key two edits away
  CHECK_HAS(error_of(kMinimal, {"run.dir=\"x\""}), "run.dir: unknown key (did you mean run.out_dir?)");
  CHECK_HAS(error_of(kMinimal, {"optim.lrr=1"}), "optim.lrr: unknown key (did you mean optim.lr?)");
  CHECK_HAS(error_of(kMinimal, {"batch_size=3"}), "batch_size: keys belong in a section (did you mean train.batch_size?)");
  CHECK_HAS(error_of(kMinimal, {"train.batch_size=0"}), "--set train.batch_size=0: train.batch_size: expected a value >= 1, got 0");
  CHECK_HAS(error_of(kMinimal, {"data.hflip=yes"}), "data.hflip: expected a boolean (true or false), got 'yes'");
  CHECK(error_of(kMinimal, {"train.batch_size=1\nx=2"}) ==
        "--set train.batch_size=1\\nx=2: train.batch_size: expected a one-line value of UTF-8 text");
}

TEST_CASE("config errors: array element of the wrong type") {
  CHECK(error_of(kMinimal, {"data.mean=[0.5, \"a\"]"}) ==
        "--set data.mean=[0.5, \"a\"]: data.mean: element [1]: expected a number, got a string");
  CHECK(error_of("[model]\nkind = \"resnet\"\n[data]\npath = \"p\"\nmean = [0.5, true]\n") ==
        "x.toml:5:14: data.mean: element [1]: expected a number, got a boolean");
  CHECK_HAS(error_of(kMinimal, {"data.mean=0.5"}), "data.mean: expected an array of numbers, got a float (write [0.5])");
}

TEST_CASE("config errors: milestones") {
  CHECK(error_of(kMinimal + "[schedule]\nmilestones = [\"100\", \"200\"]\n") ==
        "x.toml:6:15: schedule.milestones: element [0]: expected an integer, got a string");
  CHECK_HAS(error_of(kMinimal + "[schedule]\nmilestones = [200, 100]\n"),
            "x.toml:6:1: schedule.milestones: expected strictly increasing steps, got 100 after 200");
  CHECK_HAS(error_of(kMinimal + "[schedule]\nkind = \"multistep\"\n"), "schedule.milestones: required");
}

TEST_CASE("config errors: structure") {
  CHECK(error_of("train = 5\n" + kMinimal) == "x.toml:1:1: train: expected a table [train], got an integer");
  CHECK_HAS(error_of("batch_size = 3\n" + kMinimal), "x.toml:1:1: batch_size: keys belong in a section (did you mean train.batch_size?)");
  CHECK_HAS(error_of(kMinimal + "[[train]]\nbatch_size = 3\n"), "train: expected a table [train], got an array");
  CHECK_HAS(error_of(kMinimal + "[train.extra]\nx = 1\n"), "train.extra: unknown key");
}

TEST_CASE("config errors: cross-key rules and the first problem in file order") {
  CHECK(error_of(kMinimal + "[train]\nmax_steps = 0\nepochs = 0\n") ==
        "x.toml:7:1: train.epochs: train.max_steps and train.epochs are both 0; set one of them");
  CHECK_HAS(error_of(kMinimal, {"data.mean=[0.5]"}), "data.std");
  CHECK_HAS(error_of(kMinimal, {"model.n_head=12", "model.n_embd=100"}), "model.n_embd: expected a multiple");
  // Two problems: the earlier line is reported, with a count of the rest.
  std::string m = error_of(kMinimal + "[train]\nbatch_size = 0\n[optim]\nnam = \"sgd\"\n[zzz]\n");
  CHECK_HAS(m, "x.toml:6:14: train.batch_size: expected a value >= 1, got 0 [2 more problems in this file]");
}
}

// The webdataset library and dtrain's shards both ways. `dtrain data index`: WebDataset shards
// written by the webdataset library itself
// (ShardWriter, JPEG images, int labels, extra .json members, a flat directory of
// train-*.tar / val-*.tar) get a manifest.json and train; bad shards are exit 2 naming the
// shard and sample, and a manifest is never replaced without --force.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/image_codec.h"
#include "data/tar.h"
#include "run_cmd.h"

namespace {

namespace fs = std::filesystem;
using namespace dtrain::data;

const std::string kBin = std::string(DTRAIN_BIN);
const std::string kPy = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python";

std::string fresh(const std::string& name) {
  const std::string d = std::string(DTRAIN_BUILD_DIR) + "/test_data_index/" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// argv: out_dir. Classification shards (flat: train-%06d.tar, val-%06d.tar; 20x24 RGB JPEGs,
// labels 0..4 where the colour tells the class) and segmentation shards (seg/train/%03d.tar:
// 16x16 PNG + 8-bit mask.png, values 0..2), all by webdataset.ShardWriter.
const char* kWrite = R"PY(
import io, os, sys
import numpy as np
import webdataset as wds
from PIL import Image
d = sys.argv[1]
os.makedirs(f"{d}/seg/train", exist_ok=True)
rng = np.random.default_rng(0)
def enc(a, fmt):
    b = io.BytesIO(); Image.fromarray(a).save(b, format=fmt); return b.getvalue()
for split, n in [("train", 60), ("val", 20)]:
    with wds.ShardWriter(f"{d}/{split}-%06d.tar", maxcount=25, verbose=0) as w:
        for i in range(n):
            c = i % 5
            a = (rng.random((20, 24, 3)) * 60).astype(np.uint8)
            a[..., c % 3] += 150
            a[:, : 4 * c + 4] //= 2
            w.write({"__key__": f"{split}/s{i:05d}", "jpg": enc(a, "JPEG"), "cls": c, "json": {"i": i}})
with wds.ShardWriter(f"{d}/seg/train/%03d.tar", maxcount=10, verbose=0) as w:
    for i in range(24):
        m = np.zeros((16, 16), np.uint8); m[4:10, 3:12] = 1 + i % 2
        a = (rng.random((16, 16, 3)) * 255).astype(np.uint8)
        w.write({"__key__": f"x{i:03d}", "png": enc(a, "PNG"), "mask.png": enc(m, "PNG")})
)PY";

nlohmann::json manifest(const std::string& dir) {
  std::ifstream f(dir + "/manifest.json");
  return nlohmann::json::parse(f);
}

std::string png(int w, int h, int c) {
  std::vector<uint8_t> px(size_t(w * h * c), 7);
  return encode_png(px.data(), w, h, c);
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("data index: shards written by webdataset's ShardWriter get a manifest and train") {
  const std::string d = fresh("wds");
  {
    std::ofstream f(d + "/write.py");
    f << kWrite;
  }
  auto w = run_cmd(kPy + " " + d + "/write.py " + d);
  REQUIRE_MESSAGE(w.code == 0, w.all());

  auto flat = run_cmd(kBin + " data index " + d);  // train-*.tar at the top: splits must be named
  CHECK(flat.code == 2);
  CHECK_MESSAGE(flat.err.find("--split NAME=GLOB") != std::string::npos, flat.err);
  CHECK(!fs::exists(d + "/manifest.json"));

  auto r = run_cmd(kBin + " data index " + d + " --split 'train=train-*.tar' --split 'val=val-*.tar'");
  REQUIRE_MESSAGE(r.code == 0, r.all());
  auto m = manifest(d);
  CHECK(m["splits"]["train"]["samples"] == 60);
  CHECK(m["splits"]["train"]["shards"].size() == 3);
  CHECK(m["splits"]["train"]["shards"][0]["file"] == "train-000000.tar");
  CHECK(m["splits"]["val"]["samples"] == 20);
  CHECK(m["splits"]["val"]["num_classes"] == 5);
  CHECK(m["splits"]["train"]["height"] == 20);
  CHECK(m["splits"]["train"]["width"] == 24);
  CHECK(m["splits"]["train"]["channels"] == 3);

  auto again = run_cmd(kBin + " data index " + d + " --split 'train=train-*.tar'");
  CHECK(again.code == 2);
  CHECK(again.err.find("--force") != std::string::npos);
  CHECK(manifest(d) == m);  // untouched

  const std::string recipe = std::string(DTRAIN_SOURCE_DIR) + "/configs/tiny_resnet.toml";
  auto t = run_cmd(kBin + " train " + recipe + " --set run.out_dir=" + shell_quote("\"" + d + "/runs\"") +
                   " --set data.path=" + shell_quote("\"" + d + "\"") +
                   " --set data.eval_split='\"val\"' --set model.in_channels=3 --set model.num_classes=5"
                   " --set data.mean=[0.5,0.5,0.5] --set data.std=[0.25,0.25,0.25] --set train.batch_size=10"
                   " --set train.max_steps=12 --set eval.batch_size=10 --set eval.every_steps=12");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  CHECK_MESSAGE(t.out.find("20 samples") != std::string::npos, t.out);

  // segmentation shards in a split subdirectory: found without --split
  auto s = run_cmd(kBin + " data index " + d + "/seg");
  REQUIRE_MESSAGE(s.code == 0, s.all());
  auto sm = manifest(d + "/seg");
  CHECK(sm["splits"]["train"]["samples"] == 24);
  CHECK(sm["splits"]["train"]["num_classes"] == 3);
  CHECK(sm["splits"]["train"]["shards"][2]["file"] == "train/002.tar");
  // and the other way: the webdataset library reads the shards dtrain writes, sample by sample
  auto g = run_cmd(kBin + " data shapes --out " + d + "/shapes --count 30 --size 16 --classes 3 --val-fraction 0.2");
  REQUIRE_MESSAGE(g.code == 0, g.all());
  auto rd = run_cmd(kPy + " -c " +
                    shell_quote("import glob, sys, webdataset as wds\n"
                                "n = 0\n"
                                "for s in wds.WebDataset(sorted(glob.glob(sys.argv[1] + '/train/*.tar')), shardshuffle=False):\n"
                                "    assert s['png'][:4] == b'\\x89PNG' and s['mask.png'][:4] == b'\\x89PNG', s.keys()\n"
                                "    n += 1\n"
                                "print('samples', n)\n") +
                    " " + d + "/shapes");
  CHECK_MESSAGE(rd.out == "samples 24\n", rd.all());
  auto u = run_cmd(kBin + " train " + std::string(DTRAIN_SOURCE_DIR) + "/configs/tiny_unet.toml --set run.out_dir=" +
                   shell_quote("\"" + d + "/runs\"") + " --set data.path=" + shell_quote("\"" + d + "/seg\"") +
                   " --set data.eval_split='\"train\"' --set model.num_classes=3 --set train.batch_size=4"
                   " --set train.max_steps=3 --set eval.every_steps=3");
  REQUIRE_MESSAGE(u.code == 0, u.all());
  CHECK_MESSAGE(u.out.find("mIoU") != std::string::npos, u.out);
}
}

TEST_SUITE("unit") {

TEST_CASE("data index: bad shards exit 2 naming the shard and sample and write no manifest") {
  auto shard = [](const std::string& dir, const std::vector<std::pair<std::string, std::string>>& members) {
    fs::create_directories(dir + "/train");
    TarWriter t(dir + "/train/000000.tar");
    for (const auto& [n, b] : members) t.add(n, b);
    t.finish();
  };
  struct Case {
    std::vector<std::pair<std::string, std::string>> members;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {{{"a.png", png(8, 8, 1)}, {"a.cls", "1"}, {"b.png", png(8, 8, 1)}}, {"sample 'b'", "no KEY.cls", "KEY.mask.png"}},
      {{{"a.webp", "RIFF"}, {"a.cls", "1"}}, {"sample 'a' has no image", ".webp"}},
      {{{"a.png", "not a png"}, {"a.cls", "1"}}, {"sample 'a'", "a.png: not a PNG"}},
      {{{"a.png", png(8, 8, 3)}, {"a.cls", "cat"}}, {"sample 'a'", "label 'cat'"}},
      {{{"a.png", png(8, 8, 3)}, {"a.mask.png", png(4, 4, 1)}}, {"sample 'a'", "mask is 4x4", "8x8"}},
      {{{"__meta__.json", "{}"}}, {"000000.tar", "holds no samples"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string d = fresh("bad" + std::to_string(i));
    shard(d, cases[i].members);
    auto r = run_cmd(kBin + " data index " + d);
    CAPTURE(i);
    CHECK(r.code == 2);
    CHECK(r.err_lines() == 1);
    for (const auto& e : cases[i].expect) CHECK_MESSAGE(r.err.find(e) != std::string::npos, r.err);
    CHECK(!fs::exists(d + "/manifest.json"));
  }
  const std::string empty = fresh("empty");
  auto r = run_cmd(kBin + " data index " + empty);
  CHECK(r.code == 2);
  CHECK(r.err.find("no .tar shards") != std::string::npos);
  auto nx = run_cmd(kBin + " data index " + empty + " --split 'train=x/*.tar'");
  CHECK(nx.code == 2);
  CHECK(nx.err.find("no file of") != std::string::npos);
  auto up = run_cmd(kBin + " data index " + empty + " --split 'train=../*.tar'");
  CHECK(up.code == 2);
  CHECK(up.err.find("relative to") != std::string::npos);

  // a loader pointed at unindexed shards says how to index them
  const std::string d = fresh("noindex");
  shard(d, {{"a.png", png(8, 8, 3)}, {"a.cls", "1"}, {"b.png", png(8, 8, 3)}, {"b.cls", "0"}});
  auto t = run_cmd(kBin + " train " + std::string(DTRAIN_SOURCE_DIR) + "/configs/tiny_resnet.toml --set data.path=" +
                   shell_quote("\"" + d + "\"") + " --set run.out_dir=" + shell_quote("\"" + d + "/runs\""));
  CHECK(t.code == 2);
  CHECK_MESSAGE(t.err.find("dtrain data index " + d) != std::string::npos, t.err);
  auto ok = run_cmd(kBin + " data index " + d + " --num-classes 10");
  REQUIRE_MESSAGE(ok.code == 0, ok.all());
  CHECK(manifest(d)["splits"]["train"]["num_classes"] == 10);
  CHECK(manifest(d)["splits"]["train"]["channels"] == 3);
  // images of mixed sizes: indexed as 0x0 (recipes set data.image_size), with a warning
  const std::string mixed = fresh("mixed");
  shard(mixed, {{"a.png", png(8, 8, 3)}, {"a.cls", "1"}, {"b.png", png(8, 6, 3)}, {"b.cls", "0"}});
  auto mx = run_cmd(kBin + " data index " + mixed);
  REQUIRE_MESSAGE(mx.code == 0, mx.all());
  CHECK_MESSAGE(mx.all().find("mixed sizes") != std::string::npos, mx.all());
  CHECK(manifest(mixed)["splits"]["train"]["height"] == 0);
  auto few = run_cmd(kBin + " data index " + d + " --force --num-classes 1");
  CHECK(few.code != 0);  // CLI range check
  auto forced = run_cmd(kBin + " data index " + d + " --force");
  REQUIRE_MESSAGE(forced.code == 0, forced.all());
  CHECK(manifest(d)["splits"]["train"]["num_classes"] == 2);
}
}

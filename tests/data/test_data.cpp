// Image datasets: ustar shards, manifest, converters, ImageLoader.
#include <doctest/doctest.h>

#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "core/error.h"
#include "core/rng.h"
#include "core/sha256.h"
#include "data/convert.h"
#include "data/dataset_writer.h"
#include "data/image_codec.h"
#include "data/image_loader.h"
#include "data/manifest.h"
#include "data/synthetic.h"
#include "data/tar.h"
#include "data_test_util.h"
#include "skip.h"

using namespace dtrain;
using namespace dtrain::data;
namespace fs = std::filesystem;

namespace {


// Pixel value of generated image `id` at (y, x, c): distinct per image.
uint8_t pixel(int id, int y, int x, int c) { return uint8_t((id * 37 + y * 11 + x * 5 + c * 67) & 0xff); }

// ImageFolder SRC/<class>/img_<k>.png with w x h x c images; returns the ids by class order.
void make_folder(const std::string& src, const std::vector<std::string>& classes, int per_class, int w, int h, int c,
                 int id0 = 0) {
  int id = id0;
  for (const auto& cls : classes) {
    fs::create_directories(fs::path(src) / cls);
    for (int k = 0; k < per_class; ++k, ++id) {
      std::vector<uint8_t> px(size_t(w) * h * c);
      for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x)
          for (int ch = 0; ch < c; ++ch) px[(size_t(y) * w + x) * c + ch] = pixel(id, y, x, ch);
      write_bytes((fs::path(src) / cls / fmt::format("img_{:03d}.png", k)).string(), encode_png(px.data(), w, h, c));
    }
  }
}

// A converted dataset of `n_classes` x `per_class` images (sample i has image id i, label i / per_class).
std::string make_dataset(const std::string& name, int n_classes, int per_class, int w = 8, int h = 6, int c = 3,
                         int shard_size = 7) {
  std::string dir = fresh_dir(name);
  std::vector<std::string> classes;
  for (int i = 0; i < n_classes; ++i) classes.push_back(fmt::format("class{}", i));
  make_folder(dir + "/src", classes, per_class, w, h, c);
  data::ImageFolderSpec a;
  a.src = dir + "/src";
  a.out = dir + "/ds";
  a.shard_size = shard_size;
  convert_image_folder(a);
  return dir + "/ds";
}


std::vector<ImageBatch> take(ImageLoader& l, int n) {
  std::vector<ImageBatch> out(static_cast<size_t>(n));
  for (auto& b : out) l.next(b);
  return out;
}

bool same(const ImageBatch& a, const ImageBatch& b) {
  return a.n == b.n && a.epoch == b.epoch && a.labels == b.labels && a.images.size() == b.images.size() &&
         memcmp(a.images.data(), b.images.data(), a.images.size() * sizeof(float)) == 0;
}

// Hand-made shard: members given as (name, bytes); manifest with one train split.
std::string make_raw_dataset(const std::string& name, const std::vector<std::pair<std::string, std::string>>& members,
                             int64_t samples, int64_t num_classes = 3, int h = 4, int w = 4, int c = 1) {
  std::string root = fresh_dir(name);
  fs::create_directories(root + "/train");
  TarWriter t(root + "/train/000000.tar");
  for (auto& [n, b] : members) t.add(n, b);
  t.finish();
  Manifest m;
  m.splits["train"] = {samples, num_classes, c, h, w,
                       {{"train/000000.tar", samples, sha256_file(root + "/train/000000.tar")}}};
  write_manifest(root + "/manifest.json", m);
  return root;
}

std::string gray_png(int h, int w, uint8_t v) {
  std::vector<uint8_t> px(size_t(h) * w, v);
  return encode_png(px.data(), w, h, 1);
}

// Rewrites the manifest's sha256 of shard 0 to the file's current hash (to get past the
// checksum check and reach the tar parser).
void rehash_shard(const std::string& root) {
  Manifest m = read_manifest(root);
  auto& sh = m.splits.at("train").shards.at(0);
  sh.sha256 = sha256_file(root + "/" + sh.file);
  write_manifest(root + "/manifest.json", m);
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("tar round trip read back by GNU tar and Python tarfile") {
  std::string dir = fresh_dir("tar_roundtrip");
  std::string path = dir + "/a.tar";
  std::string long_name = std::string(120, 'd') + "/" + std::string(90, 'f') + ".bin";
  std::vector<std::pair<std::string, std::string>> members = {
      {"k0.png", "hello"}, {"k0.cls", "3"}, {"empty.txt", ""}, {"block.bin", std::string(512, 'x')},
      {"odd.bin", std::string(513, 'y')}, {long_name, "deep"}};
  {
    TarWriter t(path);
    for (auto& [n, b] : members) t.add(n, b);
    t.finish();
  }
  std::vector<uint8_t> bytes = read_file_bytes(path);
  CHECK(bytes.size() % 512 == 0);
  auto idx = tar_index(bytes.data(), bytes.size(), path);
  REQUIRE(idx.size() == members.size());
  for (size_t i = 0; i < idx.size(); ++i) {
    CHECK(idx[i].name == members[i].first);
    CHECK(std::string(reinterpret_cast<const char*>(bytes.data() + idx[i].offset), idx[i].size) == members[i].second);
  }
  std::string py = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python";
  std::string out = run_capture(
      py + " -c 'import tarfile,sys,hashlib\nwith tarfile.open(sys.argv[1]) as t:\n for m in t.getmembers():\n"
           "  print(m.name, m.size, hashlib.sha256(t.extractfile(m).read()).hexdigest())' " + path);
  std::string expect;
  for (auto& [n, b] : members) expect += fmt::format("{} {} {}\n", n, b.size(), sha256_hex(b.data(), b.size()));
  CHECK(out == expect);
  std::string gnu = run_capture("tar -tf " + path + " 2>&1");
  std::string names;
  for (auto& [n, b] : members) names += n + "\n";
  CHECK(gnu == names);
  std::string key, ext;
  split_key("dir.x/train_000001.mask.png", key, ext);
  CHECK(key == "dir.x/train_000001");
  CHECK(ext == "mask.png");
  expect_user_error([&] { TarWriter(dir + "/b.tar").add(std::string(101, 'n'), "x"); }, {"too long", "b.tar"});
}

TEST_CASE("tar index rejects not-a-tar and truncated and corrupt headers naming the shard") {
  std::string dir = fresh_dir("tar_errors");
  std::string path = dir + "/s.tar";
  {
    TarWriter t(path);
    t.add("a.png", std::string(1000, 'a'));
    t.add("a.cls", "1");
    t.finish();
  }
  std::vector<uint8_t> good = read_file_bytes(path);
  std::string text = "this is not a tar file, just text that goes on for more than one block\n";
  while (text.size() < 2048) text += text;
  expect_user_error([&] { tar_index(reinterpret_cast<const uint8_t*>(text.data()), text.size(), "x/t.tar"); },
                    {"x/t.tar", "not a tar archive"});
  expect_user_error([&] { tar_index(good.data(), 100, path); }, {path, "not a tar archive"});
  expect_user_error([&] { tar_index(good.data(), 1024, path); }, {path, "truncated"});        // inside member data
  expect_user_error([&] { tar_index(good.data(), 512 * 4, path); }, {path, "truncated"});     // label data missing
  expect_user_error([&] { tar_index(good.data(), good.size() - 1024, path); }, {path, "truncated"});  // no end blocks
  std::vector<uint8_t> bad = good;
  bad[512 * 3 + 3] ^= 1;  // name byte of the second header
  expect_user_error([&] { tar_index(bad.data(), bad.size(), path); }, {path, "checksum", "1536"});
  CHECK(tar_index(good.data(), good.size(), path).size() == 2);
}

TEST_CASE("images converter writes shards and manifest and merges splits") {
  std::string root = make_dataset("conv_images", 3, 5);  // 15 samples, shards of 7
  Manifest m = read_manifest(root);
  CHECK(m.classes == std::vector<std::string>{"class0", "class1", "class2"});
  REQUIRE(m.splits.count("train") == 1);
  const SplitInfo& s = m.splits.at("train");
  CHECK(s.samples == 15);
  CHECK(s.num_classes == 3);
  CHECK(s.channels == 3);
  CHECK(s.height == 6);
  CHECK(s.width == 8);
  REQUIRE(s.shards.size() == 3);
  CHECK(s.shards[0].file == "train/000000.tar");
  CHECK(s.shards[2].file == "train/000002.tar");
  CHECK(s.shards[0].samples == 7);
  CHECK(s.shards[2].samples == 1);
  for (auto& sh : s.shards) CHECK(sha256_file(root + "/" + sh.file) == sh.sha256);
  CHECK(verify_split(root, "train", s).empty());
  std::string js = read_text(root + "/manifest.json");
  CHECK(js.find("\"format\": \"dtrain-webdataset\"") != std::string::npos);
  CHECK(js.find("\"version\": 1") != std::string::npos);
  // Members: KEY.png then KEY.cls, keys in order, image bytes kept as encoded.
  auto bytes = read_file_bytes(root + "/train/000000.tar");
  auto idx = tar_index(bytes.data(), bytes.size(), "s");
  REQUIRE(idx.size() == 14);
  CHECK(idx[0].name == "train_000000.png");
  CHECK(idx[1].name == "train_000000.cls");
  CHECK(idx[13].name == "train_000006.cls");
  std::string src_png = read_text(fs::path(root).parent_path().string() + "/src/class0/img_000.png");
  CHECK(std::string(reinterpret_cast<const char*>(bytes.data() + idx[0].offset), idx[0].size) == src_png);
  CHECK(std::string(reinterpret_cast<const char*>(bytes.data() + idx[13].offset), idx[13].size) == "1");
  // No staging directory left behind.
  for (auto& e : fs::directory_iterator(fs::path(root).parent_path()))
    CHECK(e.path().filename().string().find(".tmp") == std::string::npos);

  data::ImageFolderSpec a;
  a.src = fs::path(root).parent_path().string() + "/src";
  a.out = root;
  a.shard_size = 7;
  CHECK(convert_image_folder(a).already_prepared);  // identical: nothing written
  a.split = "test";
  a.shard_size = 100;
  ConvertResult r = convert_image_folder(a);
  CHECK_FALSE(r.already_prepared);
  Manifest m2 = read_manifest(root);
  CHECK(m2.splits.size() == 2);
  CHECK(m2.splits.at("test").shards.size() == 1);
  CHECK(m2.splits.at("train") == s);
  for (auto& e : fs::directory_iterator(root)) CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
  a.shard_size = 3;  // different shards for an existing split
  expect_user_error([&] { convert_image_folder(a); }, {root, "'test' already exists"});
  // Mixed sizes are recorded as 0x0: a loader needs image_size for them.
  std::string bad = fresh_dir("conv_images_bad");
  make_folder(bad + "/src", {"a"}, 2, 8, 6, 1);
  make_folder(bad + "/src", {"b"}, 1, 9, 6, 1, 50);
  a = {};
  a.src = bad + "/src";
  a.out = bad + "/ds";
  convert_image_folder(a);
  CHECK(read_manifest(bad + "/ds").splits.at("train").height == 0);
  CHECK(read_manifest(bad + "/ds").splits.at("train").width == 0);
  ImageLoaderOptions mo;
  mo.root = bad + "/ds", mo.split = "train", mo.batch_size = 3, mo.workers = 0, mo.shuffle = false;
  expect_user_error([&] { ImageLoader l(mo); }, {bad + "/ds", "mixed sizes", "data.image_size"});
  mo.image_size = 5;
  {
    ImageLoader l(mo);
    CHECK(l.height() == 5);
    CHECK(l.width() == 5);
    ImageBatch b;
    l.next(b);
    CHECK(b.n == 3);
    CHECK(b.h == 5);
    CHECK(b.w == 5);
    CHECK(b.images.size() == 3 * 5 * 5);
  }
  fs::remove_all(bad + "/ds");
  // Undecodable files name the file.
  write_bytes(bad + "/src/b/img_000.png", "garbage");
  expect_user_error([&] { convert_image_folder(a); }, {"b/img_000.png", "not a decodable"});
  make_folder(bad + "/src", {"b"}, 1, 8, 6, 1, 50);
  fs::create_directories(bad + "/ds");
  write_bytes(bad + "/ds/notes.txt", "mine");
  expect_user_error([&] { convert_image_folder(a); }, {bad + "/ds", "no manifest.json"});
  CHECK(read_text(bad + "/ds/notes.txt") == "mine");
  a.src = bad + "/nope";
  expect_user_error([&] { convert_image_folder(a); }, {bad + "/nope", "not found"});
}

TEST_CASE("loader eval order returns the source pixels and labels") {
  std::string root = make_dataset("loader_eval", 3, 5);
  auto o = opts(root, 4, false);
  o.workers = 2;
  ImageLoader l(o);
  CHECK(l.samples_per_epoch() == 15);
  CHECK(l.batches_per_epoch() == 4);
  CHECK(l.num_classes() == 3);
  CHECK(l.height() == 6);
  CHECK(l.width() == 8);
  CHECK(l.channels() == 3);
  int id = 0;
  for (int b = 0; b < 4; ++b) {
    ImageBatch batch;
    l.next(batch);
    CHECK(batch.n == (b < 3 ? 4 : 3));
    CHECK(batch.epoch == 0);
    for (int64_t j = 0; j < batch.n; ++j, ++id) {
      CHECK(batch.labels[size_t(j)] == id / 5);
      bool ok = true;
      for (int y = 0; y < 6; ++y)
        for (int x = 0; x < 8; ++x)
          for (int c = 0; c < 3; ++c)
            ok &= batch.images[size_t(((j * 6 + y) * 8 + x) * 3 + c)] == float(pixel(id, y, x, c)) / 255.0f;
      CHECK_MESSAGE(ok, "sample " << id);
    }
  }
  CHECK(l.state() == LoaderState{1, 0});
  ImageBatch again;
  l.next(again);
  CHECK(again.epoch == 1);
  CHECK(again.labels == std::vector<int32_t>{0, 0, 0, 0});
  // mean/std per channel.
  o.mean = {0.5f, 0.25f, 0.f};
  o.std = {0.5f, 2.f, 1.f};
  ImageLoader ln(o);
  ImageBatch nb;
  ln.next(nb);
  for (int c = 0; c < 3; ++c)
    CHECK(nb.images[size_t(c)] == doctest::Approx((pixel(0, 0, 0, c) / 255.0 - o.mean[size_t(c)]) / o.std[size_t(c)]));
  o.mean = {0.5f};
  o.std = {0.5f};
  expect_user_error([&] { ImageLoader bad(o); }, {"one value per channel (3)"});
  o.mean.clear();
  o.std.clear();
  o.num_classes_expected = 10;
  expect_user_error([&] { ImageLoader bad(o); }, {root, "3 classes", "expects 10"});
}

TEST_CASE("loader is deterministic and disjoint across ranks with equal batch counts") {
  std::string root = make_dataset("loader_ranks", 4, 10);  // 40 samples
  auto o = opts(root, 3);
  ImageLoader a(o), b(o);
  auto ba = take(a, 30), bb = take(b, 30);
  for (size_t i = 0; i < ba.size(); ++i) CHECK(same(ba[i], bb[i]));
  CHECK(a.epoch_indices(0) != a.epoch_indices(1));  // reshuffled per epoch
  o.seed = 99;
  ImageLoader c(o);
  CHECK(c.epoch_indices(0) != a.epoch_indices(0));
  for (bool drop_last : {false, true}) {
    std::multiset<int64_t> all;
    std::set<int64_t> batches;
    for (int r = 0; r < 3; ++r) {
      auto ro = opts(root, 4);
      ro.rank = r;
      ro.world_size = 3;
      ro.drop_last = drop_last;
      ImageLoader l(ro);
      CHECK(l.samples_per_epoch() == (drop_last ? 12 : 14));
      batches.insert(l.batches_per_epoch());
      auto idx = l.epoch_indices(2);
      all.insert(idx.begin(), idx.end());
      if (drop_last) {  // rank r's batch b is one process's batch b * 3 + r (its grad_accum 3 micro-batches)
        auto one = opts(root, 4);
        one.drop_last = true;
        const auto whole = ImageLoader(one).epoch_indices(2);
        for (size_t k = 0; k < idx.size(); ++k) CHECK(idx[k] == whole[(k / 4 * 3 + size_t(r)) * 4 + k % 4]);
      }
    }
    CHECK(batches.size() == 1);
    CHECK(*batches.begin() == (drop_last ? 3 : 4));
    std::set<int64_t> uniq(all.begin(), all.end());
    if (drop_last) {
      CHECK(all.size() == 36);  // floor(floor(40/4)/3)*3 whole batches of 4, no repeats
      CHECK(uniq.size() == 36);
    } else {
      CHECK(all.size() == 42);  // padded with 2 repeats of the permutation's head
      CHECK(uniq.size() == 40);
    }
  }
}

TEST_CASE("loader restore gives exactly the uninterrupted sequence") {
  std::string root = make_dataset("loader_resume", 3, 5);
  auto o = opts(root, 4);
  o.crop_padding = 2;
  o.hflip = true;
  ImageLoader full(o);
  auto ref = take(full, 11);  // 4 batches per epoch: crosses two epoch boundaries
  for (int cut : {0, 3, 4, 6}) {
    ImageLoader first(o);
    take(first, cut);
    LoaderState st = first.state();
    CHECK(st == LoaderState{cut / 4, cut % 4});
    ImageLoader resumed(o);
    resumed.restore(st);
    auto rest = take(resumed, 11 - cut);
    for (int i = cut; i < 11; ++i) CHECK_MESSAGE(same(rest[size_t(i - cut)], ref[size_t(i)]), "cut " << cut << " batch " << i);
  }
  // restore between next() calls on a running loader (workers already prefetching)
  ImageLoader l(o);
  take(l, 2);
  l.restore({1, 1});
  ImageBatch b;
  l.next(b);
  CHECK(same(b, ref[5]));
  expect_user_error([&] { l.restore({0, 4}); }, {"batch 4", "4 batches"});
}

TEST_CASE("loader random_resized_crop is identical for 0 or 3 workers and varies by epoch - eval crops the centre") {
  std::string root = make_dataset("loader_rrc", 2, 6, 16, 12, 3);  // 12 RGB 16x12 images
  auto o = opts(root, 4);
  o.image_size = 8;
  o.random_resized_crop = true;
  o.hflip = true;
  std::vector<std::vector<ImageBatch>> runs;
  for (int workers : {0, 3}) {
    o.workers = workers;
    ImageLoader l(o);
    CHECK(l.height() == 8);
    runs.push_back(take(l, 6));  // two epochs of 3 batches
  }
  for (size_t i = 0; i < runs[0].size(); ++i) CHECK(same(runs[0][i], runs[1][i]));
  CHECK(runs[0][0].images.size() == 4 * 8 * 8 * 3);
  // the same source sample in epochs 0 and 1 gets another crop
  ImageLoader l(o);
  auto e0 = l.epoch_indices(0), e1 = l.epoch_indices(1);
  const int64_t id = e0[0];
  const size_t pos1 = size_t(std::find(e1.begin(), e1.end(), id) - e1.begin());
  REQUIRE(pos1 < 12);
  const float* a = runs[0][0].images.data();
  const float* b = runs[0][3 + pos1 / 4].images.data() + (pos1 % 4) * 8 * 8 * 3;
  CHECK(!std::equal(a, a + 8 * 8 * 3, b));
  // evaluation options: Resize(12) + CenterCrop(8), the same every time
  auto ev = opts(root, 4);
  ev.shuffle = false, ev.drop_last = false, ev.image_size = 8, ev.resize_size = 12;
  ImageLoader le(ev);
  ImageBatch x, y;
  le.next(x);
  le.restore({0, 0});
  le.next(y);
  CHECK(same(x, y));
  ev.resize_size = 6;
  expect_user_error([&] { ImageLoader bad(ev); }, {"data.resize_size = 6", "at least data.image_size = 8"});
  ev.resize_size = 0, ev.image_size = 0, ev.random_resized_crop = true;
  expect_user_error([&] { ImageLoader bad(ev); }, {"data.random_resized_crop needs data.image_size"});
}

TEST_CASE("loader augmentation is identical for 0 or 1 or 3 workers and is a crop/flip of the source") {
  std::string root = make_dataset("loader_aug", 2, 6, 5, 4, 1);  // 12 gray 5x4 images
  auto o = opts(root, 5);
  o.crop_padding = 1;
  o.hflip = true;
  std::vector<std::vector<ImageBatch>> runs;
  for (int workers : {0, 1, 3}) {
    o.workers = workers;
    o.prefetch = workers == 3 ? 2 : 4;
    ImageLoader l(o);
    runs.push_back(take(l, 9));
  }
  for (size_t i = 0; i < runs[0].size(); ++i) {
    CHECK(same(runs[0][i], runs[1][i]));
    CHECK(same(runs[0][i], runs[2][i]));
  }
  // Each output is one of the 3x3 crops x 2 flips of its source; several variants occur.
  ImageLoader l(o);
  std::set<int> variants;
  for (int e = 0; e < 3; ++e) {
    auto idx = l.epoch_indices(e);
    for (int bi = 0; bi < 3; ++bi) {
      ImageBatch b;
      l.next(b);
      for (int64_t j = 0; j < b.n; ++j) {
        int id = int(idx[size_t(bi * 5 + j)]);
        int found = -1;
        for (int v = 0; v < 18 && found < 0; ++v) {
          int dy = v / 6, dx = (v / 2) % 3;
          bool flip = v % 2, ok = true;
          for (int y = 0; y < 4; ++y)
            for (int x = 0; x < 5; ++x) {
              int sy = y + dy - 1, sx = (flip ? 4 - x : x) + dx - 1;
              float want = (sy < 0 || sy >= 4 || sx < 0 || sx >= 5) ? 0.f : pixel(id, sy, sx, 0) / 255.0f;
              ok &= b.images[size_t((j * 4 + y) * 5 + x)] == want;
            }
          if (ok) found = v;
        }
        CHECK_MESSAGE(found >= 0, "sample " << id);
        variants.insert(found);
      }
    }
  }
  CHECK(variants.size() >= 6);
}

TEST_CASE("loader errors name the dataset or shard or key") {
  std::string base = fresh_dir("loader_errors");
  expect_user_error([&] { ImageLoader l(opts(base + "/fashion-mnist", 2)); },
                    {base + "/fashion-mnist: dataset not found", "dtrain data fashion-mnist --out " + base + "/fashion-mnist"});
  expect_user_error([&] { ImageLoader l(opts(base + "/pets", 2)); },
                    {base + "/pets: dataset not found", "dtrain data images SRC_DIR --out " + base + "/pets"});
  auto o = opts(make_dataset("loader_errors_ds", 2, 4), 2);
  o.split = "val";
  expect_user_error([&] { ImageLoader l(o); }, {"no split 'val'", "train"});

  // Checksum mismatch: one flipped byte in a shard.
  std::string root = make_dataset("loader_errors_sha", 2, 4);
  std::string shard = root + "/train/000000.tar";
  std::string bytes = read_text(shard);
  bytes[700] ^= 0x40;
  write_bytes(shard, bytes);
  expect_user_error([&] { ImageLoader l(opts(root, 2)); }, {shard, "sha256", "does not match"});
  // Not a tar (manifest hash updated so the tar parser sees it).
  write_bytes(shard, std::string(4096, 'z'));
  rehash_shard(root);
  expect_user_error([&] { ImageLoader l(opts(root, 2)); }, {shard, "not a tar archive"});
  // Truncated tar.
  root = make_dataset("loader_errors_trunc", 2, 4);
  shard = root + "/train/000000.tar";
  fs::resize_file(shard, fs::file_size(shard) - 2000);
  rehash_shard(root);
  expect_user_error([&] { ImageLoader l(opts(root, 2)); }, {shard, "truncated"});

  // Undecodable image: the error comes out of next() on this thread, naming shard and key.
  std::string png = gray_png(4, 4, 9);
  root = make_raw_dataset("loader_errors_decode",
                          {{"s0.png", png}, {"s0.cls", "0"}, {"s1.png", "not a png at all"}, {"s1.cls", "1"},
                           {"s2.png", png}, {"s2.cls", "2"}},
                          3);
  for (int workers : {0, 2}) {
    auto eo = opts(root, 1, false);
    eo.workers = workers;
    ImageLoader l(eo);
    ImageBatch b;
    l.next(b);
    expect_user_error([&] { l.next(b); }, {root + "/train/000000.tar", "sample 's1'", "does not decode"});
    expect_user_error([&] { l.next(b); }, {"sample 's1'"});  // stays failed
  }
  // Wrong size image.
  root = make_raw_dataset("loader_errors_size", {{"s0.png", gray_png(5, 4, 1)}, {"s0.cls", "0"}}, 1);
  expect_user_error([&] { ImageLoader l(opts(root, 1)); ImageBatch b; l.next(b); }, {"sample 's0'", "4x5", "4x4"});
  // Label out of range and not a number, missing label.
  root = make_raw_dataset("loader_errors_label", {{"s0.png", png}, {"s0.cls", "0"}, {"s1.png", png}, {"s1.cls", "12"}}, 2);
  expect_user_error([&] { ImageLoader l(opts(root, 1)); }, {"sample 's1'", "label 12", "0..2"});
  root = make_raw_dataset("loader_errors_label2", {{"s0.png", png}, {"s0.cls", "two"}}, 1);
  expect_user_error([&] { ImageLoader l(opts(root, 1)); }, {"sample 's0'", "'two'", "not an integer"});
  root = make_raw_dataset("loader_errors_nocls", {{"s0.png", png}}, 1);
  expect_user_error([&] { ImageLoader l(opts(root, 1)); }, {"sample 's0'", "no .cls"});
  // Sample count differing from the manifest.
  root = make_raw_dataset("loader_errors_count", {{"s0.png", png}, {"s0.cls", "0"}}, 2);
  expect_user_error([&] { ImageLoader l(opts(root, 1)); }, {"holds 1 samples", "says 2"});
  // Malformed manifest.
  write_bytes(root + "/manifest.json", "{\"format\": \"dtrain-webdataset\", \"version\": 7, \"splits\": {}}");
  expect_user_error([&] { ImageLoader l(opts(root, 1)); }, {"manifest.json", "version 7"});
}
}

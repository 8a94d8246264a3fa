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
#include "skip.h"

using namespace dtrain;
using namespace dtrain::data;
namespace fs = std::filesystem;

namespace {

std::string fresh_dir(const std::string& name) {
  fs::path p = fs::path(DTRAIN_BUILD_DIR) / "test_data" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::string run_capture(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  REQUIRE(f != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  int rc = pclose(f);
  CHECK_MESSAGE(rc == 0, cmd);
  return out;
}

void write_bytes(const std::string& path, const std::string& s) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << s;
}
std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Asserts that fn throws UserError whose message contains every needle.
void expect_user_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const UserError& e) {
    std::string msg = e.what();
    for (const auto& n : needles) CHECK_MESSAGE(msg.find(n) != std::string::npos, "'" << n << "' not in: " << msg);
    CHECK_MESSAGE(msg.find('\n') == std::string::npos, "multi-line message: " << msg);
    return;
  } catch (const std::exception& e) {
    FAIL("expected UserError, got: " << e.what());
  }
  FAIL("expected UserError, nothing thrown");
}

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

ImageLoaderOptions opts(const std::string& root, int64_t batch, bool shuffle = true) {
  ImageLoaderOptions o;
  o.root = root;
  o.split = "train";
  o.batch_size = batch;
  o.shuffle = shuffle;
  o.drop_last = false;
  o.seed = 1234;
  return o;
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
      CHECK(l.samples_per_epoch() == (drop_last ? 13 : 14));
      batches.insert(l.batches_per_epoch());
      auto idx = l.epoch_indices(2);
      all.insert(idx.begin(), idx.end());
    }
    CHECK(batches.size() == 1);
    CHECK(*batches.begin() == (drop_last ? 3 : 4));
    std::set<int64_t> uniq(all.begin(), all.end());
    if (drop_last) {
      CHECK(all.size() == 39);  // floor(40/3)*3, no repeats
      CHECK(uniq.size() == 39);
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

TEST_CASE("IDX reader and Fashion-MNIST converter errors name the file") {
  std::string dir = fresh_dir("idx");
  auto write_gz = [](const std::string& path, const std::vector<uint8_t>& b) {
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, b.data(), unsigned(b.size()));
    gzclose(f);
  };
  write_gz(dir + "/ok.gz", {0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9});
  std::vector<uint32_t> dims;
  CHECK(read_idx_gz(dir + "/ok.gz", 1, dims) == std::vector<uint8_t>{7, 8, 9});
  CHECK(dims == std::vector<uint32_t>{3});
  expect_user_error([&] { read_idx_gz(dir + "/ok.gz", 3, dims); }, {dir + "/ok.gz", "bad IDX magic 00000801"});
  write_gz(dir + "/short.gz", {0, 0, 8, 1, 0, 0, 0, 5, 7, 8, 9});
  expect_user_error([&] { read_idx_gz(dir + "/short.gz", 1, dims); }, {dir + "/short.gz", "truncated", "3 of 5"});
  write_gz(dir + "/long.gz", {0, 0, 8, 1, 0, 0, 0, 2, 7, 8, 9});
  expect_user_error([&] { read_idx_gz(dir + "/long.gz", 1, dims); }, {dir + "/long.gz", "trailing"});
  data::FashionMnistSpec a;
  a.src = dir + "/nowhere";
  a.out = dir + "/out";
  expect_user_error([&] { convert_fashion_mnist(a); }, {dir + "/nowhere", "apt-get install dataset-fashion-mnist"});
  a.src = dir;  // exists, but has no IDX files
  expect_user_error([&] { convert_fashion_mnist(a); }, {dir + "/train-images-idx3-ubyte.gz", "not found"});
  CHECK_FALSE(fs::exists(a.out));
  for (auto& e : fs::directory_iterator(dir)) CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
}

TEST_CASE("Fashion-MNIST subset converts and loads (skipped without dataset-fashion-mnist)") {
  const std::string src = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(src)) {
    SKIP_TEST(src << " not installed (apt-get install dataset-fashion-mnist)");
  }
  std::string dir = fresh_dir("fmnist_subset");
  data::FashionMnistSpec a;
  a.src = src;
  a.out = dir + "/fashion-mnist";
  a.shard_size = 300;
  ConvertResult r = convert_fashion_mnist(a, 700);
  CHECK_FALSE(r.already_prepared);
  Manifest m = read_manifest(a.out);
  CHECK(m.classes.size() == 10);
  CHECK(m.classes[0] == "T-shirt/top");
  CHECK(m.classes[9] == "Ankle boot");
  CHECK(m.splits.at("train").samples == 700);
  CHECK(m.splits.at("train").shards.size() == 3);
  CHECK(m.splits.at("test").samples == 700);
  CHECK(m.splits.at("test").shards[1].file == "test/000001.tar");
  CHECK(convert_fashion_mnist(a, 700).already_prepared);
  // The loader sees exactly the IDX pixels and labels.
  std::vector<uint32_t> idims, ldims;
  auto images = read_idx_gz(src + "/t10k-images-idx3-ubyte.gz", 3, idims);
  auto labels = read_idx_gz(src + "/t10k-labels-idx1-ubyte.gz", 1, ldims);
  CHECK(idims == std::vector<uint32_t>{10000, 28, 28});
  auto o = opts(a.out, 350, false);
  o.split = "test";
  o.num_classes_expected = 10;
  o.channels_expected = 1;
  ImageLoader l(o);
  bool ok = true;
  for (int b = 0; b < 2; ++b) {
    ImageBatch batch;
    l.next(batch);
    for (int64_t j = 0; j < batch.n; ++j) {
      size_t i = size_t(b * 350 + j);
      ok &= batch.labels[size_t(j)] == labels[i];
      for (size_t p = 0; p < 784; ++p) ok &= batch.images[size_t(j) * 784 + p] == images[i * 784 + p] / 255.0f;
    }
  }
  CHECK(ok);
  // A damaged output is refused, not silently reused.
  std::string shard = a.out + "/train/000001.tar";
  write_bytes(shard, read_text(shard).substr(0, 1000));
  expect_user_error([&] { convert_fashion_mnist(a, 700); }, {a.out, "not a complete Fashion-MNIST", "000001.tar"});
}

TEST_CASE("synthetic loader shape and determinism and resume") {
  SyntheticImageLoader s(4, 3, 5, 2, 7, 42, 10);
  ImageBatch a, b;
  s.next(a);
  CHECK(a.images.size() == size_t(4 * 3 * 5 * 2));
  CHECK(a.labels.size() == 4);
  for (int32_t x : a.labels) CHECK((x >= 0 && x < 7));
  s.next(b);
  CHECK(a.images != b.images);
  SyntheticImageLoader t(4, 3, 5, 2, 7, 42, 10);
  t.restore({0, 1});
  ImageBatch c;
  t.next(c);
  CHECK(c.images == b.images);
  CHECK(c.labels == b.labels);
}
}

TEST_SUITE("integration") {
TEST_CASE("Fashion-MNIST full conversion and loader throughput") {
  const std::string src = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(src)) {
    SKIP_TEST(src << " not installed (apt-get install dataset-fashion-mnist)");
  }
  std::string dir = fresh_dir("fmnist_full");
  data::FashionMnistSpec a;
  a.src = src;
  a.out = dir + "/fashion-mnist";
  ConvertResult r = convert_fashion_mnist(a);
  MESSAGE("Fashion-MNIST conversion: " << r.seconds << " s");
  Manifest m = read_manifest(a.out);
  CHECK(m.splits.at("train").samples == 60000);
  CHECK(m.splits.at("train").shards.size() == 6);
  CHECK(m.splits.at("test").samples == 10000);
  auto o = opts(a.out, 128);
  o.drop_last = true;
  o.workers = 2;
  o.crop_padding = 4;
  o.hflip = true;
  auto t0 = std::chrono::steady_clock::now();
  ImageLoader l(o);
  double open_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t0 = std::chrono::steady_clock::now();
  ImageBatch b;
  int64_t n = 0;
  for (int64_t i = 0; i < l.batches_per_epoch(); ++i) {
    l.next(b);
    n += b.n;
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("loader open (sha256 + index): " << open_s << " s; 1 epoch, 2 workers: " << n / s << " images/s");
  CHECK(n == 60000 / 128 * 128);
  fs::remove_all(dir);  // 160 MB
}
}

TEST_SUITE("unit") {
// torchvision's Resize(S) + CenterCrop(S) geometry: short side S, long side int(S * long /
// short), offsets round((scaled - S) / 2) with Python's halves-to-even rounding.
TEST_CASE("image_size: resize and centre-crop geometry is torchvision's") {
  auto p = plan_resize_center_crop(500, 375, 256, 256);
  CHECK(p.height == 256);
  CHECK(p.width == 341);
  CHECK(p.left == 42);  // round(42.5) = 42
  CHECK(p.top == 0);
  p = plan_resize_center_crop(375, 500, 256, 256);
  CHECK((p.width == 256 && p.height == 341 && p.top == 42 && p.left == 0));
  p = plan_resize_center_crop(225, 224, 224, 224);
  CHECK((p.width == 225 && p.height == 224 && p.left == 0));  // round(0.5) = 0
  p = plan_resize_center_crop(227, 224, 224, 224);
  CHECK((p.width == 227 && p.left == 2));  // round(1.5) = 2
  p = plan_resize_center_crop(30, 30, 224, 224);
  CHECK((p.width == 224 && p.height == 224 && p.top == 0 && p.left == 0));
  p = plan_resize_center_crop(500, 375, 256, 224);  // ImageNet evaluation: Resize(256) + CenterCrop(224)
  CHECK((p.height == 256 && p.width == 341 && p.top == 16 && p.left == 58));  // round(58.5) = 58
}

TEST_CASE("random_resized_crop: boxes fit - cover the scale and ratio range - fall back to the centre") {
  Rng rng(3, 9);
  double min_frac = 1, max_frac = 0, min_ratio = 10, max_ratio = 0;
  for (int i = 0; i < 2000; ++i) {
    const Box b = random_resized_box(200, 120, rng, 0.08);
    REQUIRE((b.w > 0 && b.h > 0 && b.x >= 0 && b.y >= 0 && b.x + b.w <= 200 && b.y + b.h <= 120));
    const double frac = double(b.w) * b.h / (200.0 * 120.0), ratio = double(b.w) / b.h;
    min_frac = std::min(min_frac, frac), max_frac = std::max(max_frac, frac);
    min_ratio = std::min(min_ratio, ratio), max_ratio = std::max(max_ratio, ratio);
  }
  CHECK(min_frac < 0.1);
  CHECK(max_frac > 0.7);
  CHECK(min_ratio == doctest::Approx(0.75).epsilon(0.05));
  CHECK(max_ratio == doctest::Approx(4.0 / 3).epsilon(0.05));
  // a 1000x10 strip: no try fits a 3/4..4/3 box of >= 8% of it, the fallback keeps ratio 4/3
  Rng r2(1);
  const Box f = random_resized_box(1000, 10, r2, 0.5);
  CHECK((f.h == 10 && f.w == 13 && f.x == (1000 - 13) / 2 && f.y == 0));
  // masks take the box by nearest neighbour
  std::vector<uint8_t> mask(size_t(20) * 10), out;
  for (int y = 0; y < 10; ++y)
    for (int x = 0; x < 20; ++x) mask[size_t(y) * 20 + x] = uint8_t(x < 10 ? 1 : 4);
  resize_box_nearest(mask.data(), 20, Box{5, 2, 10, 6}, 4, out);
  REQUIRE(out.size() == 16);
  for (int y = 0; y < 4; ++y) CHECK((out[size_t(y) * 4] == 1 && out[size_t(y) * 4 + 3] == 4));
}

TEST_CASE("image_size: pixels - a crop is exact / a constant stays constant / masks keep their classes") {
  const int S = 6;
  // short side already S: only the centre crop, pixel for pixel
  std::vector<uint8_t> wide(size_t(2 * S) * S * 3), out;
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = uint8_t(i * 7);
  resize_center_crop(wide.data(), 2 * S, S, 3, S, S, out);
  REQUIRE(out.size() == size_t(S * S * 3));
  for (int y = 0; y < S; ++y)
    for (int x = 0; x < S; ++x)
      for (int c = 0; c < 3; ++c)
        CHECK(out[(size_t(y) * S + x) * 3 + c] == wide[(size_t(y) * 2 * S + x + S / 2) * 3 + c]);
  std::vector<uint8_t> flat(size_t(17) * 11, 93);
  resize_center_crop(flat.data(), 17, 11, 1, S, S, out);
  for (uint8_t v : out) CHECK(v == 93);
  resize_center_crop(flat.data(), 3, 2, 1, 9, 9, out);  // enlarging
  for (uint8_t v : out) CHECK(v == 93);
  // left half 0, right half 200: the resized image keeps dark left columns, bright right ones
  std::vector<uint8_t> halves(size_t(40) * 40, 0);
  for (int y = 0; y < 40; ++y)
    for (int x = 20; x < 40; ++x) halves[size_t(y) * 40 + x] = 200;
  resize_center_crop(halves.data(), 40, 40, 1, 8, 8, out);
  for (int y = 0; y < 8; ++y) {
    CHECK(out[size_t(y) * 8] == 0);
    CHECK(out[size_t(y) * 8 + 7] == 200);
    CHECK(out[size_t(y) * 8 + 3] < out[size_t(y) * 8 + 4]);
  }
  std::vector<uint8_t> mask(size_t(13) * 9), mout;
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = uint8_t(i % 3 == 0 ? 2 : 5);
  resize_center_crop_nearest(mask.data(), 13, 9, 4, 4, mout);
  REQUIRE(mout.size() == 16);
  for (uint8_t v : mout) CHECK((v == 2 || v == 5));
}
}

TEST_SUITE("integration") {
// The same pixels through torchvision: PIL image -> Resize(S) (bilinear, antialiased) ->
// CenterCrop(S). stb's triangle filter is the same filter as PIL's bilinear; they differ
// in fixed-point rounding and edge handling only.
TEST_CASE("image_size: resize and centre crop agree with torchvision's Resize + CenterCrop") {
  const std::string dir = fresh_dir("resize_tv");
  struct Shape {
    int w, h, resize, size;
  };
  for (const Shape& sh : {Shape{97, 61, 32, 32}, Shape{40, 75, 24, 24}, Shape{20, 14, 28, 28}, Shape{90, 70, 36, 32}}) {
    std::vector<uint8_t> px(size_t(sh.w) * sh.h * 3), out;
    Rng rng(5, stream_id(uint64_t(sh.w)));
    for (int y = 0; y < sh.h; ++y)
      for (int x = 0; x < sh.w; ++x)
        for (int c = 0; c < 3; ++c)  // smooth structure plus noise
          px[(size_t(y) * sh.w + x) * 3 + c] =
              uint8_t(std::min(255.0, 40 + 80 * std::sin(0.21 * x + c) * std::cos(0.13 * y) + 80 + 30 * rng.uniform()));
    write_bytes(dir + "/in.png", encode_png(px.data(), sh.w, sh.h, 3));
    resize_center_crop(px.data(), sh.w, sh.h, 3, sh.resize, sh.size, out);
    write_bytes(dir + "/ours.raw", std::string(out.begin(), out.end()));
    const std::string py = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python";
    const std::string script =
        "import sys, numpy as np\n"
        "from PIL import Image\n"
        "import torchvision.transforms as T\n"
        "d, s = sys.argv[1], int(sys.argv[2])\n"
        "img = Image.open(d + '/in.png').convert('RGB')\n"
        "r = int(sys.argv[3])\n"
        "ref = np.asarray(T.CenterCrop(s)(T.Resize(r, interpolation=T.InterpolationMode.BILINEAR)(img))).astype(int)\n"
        "ours = np.fromfile(d + '/ours.raw', dtype=np.uint8).reshape(ref.shape).astype(int)\n"
        "diff = np.abs(ref - ours)\n"
        "print('max', diff.max(), 'mean', diff.mean())\n";
    write_bytes(dir + "/cmp.py", script);
    const std::string res = run_capture(py + " " + dir + "/cmp.py " + dir + " " + std::to_string(sh.size) + " " +
                                        std::to_string(sh.resize) + " 2>&1");
    INFO(sh.w << "x" << sh.h << " -> " << sh.size << ": " << res);
    REQUIRE(res.rfind("max ", 0) == 0);
    const int max_diff = std::atoi(res.c_str() + 4);
    const double mean_diff = std::atof(res.c_str() + res.find("mean") + 5);
    MESSAGE(sh.w << "x" << sh.h << " -> " << sh.size << ": " << res);
    CHECK(max_diff <= 2);
    CHECK(mean_diff < 0.5);
  }
}
}

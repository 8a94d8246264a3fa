// Fashion-MNIST (IDX reader, converter, loader) and the synthetic loader.
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

TEST_SUITE("unit") {
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

TEST_CASE("Fashion-MNIST --holdout cuts a val split from the end of the training images") {
  const std::string src = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(src)) {
    SKIP_TEST(src << " not installed (apt-get install dataset-fashion-mnist)");
  }
  std::string dir = fresh_dir("fmnist_holdout");
  data::FashionMnistSpec a;
  a.src = src;
  a.out = dir + "/fm";
  a.shard_size = 300;
  a.holdout = 200;
  ConvertResult r = convert_fashion_mnist(a, 700);
  Manifest m = read_manifest(a.out);
  CHECK(m.splits.at("train").samples == 500);
  CHECK(m.splits.at("val").samples == 200);
  CHECK(m.splits.at("test").samples == 700);
  CHECK(r.splits.size() == 3);
  // val holds training images 500..699, with their labels, in order
  std::vector<uint32_t> idims, ldims;
  auto images = read_idx_gz(src + "/train-images-idx3-ubyte.gz", 3, idims);
  auto labels = read_idx_gz(src + "/train-labels-idx1-ubyte.gz", 1, ldims);
  auto o = opts(a.out, 200, false);
  o.split = "val";
  o.num_classes_expected = 10;
  o.channels_expected = 1;
  ImageLoader l(o);
  ImageBatch batch;
  l.next(batch);
  bool ok = batch.n == 200;
  for (int64_t j = 0; j < batch.n && ok; ++j) {
    const size_t i = size_t(500 + j);
    ok &= batch.labels[size_t(j)] == labels[i];
    for (size_t p = 0; p < 784; ++p) ok &= batch.images[size_t(j) * 784 + p] == images[i * 784 + p] / 255.0f;
  }
  CHECK(ok);
  CHECK(convert_fashion_mnist(a, 700).already_prepared);
  // the same directory asked for another holdout is refused, naming both
  a.holdout = 100;
  expect_user_error([&] { convert_fashion_mnist(a, 700); }, {a.out, "200 held-out", "--holdout 100"});
  a.holdout = 0;
  expect_user_error([&] { convert_fashion_mnist(a, 700); }, {a.out, "200 held-out", "--holdout 0"});
  // holding out every training image is refused
  a.out = dir + "/fm2";
  a.holdout = 700;
  expect_user_error([&] { convert_fashion_mnist(a, 700); }, {"--holdout 700", "only 700 images"});
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

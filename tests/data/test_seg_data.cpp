// Segmentation data: the shapes generator (deterministic, masks consistent), the folder
// converter (bad pairs rejected with the file named), SegLoader (shapes, augmentation
// applied identically to image and mask, worker-count independence, state/restore, bad
// mask values named).
#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include <unistd.h>

#include "core/error.h"
#include "data/image_codec.h"
#include "data/seg_loader.h"
#include "data/shapes.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {
struct Tmp {
  fs::path p;
  Tmp() {
    p = fs::temp_directory_path() / ("dtrain_seg_" + std::to_string(getpid()) + "_" + std::to_string(rand()));
    fs::create_directories(p);
  }
  ~Tmp() { std::error_code ec; fs::remove_all(p, ec); }
};

std::string make_shapes(const fs::path& dir, int count = 24, int size = 16) {
  data::ShapesSpec a;
  a.out = (dir / "shapes").string();
  a.count = count, a.size = size, a.classes = 4, a.seed = 3, a.val_fraction = 0.25;
  data::write_shapes_dataset(a);
  return a.out;
}

void write_png(const fs::path& p, int w, int h, int c, uint8_t v) {
  std::vector<uint8_t> px(size_t(w * h * c), v);
  std::string s = data::encode_png(px.data(), w, h, c);
  FILE* f = fopen(p.c_str(), "wb");
  fwrite(s.data(), 1, s.size(), f);
  fclose(f);
}
// An image folder img/ and a mask folder mask/ under `root` with pairs a (w0 x h0: image value
// 100, class 2) and b (w1 x h1: value 50, class 1); returns the converter's arguments.
data::SegmentationSpec seg_folders(const fs::path& root, int w0, int h0, int w1, int h1) {
  fs::create_directories(root / "img");
  fs::create_directories(root / "mask");
  write_png(root / "img" / "a.png", w0, h0, 3, 100);
  write_png(root / "mask" / "a.png", w0, h0, 1, 2);
  write_png(root / "img" / "b.png", w1, h1, 3, 50);
  write_png(root / "mask" / "b.png", w1, h1, 1, 1);
  return {(root / "img").string(), (root / "mask").string(), (root / "out").string(), "train"};
}
}  // namespace

TEST_SUITE("unit") {

TEST_CASE("shapes generator: deterministic samples with consistent masks") {
  std::vector<uint8_t> a, am, b, bm;
  data::make_shape_sample(5, 7, 32, 4, a, am);
  data::make_shape_sample(5, 7, 32, 4, b, bm);
  CHECK(a == b);
  CHECK(am == bm);
  data::make_shape_sample(5, 8, 32, 4, b, bm);
  CHECK(a != b);
  int fg = 0;
  for (uint8_t v : am) {
    REQUIRE(v < 4);
    fg += v != 0;
  }
  CHECK(fg > 0);
  CHECK(fg < 32 * 32);
  CHECK(data::shape_class_names(5) ==
        std::vector<std::string>{"background", "circle", "rectangle", "triangle", "circle2"});
}

TEST_CASE("shapes dataset -> SegLoader: batches / augmentation / determinism / resume") {
  Tmp t;
  std::string root = make_shapes(t.p);
  data::Manifest m = data::read_manifest(root);
  CHECK(m.splits.at("train").samples == 18);
  CHECK(m.splits.at("val").samples == 6);
  CHECK(m.splits.at("train").num_classes == 4);

  data::SegLoaderOptions o;
  o.root = root, o.split = "train", o.batch_size = 4, o.shuffle = false, o.workers = 0;
  data::SegLoader plain(o);
  CHECK(plain.batches_per_epoch() == 4);
  data::SegBatch p;
  plain.next(p);
  REQUIRE(p.n == 4);
  CHECK(p.images.size() == size_t(4 * 16 * 16 * 3));
  CHECK(p.labels.size() == size_t(4 * 16 * 16));

  // flips: image and mask of each sample flipped together
  o.hflip = o.vflip = true;
  o.workers = 2;
  data::SegLoader aug(o);
  data::SegBatch q;
  aug.next(q);
  int flipped = 0;
  for (int j = 0; j < 4; ++j) {
    bool found = false;
    for (int hf = 0; hf < 2 && !found; ++hf)
      for (int vf = 0; vf < 2 && !found; ++vf) {
        bool eq = true;
        for (int y = 0; y < 16 && eq; ++y)
          for (int x = 0; x < 16 && eq; ++x) {
            int sy = vf ? 15 - y : y, sx = hf ? 15 - x : x;
            size_t a = size_t((j * 16 + y) * 16 + x), b = size_t((j * 16 + sy) * 16 + sx);
            eq = q.labels[a] == p.labels[b] && q.images[a * 3] == p.images[b * 3] &&
                 q.images[a * 3 + 2] == p.images[b * 3 + 2];
          }
        if (eq) found = true, flipped += hf || vf;
      }
    CHECK_MESSAGE(found, "sample " << j << " is not a flip of the original");
  }
  CHECK(flipped > 0);

  // crop padding: same results with 0 and 3 workers; state/restore continues exactly
  o.crop_padding = 3, o.shuffle = true, o.workers = 0;
  data::SegLoader a0(o);
  o.workers = 3;
  data::SegLoader a3(o);
  std::vector<data::SegBatch> seq;
  for (int i = 0; i < 6; ++i) {
    data::SegBatch x, y;
    a0.next(x);
    a3.next(y);
    CHECK(x.images == y.images);
    CHECK(x.labels == y.labels);
    seq.push_back(x);
  }
  data::SegLoader r(o);
  r.restore(data::LoaderState{1, 1});  // batch 5 = epoch 1, batch 1
  data::SegBatch z;
  r.next(z);
  CHECK(z.images == seq[5].images);
  CHECK(z.labels == seq[5].labels);
  CHECK(r.state() == data::LoaderState{1, 2});
}

TEST_CASE("SegLoader: mask value >= num_classes names the key and value") {
  Tmp t;
  std::string root = make_shapes(t.p, 8, 16);
  data::SegLoaderOptions o;
  o.root = root, o.split = "train", o.batch_size = 6, o.shuffle = false, o.workers = 1;
  o.num_classes = 1;  // every shape pixel is out of range
  data::SegLoader l(o);
  data::SegBatch b;
  try {
    l.next(b);
    FAIL("expected UserError");
  } catch (const UserError& e) {
    std::string msg = e.what();
    CHECK(msg.find("train_0000") != std::string::npos);
    CHECK(msg.find("mask value") != std::string::npos);
  }
}

TEST_CASE("SegLoader: a resume position outside the epoch and bad options are UserErrors (LoaderCore's checks)") {
  Tmp t;
  std::string root = make_shapes(t.p, 16, 16);  // 12 train samples: 3 batches of 4
  data::SegLoaderOptions o;
  o.root = root, o.split = "train", o.batch_size = 4, o.shuffle = false, o.workers = 2;
  data::SegLoader l(o);
  CHECK(l.batches_per_epoch() == 3);
  CHECK_THROWS_WITH_AS(l.restore(data::LoaderState{0, 3}), doctest::Contains("3 batches"), UserError);
  CHECK_THROWS_AS(l.restore(data::LoaderState{-1, 0}), UserError);
  l.restore(data::LoaderState{1, 2});
  data::SegBatch b;
  l.next(b);
  CHECK(l.state() == data::LoaderState{2, 0});
  o.workers = -1;
  CHECK_THROWS_WITH_AS(data::SegLoader{o}, doctest::Contains("workers"), UserError);
  o.workers = 0, o.prefetch = 0;
  CHECK_THROWS_WITH_AS(data::SegLoader{o}, doctest::Contains("prefetch"), UserError);
}

TEST_CASE("data segmentation: a split name that would break the sample keys is refused") {
  Tmp t;
  data::SegmentationSpec a = seg_folders(t.p, 8, 6, 8, 6);
  a.split = "v.1";  // keys v.1_000000 would read back as key "v", extension "1_000000.png"
  CHECK_THROWS_WITH_AS(data::convert_segmentation(a), doctest::Contains("must not contain '.'"), UserError);
  CHECK_FALSE(fs::exists(a.out));
}

TEST_CASE("data segmentation: folder pairs / size mismatch and missing mask") {
  Tmp t;
  data::SegmentationSpec a = seg_folders(t.p, 8, 6, 8, 6);
  data::convert_segmentation(a);
  data::Manifest m = data::read_manifest(a.out);
  CHECK(m.splits.at("train").samples == 2);
  CHECK(m.splits.at("train").num_classes == 3);
  data::SegLoaderOptions o;
  o.root = a.out, o.split = "train", o.batch_size = 2, o.shuffle = false, o.workers = 0;
  data::SegLoader l(o);
  data::SegBatch b;
  l.next(b);
  CHECK(b.labels[0] == 2);
  CHECK(b.labels[size_t(6 * 8)] == 1);
  CHECK(b.images[0] == doctest::Approx(100.f / 255));

  write_png(t.p / "mask" / "b.png", 7, 6, 1, 1);
  a.out = (t.p / "out2").string();
  try {
    data::convert_segmentation(a);
    FAIL("expected UserError");
  } catch (const UserError& e) {
    std::string msg = e.what();
    CHECK(msg.find("b.png") != std::string::npos);
    CHECK(msg.find("7x6") != std::string::npos);
  }
  fs::remove(t.p / "mask" / "b.png");
  CHECK_THROWS_AS(data::convert_segmentation(a), UserError);
  CHECK_FALSE(fs::exists(a.out));
}

TEST_CASE("data segmentation: images of mixed sizes load with image_size and masks keep their classes") {
  Tmp t;
  data::SegmentationSpec a = seg_folders(t.p, 12, 6, 5, 9);
  data::convert_segmentation(a);
  CHECK(data::read_manifest(a.out).splits.at("train").height == 0);
  data::SegLoaderOptions o;
  o.root = a.out, o.split = "train", o.batch_size = 2, o.shuffle = false, o.workers = 0;
  CHECK_THROWS_WITH_AS(data::SegLoader{o}, doctest::Contains("data.image_size"), UserError);
  o.image_size = 4;
  data::SegLoader l(o);
  data::SegBatch b;
  l.next(b);
  CHECK((b.n == 2 && b.h == 4 && b.w == 4));
  for (int i = 0; i < 16; ++i) {
    CHECK(b.labels[size_t(i)] == 2);
    CHECK(b.labels[size_t(16 + i)] == 1);
  }
  CHECK(b.images[0] == doctest::Approx(100.f / 255));
}

}  // TEST_SUITE("unit")

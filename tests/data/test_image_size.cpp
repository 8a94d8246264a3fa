// Image geometry: torchvision's Resize + CenterCrop and RandomResizedCrop boxes, and the
// pixels they give (against torchvision itself).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/rng.h"
#include "data/image_codec.h"
#include "data/image_loader.h"
#include "data_test_util.h"
#include "skip.h"

using namespace dtrain;
using namespace dtrain::data;
namespace fs = std::filesystem;

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

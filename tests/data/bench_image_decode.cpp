// Image decode speed, old decoder (stb_image, compiled here) against the new ones
// (decode_image: libjpeg-turbo, libpng), side by side in one process on one thread, on the
// ImageFolder recipes' kind of input: ImageNet-sized (500x375) 4:2:0 photos as JPEG, and the
// same as PNG. Skipped by default; run with
//   ./build/dtrain_tests -ts=bench -tc='bench: image*' --no-skip
// DTRAIN_BENCH_IMAGES (default 300) images, best of DTRAIN_BENCH_REPS (default 5) passes.
// With DTRAIN_BENCH_TREE=DIR it also writes the JPEGs as an ImageFolder tree DIR/<class>/
// (10 classes) for timing `dtrain data images` (docs/benchmarks.md).
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "data/image_codec.h"
#include "image_writers.h"

#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_NO_STDIO
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#include <stb/stb_image.h>

using namespace dtrain::data;

namespace {

int env_int(const char* name, int dflt) {
  const char* e = std::getenv(name);
  return e && *e ? std::max(1, std::atoi(e)) : dflt;
}

// A photo-like 500x375 RGB image: smooth shapes, edges and mild noise (q90 JPEGs of ~60-120 KB).
std::vector<uint8_t> photo(int w, int h, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  float cx[3], cy[3], r[3], col[3][3];
  for (int k = 0; k < 3; ++k) {
    cx[k] = u(rng) * float(w), cy[k] = u(rng) * float(h), r[k] = 40.f + 120.f * u(rng);
    for (auto& c : col[k]) c = 255.f * u(rng);
  }
  const float fx = 0.02f + 0.1f * u(rng), fy = 0.02f + 0.1f * u(rng);
  std::vector<uint8_t> px(size_t(w) * size_t(h) * 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) {
        float v = 90.f + 60.f * std::sin(float(x) * fx + float(c)) * std::cos(float(y) * fy) + float(y) * 0.2f;
        for (int k = 0; k < 3; ++k)
          if ((float(x) - cx[k]) * (float(x) - cx[k]) + (float(y) - cy[k]) * (float(y) - cy[k]) < r[k] * r[k])
            v = 0.5f * v + 0.5f * col[k][c];
        v += float(int(rng() % 24)) - 12.f;
        px[(size_t(y) * size_t(w) + size_t(x)) * 3 + size_t(c)] = uint8_t(std::clamp(v, 0.f, 255.f));
      }
  return px;
}

double seconds(const std::function<void()>& f) {
  auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_SUITE("bench") {
TEST_CASE("bench: image decode stb_image vs libjpeg-turbo and libpng" * doctest::skip()) {
  const int n = env_int("DTRAIN_BENCH_IMAGES", 300), reps = env_int("DTRAIN_BENCH_REPS", 5);
  const int w = 500, h = 375;
  std::vector<std::string> jpgs, pngs, small;
  size_t jpg_bytes = 0, png_bytes = 0;
  for (int i = 0; i < n; ++i) {
    const auto px = photo(w, h, uint32_t(i));
    jpgs.push_back(test_images::jpeg(px.data(), w, h, 3, {90, false, 2, 2, 0}));
    pngs.push_back(encode_png(px.data(), w, h, 3));
    jpg_bytes += jpgs.back().size();
    png_bytes += pngs.back().size();
  }
  for (int i = 0; i < 20 * n; ++i) {  // Fashion-MNIST's kind: 28x28 gray PNGs
    const auto px = test_images::content(28, 28, 1, uint32_t(i));
    small.push_back(encode_png(px.data(), 28, 28, 1));
  }
  if (const char* tree = std::getenv("DTRAIN_BENCH_TREE")) {
    for (int i = 0; i < n; ++i) {
      const std::string dir = fmt::format("{}/class{}", tree, i % 10);
      std::filesystem::create_directories(dir);
      std::ofstream(fmt::format("{}/img_{:05d}.jpg", dir, i), std::ios::binary) << jpgs[size_t(i)];
    }
  }
  auto stb = [&](const std::vector<std::string>& files, int c) {
    size_t sum = 0;
    for (const auto& f : files) {
      int x = 0, y = 0, k = 0;
      stbi_uc* p = stbi_load_from_memory(reinterpret_cast<const stbi_uc*>(f.data()), int(f.size()), &x, &y, &k, c);
      REQUIRE(p != nullptr);
      sum += p[size_t(x) * size_t(y) * size_t(c) / 2];
      stbi_image_free(p);
    }
    return sum;
  };
  std::vector<uint8_t> px;
  auto ours = [&](const std::vector<std::string>& files, int c) {
    size_t sum = 0;
    for (const auto& f : files) {
      ImageInfo info;
      std::string why;
      REQUIRE(decode_image(reinterpret_cast<const uint8_t*>(f.data()), f.size(), c, px, info, why));
      sum += px[px.size() / 2];
    }
    return sum;
  };
  auto check = [&](const std::vector<std::string>& files) {
    ImageInfo info;
    std::string why;
    for (const auto& f : files) REQUIRE(check_image(reinterpret_cast<const uint8_t*>(f.data()), f.size(), info, why, px));
  };
  // interleaved passes, best of reps each
  double best[7] = {1e30, 1e30, 1e30, 1e30, 1e30, 1e30, 1e30};
  for (int r = 0; r < reps; ++r) {
    best[0] = std::min(best[0], seconds([&] { stb(jpgs, 3); }));
    best[1] = std::min(best[1], seconds([&] { ours(jpgs, 3); }));
    best[2] = std::min(best[2], seconds([&] { check(jpgs); }));
    best[3] = std::min(best[3], seconds([&] { stb(pngs, 3); }));
    best[4] = std::min(best[4], seconds([&] { ours(pngs, 3); }));
    best[5] = std::min(best[5], seconds([&] { stb(small, 1); }));
    best[6] = std::min(best[6], seconds([&] { ours(small, 1); }));
  }
  auto ms = [&](double s) { return 1e3 * s / n; };
  MESSAGE(fmt::format("{} images {}x{}: JPEG q90 4:2:0 avg {:.1f} KB, PNG avg {:.1f} KB; best of {} passes, one thread",
                      n, w, h, double(jpg_bytes) / n / 1024, double(png_bytes) / n / 1024, reps));
  MESSAGE(fmt::format("JPEG -> RGB: stb_image {:.2f} ms/image ({:.0f}/s), libjpeg-turbo {:.2f} ms/image ({:.0f}/s): {:.2f}x",
                      ms(best[0]), n / best[0], ms(best[1]), n / best[1], best[0] / best[1]));
  MESSAGE(fmt::format("JPEG check_image (data images' check: gray at 1/8 scale): {:.2f} ms/image", ms(best[2])));
  MESSAGE(fmt::format("PNG -> RGB: stb_image {:.2f} ms/image, libpng {:.2f} ms/image: {:.2f}x", ms(best[3]),
                      ms(best[4]), best[3] / best[4]));
  MESSAGE(fmt::format("PNG 28x28 gray ({} images): stb_image {:.2f} us/image, libpng {:.2f} us/image: {:.2f}x",
                      small.size(), 1e6 * best[5] / double(small.size()), 1e6 * best[6] / double(small.size()),
                      best[5] / best[6]));
}
}

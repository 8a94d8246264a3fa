// Image decoding (data/image_decode.cpp): PNG bit-identical to stb_image (what the loaders
// decoded before libpng) for every colour type, bit depth, interlacing and transparency; JPEG
// bit-identical to PIL (the same libjpeg-turbo with the same settings); corrupt, truncated and
// oversized inputs refused with a one-line reason.
#include <doctest/doctest.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/image_codec.h"
#include "image_writers.h"
#include "run_cmd.h"
#include "skip.h"

// The reference for PNG: stb_image, compiled here (static, so apart from the library's copy).
#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_NO_STDIO
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#include <stb/stb_image.h>

using namespace dtrain::data;
namespace fs = std::filesystem;
namespace ti = test_images;

namespace {

const std::string kPy = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python";

std::string fresh(const std::string& name) {
  const std::string d = std::string(DTRAIN_BUILD_DIR) + "/test_image_decode/" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

const uint8_t* u8(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

struct Decoded {
  bool ok = false;
  ImageInfo info;
  std::vector<uint8_t> px;
  std::string why;
};
Decoded decode(const std::string& bytes, int channels) {
  Decoded d;
  d.ok = decode_image(u8(bytes), bytes.size(), channels, d.px, d.info, d.why);
  return d;
}

// Expects the bytes refused by decode_image (and image_info when `header` is set) with a
// one-line reason holding every needle.
void expect_refused(const std::string& bytes, bool header, const std::vector<std::string>& needles) {
  for (int c : {1, 3}) {
    Decoded d = decode(bytes, c);
    CHECK_FALSE(d.ok);
    CHECK(d.why.find('\n') == std::string::npos);
    for (const auto& n : needles) CHECK_MESSAGE(d.why.find(n) != std::string::npos, "'" << n << "' not in: " << d.why);
  }
  ImageInfo ii;
  std::string why;
  CHECK(image_info(u8(bytes), bytes.size(), ii, why) == !header);
  if (header)
    for (const auto& n : needles) CHECK_MESSAGE(why.find(n) != std::string::npos, "'" << n << "' not in: " << why);
}

void set_be32(std::string& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + size_t(i)] = char((v >> (24 - 8 * i)) & 0xff);
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("image decode: PNG of every colour type and bit depth and interlacing is bit-identical to stb_image") {
  struct Layout {
    int type;
    std::vector<int> depths;
    bool can_trns;
  };
  const std::vector<Layout> layouts = {{PNG_COLOR_TYPE_GRAY, {1, 2, 4, 8, 16}, true},
                                       {PNG_COLOR_TYPE_GRAY_ALPHA, {8, 16}, false},
                                       {PNG_COLOR_TYPE_RGB, {8, 16}, true},
                                       {PNG_COLOR_TYPE_PALETTE, {1, 2, 4, 8}, true},
                                       {PNG_COLOR_TYPE_RGB_ALPHA, {8, 16}, false}};
  int files = 0;
  uint32_t seed = 1;
  for (const auto& l : layouts)
    for (int depth : l.depths)
      for (bool interlace : {false, true})
        for (bool trns : {false, true}) {
          if (trns && !l.can_trns) continue;
          for (auto [w, h] : {std::pair{13, 7}, std::pair{37, 29}}) {
            ti::PngOptions o{l.type, depth, interlace, trns, (seed % 2) == 0};
            const std::string png = ti::png(w, h, o, seed++);
            CAPTURE(l.type);
            CAPTURE(depth);
            CAPTURE(interlace);
            CAPTURE(trns);
            CAPTURE(w);
            ImageInfo ii;
            std::string why;
            REQUIRE_MESSAGE(image_info(u8(png), png.size(), ii, why), why);
            int sw = 0, sh = 0, sc = 0;
            REQUIRE(stbi_info_from_memory(u8(png), int(png.size()), &sw, &sh, &sc));
            CHECK(ii.width == sw);
            CHECK(ii.height == sh);
            CHECK(ii.channels == sc);
            for (int c = 1; c <= 4; ++c) {
              CAPTURE(c);
              Decoded d = decode(png, c);
              REQUIRE_MESSAGE(d.ok, d.why);
              int n = 0;
              stbi_uc* ref = stbi_load_from_memory(u8(png), int(png.size()), &sw, &sh, &n, c);
              REQUIRE(ref != nullptr);
              CHECK(d.info.width == sw);
              CHECK(d.info.height == sh);
              CHECK(d.info.channels == c);
              REQUIRE(d.px.size() == size_t(sw) * size_t(sh) * size_t(c));
              CHECK(memcmp(d.px.data(), ref, d.px.size()) == 0);
              stbi_image_free(ref);
            }
            ++files;
          }
        }
  CHECK(files == 2 * 2 * (5 * 2 + 2 + 2 * 2 + 4 * 2 + 2));
}

TEST_CASE("image decode: corrupt - truncated - oversized - empty input is refused with a one-line reason") {
  const std::vector<uint8_t> rgb = ti::content(40, 30, 3, 5);
  const std::string jpg = ti::jpeg(rgb.data(), 40, 30, 3);
  const std::string png = ti::png(40, 30, {}, 6);
  const std::string bmp = ti::bmp(40, 30, 24, 7);
  for (const std::string* f : {&jpg, &png, &bmp}) {
    Decoded d = decode(*f, 3);
    REQUIRE_MESSAGE(d.ok, d.why);
    CHECK(d.info.width == 40);
    CHECK(d.info.height == 30);
  }
  expect_refused("", true, {"empty"});
  expect_refused("GIF89a....", true, {"not a PNG, JPEG or BMP image"});
  expect_refused(jpg.substr(0, jpg.size() / 2), false, {"JPEG", "Premature end"});
  expect_refused(png.substr(0, png.size() / 2), false, {"PNG", "truncated"});
  expect_refused(bmp.substr(0, bmp.size() / 2), true, {"BMP", "truncated"});
  expect_refused(jpg.substr(0, 20), true, {"JPEG"});

  // Oversized headers: refused before any allocation, naming the limit.
  std::string big = png;
  auto fix_ihdr_crc = [](std::string& b) { set_be32(b, 29, uint32_t(crc32(0, u8(b) + 12, 17))); };
  set_be32(big, 16, 0x7fffffff);
  set_be32(big, 20, 0x7fffffff);
  fix_ihdr_crc(big);
  expect_refused(big, true, {"PNG header claims 2147483647x2147483647 pixels", "over the limit"});
  set_be32(big, 16, 20000);  // sides under the limit, pixels over it
  set_be32(big, 20, 20000);
  fix_ihdr_crc(big);
  expect_refused(big, true, {"20000x20000", "over the limit"});
  set_be32(big, 16, 0);
  fix_ihdr_crc(big);
  expect_refused(big, true, {"PNG header says 0x20000 pixels"});
  std::string bad_crc = png;
  bad_crc[33 + 8 + 10] ^= 0x01;  // a byte of IDAT's data (IHDR ends at 33)
  expect_refused(bad_crc, false, {"PNG", "IDAT"});

  std::string sof = jpg;
  const size_t at = sof.find("\xff\xc0");
  REQUIRE(at != std::string::npos);
  sof[at + 5] = sof[at + 6] = sof[at + 7] = sof[at + 8] = '\xff';
  expect_refused(sof, true, {"JPEG header claims 65535x65535 pixels", "over the limit"});

  std::string wide = bmp;
  for (size_t i : {18, 22}) wide[i] = '\x40', wide[i + 1] = '\x9c', wide[i + 2] = wide[i + 3] = 0;  // 40000
  expect_refused(wide, true, {"BMP header claims 40000x40000 pixels", "over the limit"});

  // Corrupt data libjpeg recovers from (bytes before the EOI marker) decodes, as in PIL.
  std::string extra = jpg.substr(0, jpg.size() - 2) + std::string("\x12\x34\x56", 3) + "\xff\xd9";
  Decoded e = decode(extra, 3);
  CHECK_MESSAGE(e.ok, e.why);
  CHECK(e.px == decode(jpg, 3).px);
}

TEST_CASE("image decode: a progressive JPEG of more than 500 scans is refused") {
  // Gray, DC first, then every AC coefficient alone: first pass at Al = 9 and nine refinement
  // passes (631 scans): valid, and slow to decode out of proportion to its size.
  const int w = 16, h = 16;
  const std::vector<uint8_t> px = ti::content(w, h, 1, 3);
  std::vector<jpeg_scan_info> scans;
  scans.push_back({1, {0}, 0, 0, 0, 0});
  for (int k = 1; k < 64; ++k) {
    scans.push_back({1, {0}, k, k, 0, 9});
    for (int a = 9; a > 0; --a) scans.push_back({1, {0}, k, k, a, a - 1});
  }
  REQUIRE(scans.size() == 631);
  jpeg_compress_struct ci;
  jpeg_error_mgr err;
  ci.err = jpeg_std_error(&err);
  jpeg_create_compress(&ci);
  unsigned char* buf = nullptr;
  unsigned long len = 0;
  jpeg_mem_dest(&ci, &buf, &len);
  ci.image_width = w;
  ci.image_height = h;
  ci.input_components = 1;
  ci.in_color_space = JCS_GRAYSCALE;
  jpeg_set_defaults(&ci);
  ci.scan_info = scans.data();
  ci.num_scans = int(scans.size());
  jpeg_start_compress(&ci, TRUE);
  while (ci.next_scanline < ci.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(px.data() + size_t(ci.next_scanline) * w);
    jpeg_write_scanlines(&ci, &row, 1);
  }
  jpeg_finish_compress(&ci);
  jpeg_destroy_compress(&ci);
  const std::string bomb(reinterpret_cast<const char*>(buf), len);
  free(buf);
  int sw = 0, sh = 0, n = 0;
  stbi_uc* ref = stbi_load_from_memory(u8(bomb), int(bomb.size()), &sw, &sh, &n, 1);
  CHECK(ref != nullptr);  // a valid file: stb_image decodes it
  stbi_image_free(ref);
  expect_refused(bomb, false, {"JPEG", "more than 500 progressive scans"});
}

}  // TEST_SUITE("unit")

TEST_SUITE("integration") {

TEST_CASE("image decode: JPEG is bit-identical to PIL (libjpeg-turbo) for gray - RGB - CMYK - subsampling - progressive") {
  auto probe = run_cmd(kPy + " -c 'import numpy, PIL.Image'");
  if (probe.code != 0) SKIP_TEST(kPy << " cannot import numpy and PIL (python3-pil): " << probe.err);
  const std::string d = fresh("pil");
  struct Case {
    std::string name;
    int w, h, c;
    ti::JpegOptions o;
  };
  const std::vector<Case> cases = {
      {"rgb420", 61, 47, 3, {85, false, 2, 2, 0}},  {"rgb422", 61, 47, 3, {90, false, 2, 1, 0}},
      {"rgb444", 33, 17, 3, {95, false, 1, 1, 0}},  {"rgb420_prog", 64, 48, 3, {80, true, 2, 2, 0}},
      {"rgb420_rst", 50, 70, 3, {75, false, 2, 2, 1}}, {"rgb_1x1", 1, 1, 3, {85, false, 2, 2, 0}},
      {"gray", 45, 31, 1, {85, false, 1, 1, 0}},    {"gray_prog", 45, 31, 1, {85, true, 1, 1, 0}},
      {"cmyk", 29, 23, 4, {90, false, 1, 1, 0}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::vector<uint8_t> px = ti::content(c.w, c.h, c.c, uint32_t(100 + i));
    std::ofstream(d + "/" + c.name + ".jpg", std::ios::binary) << ti::jpeg(px.data(), c.w, c.h, c.c, c.o);
  }
  // PIL decodes every file (and first writes one of its own, optimised progressive 4:2:0):
  // RGB as convert("RGB"); gray as the Y plane (draft("L")), or for CMYK stb_image's luma of
  // PIL's RGB (what decode_image documents).
  const std::string script = R"PY(
import glob, sys
import numpy as np
from PIL import Image
d = sys.argv[1]
y, x = np.mgrid[0:75, 0:100]
a = np.stack([(x * 2 + y) % 256, (x * 3) % 256, (y * 5 + x) % 256], -1).astype(np.uint8)
Image.fromarray(a).save(d + "/pil_written.jpg", quality=90, optimize=True, progressive=True, subsampling=2)
for f in sorted(glob.glob(d + "/*.jpg")):
    im = Image.open(f)
    cmyk = im.mode == "CMYK"
    rgb = np.asarray(im.convert("RGB"))
    open(f + ".rgb", "wb").write(rgb.tobytes())
    if cmyk:
        r = rgb.astype(np.int32)
        g = ((r[..., 0] * 77 + r[..., 1] * 150 + r[..., 2] * 29) >> 8).astype(np.uint8)
    else:
        im = Image.open(f)
        im.draft("L", None)
        g = np.asarray(im.convert("L"))
    open(f + ".gray", "wb").write(g.tobytes())
print(Image.__version__)
)PY";
  std::ofstream(d + "/decode.py") << script;
  auto r = run_cmd(kPy + " " + d + "/decode.py " + d);
  REQUIRE_MESSAGE(r.code == 0, r.all());
  int files = 0, identical = 0, stb_max_diff = 0;
  for (const auto& e : fs::directory_iterator(d)) {
    if (e.path().extension() != ".jpg") continue;
    const std::string f = e.path().string(), bytes = read_all(f);
    CAPTURE(f);
    bool file_same = true;
    for (int c : {3, 1}) {
      const std::string want = read_all(f + (c == 3 ? ".rgb" : ".gray"));
      Decoded got = decode(bytes, c);
      REQUIRE_MESSAGE(got.ok, got.why);
      REQUIRE(got.px.size() == want.size());
      const bool same = memcmp(got.px.data(), want.data(), want.size()) == 0;
      CHECK(same);
      file_same = file_same && same;
      int sw = 0, sh = 0, n = 0;
      stbi_uc* ref = stbi_load_from_memory(u8(bytes), int(bytes.size()), &sw, &sh, &n, c);
      REQUIRE(ref != nullptr);
      for (size_t k = 0; k < want.size(); ++k) stb_max_diff = std::max(stb_max_diff, std::abs(int(ref[k]) - int(got.px[k])));
      stbi_image_free(ref);
    }
    identical += file_same;
    ++files;
  }
  CHECK(files == int(cases.size()) + 1);
  MESSAGE("PIL " << r.out.substr(0, r.out.size() - 1) << ": " << identical << " of " << files
                 << " JPEGs bit-identical (RGB and gray); stb_image (the old decoder) differs by up to " << stb_max_diff
                 << " levels");
}

}  // TEST_SUITE("integration")

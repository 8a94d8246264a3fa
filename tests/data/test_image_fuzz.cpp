// Fuzz corpus for the image decoders (issue #17): valid JPEG/PNG/BMP seeds written by the real
// encoders (image_writers.h), then, from a fixed seed, truncated copies, copies with a few
// flipped bits, and copies whose header claims a huge (or zero) size. Fed to decode_image in
// process, to `dtrain data images` (every corrupt file: exit 2, one line naming it), and to
// training over WebDataset shards holding them (exit 2, one line naming shard and sample).
// scripts/sanitize.sh runs these under AddressSanitizer and UBSan.
#include <doctest/doctest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/sha256.h"
#include "data/image_codec.h"
#include "data/manifest.h"
#include "data/tar.h"
#include "image_writers.h"
#include "run_cmd.h"

using namespace dtrain::data;
namespace fs = std::filesystem;
namespace ti = test_images;

namespace {

struct File {
  std::string name, ext, bytes;
  bool must_fail = false;  // truncated or oversized: no decoder may accept it
  std::string must_say;    // in the reason, when set
};

const uint8_t* u8(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

std::vector<File> seeds() {
  const int w = 48, h = 40;
  const auto rgb = ti::content(w, h, 3, 1), gray = ti::content(w, h, 1, 2), cmyk = ti::content(w, h, 4, 3);
  return {
      {"jpg_420", "jpg", ti::jpeg(rgb.data(), w, h, 3)},
      {"jpg_444_rst", "jpg", ti::jpeg(rgb.data(), w, h, 3, {90, false, 1, 1, 1})},
      {"jpg_prog", "jpeg", ti::jpeg(rgb.data(), w, h, 3, {80, true, 2, 2, 0})},
      {"jpg_gray", "jpg", ti::jpeg(gray.data(), w, h, 1)},
      {"jpg_cmyk", "jpg", ti::jpeg(cmyk.data(), w, h, 4)},
      {"png_rgb", "png", ti::png(w, h, {}, 4)},
      {"png_pal", "png", ti::png(w, h, {PNG_COLOR_TYPE_PALETTE, 4, true, true, false}, 5)},
      {"png_gray16", "png", ti::png(w, h, {PNG_COLOR_TYPE_GRAY, 16, false, false, true}, 6)},
      {"png_rgba", "png", ti::png(w, h, {PNG_COLOR_TYPE_RGB_ALPHA, 8, true, false, false}, 7)},
      {"bmp24", "bmp", ti::bmp(w, h, 24, 8)},
      {"bmp8", "bmp", ti::bmp(w, h, 8, 9)},
      {"bmp32", "bmp", ti::bmp(w, h, 32, 10)},
  };
}

void be32(std::string& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + size_t(i)] = char((v >> (24 - 8 * i)) & 0xff);
}

// PNG with IHDR width x height and its CRC recomputed.
std::string png_sized(std::string b, uint32_t w, uint32_t h) {
  be32(b, 16, w);
  be32(b, 20, h);
  be32(b, 29, uint32_t(crc32(0, u8(b) + 12, 17)));
  return b;
}

// JPEG whose SOFn says height x width.
std::string jpeg_sized(std::string b, uint16_t w, uint16_t h) {
  for (size_t p = 2; p + 9 <= b.size() && uint8_t(b[p]) == 0xff;) {
    const uint8_t m = uint8_t(b[p + 1]);
    if (m >= 0xc0 && m <= 0xcf && m != 0xc4 && m != 0xc8 && m != 0xcc) {
      b[p + 5] = char(h >> 8), b[p + 6] = char(h & 0xff), b[p + 7] = char(w >> 8), b[p + 8] = char(w & 0xff);
      return b;
    }
    p += 2 + (size_t(uint8_t(b[p + 2])) << 8 | uint8_t(b[p + 3]));
  }
  FAIL("no SOF marker");
  return b;
}

std::string bmp_sized(std::string b, uint32_t w, uint32_t h) {
  for (int i = 0; i < 4; ++i) b[18 + size_t(i)] = char((w >> (8 * i)) & 0xff), b[22 + size_t(i)] = char((h >> (8 * i)) & 0xff);
  return b;
}

// The corpus: per seed, three truncations (10%, 50%, 90% of the file: must fail) and
// `flips` copies with 1 to 4 random bits flipped anywhere (may decode: JPEG and BMP data
// carry no checksum); per format, oversized and empty headers (must fail).
std::vector<File> corpus(int flips, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<File> out;
  const std::vector<File> s = seeds();
  for (const File& f : s) {
    for (int pct : {10, 50, 90})
      out.push_back({f.name + "_cut" + std::to_string(pct), f.ext, f.bytes.substr(0, f.bytes.size() * size_t(pct) / 100),
                     true, ""});
    for (int k = 0; k < flips; ++k) {
      File c{f.name + "_flip" + std::to_string(k), f.ext, f.bytes, false, ""};
      const int bits = 1 + int(rng() % 4);
      for (int b = 0; b < bits; ++b) c.bytes[rng() % c.bytes.size()] ^= char(1u << (rng() % 8));
      out.push_back(c);
    }
  }
  const std::string limit = "over the limit";
  out.push_back({"png_huge", "png", png_sized(s[5].bytes, 0x7fffffff, 0x7fffffff), true, limit});
  out.push_back({"png_20000", "png", png_sized(s[6].bytes, 20000, 20000), true, limit});
  out.push_back({"png_zero", "png", png_sized(s[5].bytes, 0, 40), true, "0x40"});
  out.push_back({"jpg_huge", "jpg", jpeg_sized(s[0].bytes, 65535, 65535), true, limit});
  out.push_back({"jpg_prog_huge", "jpg", jpeg_sized(s[2].bytes, 65535, 65535), true, limit});
  out.push_back({"jpg_zero", "jpg", jpeg_sized(s[0].bytes, 48, 0), true, ""});
  out.push_back({"bmp_huge", "bmp", bmp_sized(s[9].bytes, 0x7fffffff, 0x7fffffff), true, ""});
  out.push_back({"bmp_40000", "bmp", bmp_sized(s[10].bytes, 40000, 40000), true, limit});
  return out;
}

std::string fresh(const std::string& name) {
  const std::string d = std::string(DTRAIN_BUILD_DIR) + "/test_image_fuzz/" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

int lines_with(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t p = 0; (p = text.find(needle, p)) != std::string::npos; p += needle.size()) ++n;
  return n;
}

std::string last_line(const std::string& text) {
  const std::string t = text.empty() || text.back() != '\n' ? text : text.substr(0, text.size() - 1);
  const size_t nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("image fuzz: decode_image survives a seeded corpus of corrupt JPEG PNG BMP files") {
  for (const File& f : seeds()) {  // the seeds themselves decode
    std::vector<uint8_t> px;
    ImageInfo info;
    std::string why;
    CHECK_MESSAGE(decode_image(u8(f.bytes), f.bytes.size(), 3, px, info, why), f.name << ": " << why);
  }
  int refused = 0, decoded = 0;
  for (const File& f : corpus(150, 20261125)) {
    CAPTURE(f.name);
    ImageInfo hi;
    std::string hwhy;
    const bool header = image_info(u8(f.bytes), f.bytes.size(), hi, hwhy);
    for (int c : {1, 3}) {
      std::vector<uint8_t> px;
      ImageInfo info;
      std::string why;
      const bool ok = decode_image(u8(f.bytes), f.bytes.size(), c, px, info, why);
      if (ok) {
        ++decoded;
        CHECK_FALSE(f.must_fail);
        CHECK(header);
        CHECK(info.width == hi.width);
        CHECK(info.height == hi.height);
        CHECK((info.width > 0 && info.width <= kMaxImageSide && info.height > 0 && info.height <= kMaxImageSide));
        CHECK(px.size() == size_t(info.width) * size_t(info.height) * size_t(c));
      } else {
        ++refused;
        CHECK(!why.empty());
        CHECK(why.find('\n') == std::string::npos);
        if (!f.must_say.empty()) CHECK_MESSAGE(why.find(f.must_say) != std::string::npos, why);
      }
    }
    if (!header) CHECK(hwhy.find('\n') == std::string::npos);
  }
  MESSAGE("corpus decodes: " << decoded << " decoded, " << refused << " refused");
  CHECK(refused > 0);
}

}  // TEST_SUITE("unit")

TEST_SUITE("integration") {

TEST_CASE("image fuzz: data images exits 2 with one line naming each corrupt file") {
  const std::string d = fresh("images");
  const std::string good = ti::png(16, 12, {}, 99);
  int n = 0, accepted = 0;
  for (const File& f : corpus(2, 7)) {
    CAPTURE(f.name);
    const std::string src = d + "/" + f.name + "/src", bad = src + "/b/" + f.name + "." + f.ext;
    write(src + "/a/good.png", good);
    write(bad, f.bytes);
    auto r = run_dtrain("data images " + src + " --out " + d + "/" + f.name + "/out");
    if (f.must_fail) CHECK(r.code == 2);
    CHECK_MESSAGE((r.code == 2 || r.code == 0), r.all());
    if (r.code == 2) {
      CHECK(r.err_lines() == 1);
      CHECK_MESSAGE(r.err.find(bad + ": not a decodable PNG/JPEG/BMP image (") != std::string::npos, r.err);
      if (!f.must_say.empty()) CHECK_MESSAGE(r.err.find(f.must_say) != std::string::npos, r.err);
    } else {
      ++accepted;
    }
    fs::remove_all(d + "/" + f.name);
    ++n;
  }
  MESSAGE(n << " corrupt files, " << accepted << " bit-flipped ones still decode");
}

TEST_CASE("image fuzz: corrupt images in WebDataset shards stop indexing or training with exit 2 naming shard and sample") {
  const std::vector<File> all = corpus(2, 11);
  auto pick = [&](const std::string& name) {
    for (const File& f : all)
      if (f.name == name) return f;
    FAIL("no corpus file " << name);
    return File{};
  };
  const std::vector<uint8_t> rgb = ti::content(20, 16, 3, 4);
  const std::string good = ti::jpeg(rgb.data(), 20, 16, 3);
  // (file, manifest written here instead of by `dtrain data index`: an indexer that reads
  // headers refuses oversized ones, so this is how they reach a loader)
  const std::vector<std::pair<std::string, bool>> cases = {
      {"jpg_420_cut50", false}, {"jpg_prog_cut90", false}, {"png_rgb_cut50", false}, {"png_pal_cut90", false},
      {"bmp24_cut90", false},   {"jpg_huge", false},       {"jpg_huge", true},       {"png_huge", true},
      {"bmp_40000", true},      {"jpg_420_flip0", false},  {"jpg_cmyk_flip1", false}};
  int index_refused = 0, train_refused = 0, trained = 0;
  for (const auto& [name, hand_manifest] : cases) {
    const File f = pick(name);
    CAPTURE(name);
    CAPTURE(hand_manifest);
    const std::string d = fresh("shards_" + name + (hand_manifest ? "_m" : "")), shard = d + "/train/000000.tar";
    fs::create_directories(d + "/train");
    {
      TarWriter t(shard);
      for (int i = 0; i < 4; ++i) {
        const std::string key = "s" + std::to_string(i);
        if (i == 2)
          t.add(key + "." + f.ext, f.bytes);
        else
          t.add(key + ".jpg", good);
        t.add(key + ".cls", std::to_string(i % 2));
      }
      t.finish();
    }
    if (hand_manifest) {
      Manifest m;
      m.splits["train"] = {4, 2, 3, 0, 0, {{"train/000000.tar", 4, dtrain::sha256_file(shard)}}};
      write_manifest(d + "/manifest.json", m);
    } else {
      auto ix = run_dtrain("data index " + d);
      CHECK_MESSAGE((ix.code == 0 || ix.code == 2), ix.all());
      if (ix.code == 2) {  // refused from the header
        CHECK(ix.err_lines() == 1);
        CHECK_MESSAGE(ix.err.find(shard + ": sample 's2': s2." + f.ext + ": ") != std::string::npos, ix.err);
        if (!f.must_say.empty()) CHECK_MESSAGE(ix.err.find(f.must_say) != std::string::npos, ix.err);
        ++index_refused;
        continue;
      }
    }
    auto t = run_dtrain("train " + std::string(DTRAIN_SOURCE_DIR) + "/configs/tiny_resnet.toml --set run.out_dir=" +
                        shell_quote("\"" + d + "/runs\"") + " --set data.path=" + shell_quote("\"" + d + "\"") +
                        " --set data.train_split='\"train\"' --set data.eval_split='\"train\"'"
                        " --set model.in_channels=3 --set model.num_classes=2 --set data.image_size=16"
                        " --set data.mean=[0.5,0.5,0.5] --set data.std=[0.25,0.25,0.25] --set train.batch_size=4"
                        " --set train.max_steps=1 --set eval.batch_size=4 --set eval.max_batches=1"
                        " --set checkpoint.every_steps=0");
    if (f.must_fail) CHECK(t.code == 2);
    CHECK_MESSAGE((t.code == 2 || t.code == 0), t.all());
    if (t.code == 2) {
      CHECK_MESSAGE(lines_with(t.err, "error") == 1, t.err);
      const std::string e = last_line(t.err);
      CHECK_MESSAGE(e.find("error: " + shard + ": sample 's2' does not decode as an image (") == 0, t.err);
      if (!f.must_say.empty()) CHECK_MESSAGE(e.find(f.must_say) != std::string::npos, e);
    }
    ++(t.code == 2 ? train_refused : trained);
  }
  MESSAGE(cases.size() << " shards: " << index_refused << " refused by data index, " << train_refused
                       << " stopped training, " << trained << " trained (bit flips that still decode)");
  CHECK(train_refused >= 6);
}

}  // TEST_SUITE("integration")

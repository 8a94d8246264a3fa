#pragma once
// Test-side image writers over the real libraries: libjpeg-turbo's compressor, libpng's
// writer (every colour type, bit depth, interlacing, transparency) and a plain BMP writer.
// They make the valid files the decoders are compared on and the seeds of the fuzz corpus
// (test_image_fuzz.cpp), with no Python needed.
#include <jpeglib.h>
#include <png.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace test_images {

// Gradients plus noise, w*h*c bytes: compresses like a photo rather than like pure noise.
inline std::vector<uint8_t> content(int w, int h, int c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> px(size_t(w) * size_t(h) * size_t(c));
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < c; ++k)
        px[(size_t(y) * size_t(w) + size_t(x)) * size_t(c) + size_t(k)] =
            uint8_t((x * 255 / (w > 1 ? w - 1 : 1) + y * 3 + k * 70 + int(rng() % 40)) & 0xff);
  return px;
}

struct JpegOptions {
  int quality = 85;
  bool progressive = false;
  int h_samp = 2, v_samp = 2;  // of the first component: 2x2 is 4:2:0, 2x1 4:2:2, 1x1 4:4:4
  int restart_rows = 0;        // restart marker every N MCU rows
};

// c = 1 (gray), 3 (RGB -> YCbCr) or 4 (CMYK, with libjpeg's Adobe marker)
inline std::string jpeg(const uint8_t* px, int w, int h, int c, const JpegOptions& o = {}) {
  jpeg_compress_struct ci;
  jpeg_error_mgr err;
  ci.err = jpeg_std_error(&err);
  jpeg_create_compress(&ci);
  unsigned char* buf = nullptr;
  unsigned long len = 0;
  jpeg_mem_dest(&ci, &buf, &len);
  ci.image_width = JDIMENSION(w);
  ci.image_height = JDIMENSION(h);
  ci.input_components = c;
  ci.in_color_space = c == 1 ? JCS_GRAYSCALE : c == 3 ? JCS_RGB : JCS_CMYK;
  jpeg_set_defaults(&ci);
  jpeg_set_quality(&ci, o.quality, TRUE);
  if (c == 3) {
    ci.comp_info[0].h_samp_factor = o.h_samp;
    ci.comp_info[0].v_samp_factor = o.v_samp;
  }
  if (o.progressive) jpeg_simple_progression(&ci);
  ci.restart_in_rows = o.restart_rows;
  jpeg_start_compress(&ci, TRUE);
  while (ci.next_scanline < ci.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(px + size_t(ci.next_scanline) * size_t(w) * size_t(c));
    jpeg_write_scanlines(&ci, &row, 1);
  }
  jpeg_finish_compress(&ci);
  jpeg_destroy_compress(&ci);
  std::string out(reinterpret_cast<const char*>(buf), len);
  free(buf);
  return out;
}

struct PngOptions {
  int color_type = PNG_COLOR_TYPE_RGB;
  int depth = 8;
  bool interlace = false;
  bool trns = false;   // tRNS chunk: palette alphas, or a gray / RGB key colour
  bool gamma = false;  // a gAMA chunk (no decoder here applies it)
};

inline void png_write_to_string(png_structp png, png_bytep data, png_size_t n) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), n);
}
inline void png_flush_nothing(png_structp) {}

// Random samples of the given layout; a third of the pixels are the tRNS key colour.
inline std::string png(int w, int h, const PngOptions& o, uint32_t seed) {
  std::mt19937 rng(seed);
  const int channels = o.color_type == PNG_COLOR_TYPE_GRAY || o.color_type == PNG_COLOR_TYPE_PALETTE ? 1
                       : o.color_type == PNG_COLOR_TYPE_GRAY_ALPHA                                   ? 2
                       : o.color_type == PNG_COLOR_TYPE_RGB                                          ? 3
                                                                                                     : 4;
  const uint32_t maxv = (1u << o.depth) - 1;
  std::vector<uint32_t> key(static_cast<size_t>(channels));
  for (auto& k : key) k = rng() % (maxv + 1);
  const size_t row_bytes = (size_t(w) * size_t(channels) * size_t(o.depth) + 7) / 8;
  std::vector<uint8_t> img(row_bytes * size_t(h), 0);
  for (int y = 0; y < h; ++y) {
    uint8_t* row = img.data() + size_t(y) * row_bytes;
    size_t bit = 0;
    for (int x = 0; x < w; ++x) {
      const bool is_key = rng() % 3 == 0;
      for (int k = 0; k < channels; ++k, bit += size_t(o.depth)) {
        const uint32_t v = is_key ? key[size_t(k)] : rng() % (maxv + 1);
        if (o.depth == 16) {
          row[bit / 8] = uint8_t(v >> 8);
          row[bit / 8 + 1] = uint8_t(v);
        } else {
          row[bit / 8] |= uint8_t(v << (8 - o.depth - int(bit % 8)));
        }
      }
    }
  }
  std::string out;
  std::vector<png_color> palette(size_t(maxv + 1));
  std::vector<png_byte> alphas;
  std::vector<png_bytep> rows(static_cast<size_t>(h));
  png_structp p = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(p);
  if (setjmp(png_jmpbuf(p))) throw std::runtime_error("libpng write failed");
  png_set_write_fn(p, &out, png_write_to_string, png_flush_nothing);
  png_set_IHDR(p, info, png_uint_32(w), png_uint_32(h), o.depth, o.color_type,
               o.interlace ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (o.color_type == PNG_COLOR_TYPE_PALETTE) {
    for (auto& c : palette) c = {png_byte(rng()), png_byte(rng()), png_byte(rng())};
    png_set_PLTE(p, info, palette.data(), int(palette.size()));
  }
  if (o.trns) {
    png_color_16 tc{};
    if (o.color_type == PNG_COLOR_TYPE_PALETTE) {
      for (size_t i = 0; i < std::min<size_t>(palette.size(), 5); ++i) alphas.push_back(png_byte(i * 60));
      png_set_tRNS(p, info, alphas.data(), int(alphas.size()), nullptr);
    } else {
      tc.gray = png_uint_16(key[0]);
      tc.red = png_uint_16(key[0]);
      if (channels >= 3) {
        tc.green = png_uint_16(key[1]);
        tc.blue = png_uint_16(key[2]);
      }
      png_set_tRNS(p, info, nullptr, 0, &tc);
    }
  }
  if (o.gamma) png_set_gAMA(p, info, 1.0 / 1.8);
  for (int y = 0; y < h; ++y) rows[size_t(y)] = img.data() + size_t(y) * row_bytes;
  png_set_rows(p, info, rows.data());
  png_write_png(p, info, PNG_TRANSFORM_IDENTITY, nullptr);
  png_destroy_write_struct(&p, &info);
  return out;
}

// Uncompressed BMP (bottom-up rows padded to 4 bytes): bpp 24 (BGR), 32 (BGRA) or 8 (a
// random 256-colour palette).
inline std::string bmp(int w, int h, int bpp, uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t stride = (size_t(w) * size_t(bpp) + 31) / 32 * 4, palette = bpp == 8 ? 1024 : 0;
  const size_t offset = 54 + palette, size = offset + stride * size_t(h);
  std::string b(size, '\0');
  auto put = [&](size_t at, uint32_t v, int n) {
    for (int i = 0; i < n; ++i) b[at + size_t(i)] = char((v >> (8 * i)) & 0xff);
  };
  b[0] = 'B';
  b[1] = 'M';
  put(2, uint32_t(size), 4);
  put(10, uint32_t(offset), 4);
  put(14, 40, 4);
  put(18, uint32_t(w), 4);
  put(22, uint32_t(h), 4);
  put(26, 1, 2);
  put(28, uint32_t(bpp), 2);
  put(34, uint32_t(stride * size_t(h)), 4);
  if (bpp == 8) put(46, 256, 4);
  for (size_t i = 54; i < offset; ++i) b[i] = char((i % 4 == 1) ? 0 : rng() & 0xff);
  const std::vector<uint8_t> px = content(w, h, bpp / 8, seed);
  for (int y = 0; y < h; ++y)
    for (size_t i = 0; i < size_t(w) * size_t(bpp / 8); ++i)
      b[offset + size_t(h - 1 - y) * stride + i] = char(px[size_t(y) * size_t(w) * size_t(bpp / 8) + i]);
  return b;
}

}  // namespace test_images

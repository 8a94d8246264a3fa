// Decoding of untrusted image bytes (users' photos, shards written by other tools):
//  - JPEG through libjpeg-turbo (as PIL: ISLOW DCT, fancy upsampling, CMYK in Adobe's
//    inverted polarity; libjpeg's errors longjmp out of a custom error manager; a truncated
//    file is an error, other corrupt-data warnings libjpeg recovers from are ignored, as PIL
//    does);
//  - PNG through libpng (CRC and zlib checks on; errors longjmp out of png_set_error_fn);
//  - BMP through stb_image (BMP only), after a check that the pixel data the header
//    describes is all there (stb would read zeros past the end).
// Every header is checked against kMaxImageSide / kMaxImagePixels before anything is
// allocated for the pixels. Channel conversion is stb_image's (what the loaders have always
// had): gray replicated to RGB, RGB to gray as (77 R + 150 G + 29 B) >> 8, alpha dropped,
// or 255 when requested and absent; 16-bit samples keep their high byte.
#include <climits>
#include <csetjmp>
#include <cstdio>
#include <cstring>

#include <jerror.h>
#include <jpeglib.h>
#include <png.h>

#include "core/error.h"
#include "data/image_codec.h"

#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_NO_STDIO
#define STBI_ONLY_BMP
#include <stb/stb_image.h>

namespace dtrain::data {

namespace {

// libjpeg's memory for one decode (progressive files buffer every coefficient): 1 GiB covers
// the largest image kMaxImagePixels allows.
constexpr long kMaxJpegMemory = 1L << 30;
// A progressive JPEG of many tiny scans costs time out of proportion to its size (libjpeg-turbo's
// own fuzzers and TurboJPEG 3 cap scans at 500).
constexpr int kMaxJpegScans = 500;

// What a decode_* call does: read the header only; decode; or check that the whole image
// decodes (a JPEG then decodes at 1/8 scale: every coefficient is still entropy-decoded, so
// corrupt data shows, but the IDCT is the DC term only).
enum class Mode { kHeader, kDecode, kCheck };

bool check_size(const char* format, int64_t w, int64_t h, std::string& reason) {
  if (w <= 0 || h <= 0) {
    reason = fmt::format("{} header says {}x{} pixels", format, w, h);
    return false;
  }
  if (w > kMaxImageSide || h > kMaxImageSide || w * h > kMaxImagePixels) {
    reason = fmt::format("{} header claims {}x{} pixels, over the limit of {} a side and {} pixels (= 256 MiB as RGB)",
                         format, w, h, kMaxImageSide, kMaxImagePixels);
    return false;
  }
  return true;
}

uint8_t luma(const uint8_t* p) { return uint8_t((p[0] * 77 + p[1] * 150 + p[2] * 29) >> 8); }  // stb_image's

// n pixels of `from` channels (1 gray, 2 gray+alpha, 3 RGB, 4 RGBA) -> `to` channels.
void convert_pixels(const uint8_t* s, int from, uint8_t* d, int to, size_t n) {
  for (size_t i = 0; i < n; ++i, s += from, d += to) {
    const bool color = from >= 3;
    const uint8_t a = (from == 2 || from == 4) ? s[from - 1] : 255;
    if (to <= 2) {
      d[0] = color ? luma(s) : s[0];
    } else {
      d[0] = s[0];
      d[1] = color ? s[1] : s[0];
      d[2] = color ? s[2] : s[0];
    }
    if (to == 2 || to == 4) d[to - 1] = a;
  }
}

// 16-bit RGB(A) (big-endian samples) -> gray (+alpha): stb_image takes the luma of the 16-bit
// samples, then their high byte.
void luma16_pixels(const uint8_t* s, int from, uint8_t* d, int to, size_t n) {
  auto at = [&](int k) { return uint32_t(s[2 * k] << 8 | s[2 * k + 1]); };
  for (size_t i = 0; i < n; ++i, s += 2 * from, d += to) {
    d[0] = uint8_t(((at(0) * 77 + at(1) * 150 + at(2) * 29) >> 8) >> 8);
    if (to == 2) d[1] = from == 4 ? uint8_t(at(3) >> 8) : 255;
  }
}

// ---- JPEG ----

struct JpegError {
  jpeg_error_mgr pub;  // first: libjpeg sees a jpeg_error_mgr*
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void jpeg_fail(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegError*>(c->err);
  (*c->err->format_message)(c, e->message);
  longjmp(e->jump, 1);
}

void jpeg_warning(j_common_ptr c, int level) {
  if (level == -1 && c->err->msg_code == JWRN_JPEG_EOF) jpeg_fail(c);  // truncated (PIL refuses it too)
}

void jpeg_scan_limit(j_common_ptr c) {
  auto* d = reinterpret_cast<j_decompress_ptr>(c);
  if (c->is_decompressor && d->input_scan_number > kMaxJpegScans) {
    auto* e = reinterpret_cast<JpegError*>(c->err);
    snprintf(e->message, sizeof e->message, "more than %d progressive scans", kMaxJpegScans);
    longjmp(e->jump, 1);
  }
}

// Adobe CMYK (stored inverted, as Photoshop writes it and PIL assumes) -> RGB: C * K / 255,
// rounded, which is PIL's CMYK -> RGB conversion.
uint8_t mul255(int a, int b) {
  const int t = a * b + 128;
  return uint8_t((t + (t >> 8)) >> 8);
}

// The libjpeg calls run in these steps, each under its own setjmp; they hold no C++ object
// (nothing a longjmp could skip) and report an error as false with err.message set.
struct Jpeg {
  jpeg_decompress_struct cinfo;
  JpegError err;
  jpeg_progress_mgr progress;
};

bool jpeg_open(Jpeg& j, const uint8_t* data, size_t size) {
  if (setjmp(j.err.jump)) return false;
  jpeg_create_decompress(&j.cinfo);
  j.cinfo.mem->max_memory_to_use = kMaxJpegMemory;
  j.cinfo.progress = &j.progress;
  jpeg_mem_src(&j.cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&j.cinfo, TRUE);
  return true;
}

bool jpeg_output_size(Jpeg& j) {
  if (setjmp(j.err.jump)) return false;
  jpeg_calc_output_dimensions(&j.cinfo);
  return true;
}

// Rows into `out` (w x channels each); through `row` (w x 7 bytes) when converted.
bool jpeg_read_rows(Jpeg& j, uint8_t* out, int channels, uint8_t* row) {
  if (setjmp(j.err.jump)) return false;
  j_decompress_ptr c = &j.cinfo;
  jpeg_start_decompress(c);
  const size_t w = c->output_width;
  const int native = c->output_components;
  const bool cmyk = c->out_color_space == JCS_CMYK, direct = native == channels && !cmyk;
  while (c->output_scanline < c->output_height) {
    uint8_t* dst = out + size_t(c->output_scanline) * w * size_t(channels);
    JSAMPROW r = direct ? dst : row;
    jpeg_read_scanlines(c, &r, 1);
    if (direct) continue;
    const uint8_t* src = row;
    int from = native;
    if (cmyk) {
      uint8_t* rgb = row + w * 4;
      for (size_t x = 0; x < w; ++x)
        for (size_t k = 0; k < 3; ++k) rgb[x * 3 + k] = mul255(row[x * 4 + k], row[x * 4 + 3]);
      src = rgb;
      from = 3;
    }
    convert_pixels(src, from, dst, channels, w);
  }
  jpeg_finish_decompress(c);
  return true;
}

// Mode::kHeader: fills info (channels 1 or 3, as stb_image reports a JPEG) and stops.
bool decode_jpeg(const uint8_t* data, size_t size, int channels, Mode mode, std::vector<uint8_t>& out,
                 ImageInfo& info, std::string& reason) {
  Jpeg j;
  memset(&j.cinfo, 0, sizeof j.cinfo);  // destroyable even if jpeg_create_decompress fails
  j.cinfo.err = jpeg_std_error(&j.err.pub);
  j.err.pub.error_exit = jpeg_fail;
  j.err.pub.emit_message = jpeg_warning;
  j.progress.progress_monitor = jpeg_scan_limit;
  struct Destroy {
    Jpeg& j;
    ~Destroy() { jpeg_destroy_decompress(&j.cinfo); }
  } destroy{j};
  auto failed = [&] {
    // libjpeg's own size limit (65500 a side) fires inside jpeg_read_header: say ours instead
    if (j.err.pub.msg_code != JERR_IMAGE_TOO_BIG || check_size("JPEG", j.cinfo.image_width, j.cinfo.image_height, reason))
      reason = fmt::format("JPEG: {}", j.err.message);
    return false;
  };
  if (!jpeg_open(j, data, size)) return failed();
  if (!check_size("JPEG", j.cinfo.image_width, j.cinfo.image_height, reason)) return false;
  info.width = int(j.cinfo.image_width);
  info.height = int(j.cinfo.image_height);
  if (mode == Mode::kHeader) {
    info.channels = j.cinfo.num_components == 1 ? 1 : 3;
    return true;
  }
  const J_COLOR_SPACE cs = j.cinfo.jpeg_color_space;
  if (cs != JCS_GRAYSCALE && cs != JCS_YCbCr && cs != JCS_RGB && cs != JCS_CMYK && cs != JCS_YCCK) {
    reason = fmt::format("JPEG: {} components in an unsupported colour space", j.cinfo.num_components);
    return false;
  }
  // Gray wanted from YCbCr: the Y plane (what stb_image gave, and PIL's draft("L")).
  j.cinfo.out_color_space = cs == JCS_GRAYSCALE || (cs == JCS_YCbCr && channels <= 2) ? JCS_GRAYSCALE
                            : cs == JCS_CMYK || cs == JCS_YCCK                         ? JCS_CMYK
                                                                                       : JCS_RGB;
  j.cinfo.dct_method = JDCT_ISLOW;
  j.cinfo.do_fancy_upsampling = TRUE;
  if (mode == Mode::kCheck) j.cinfo.scale_denom = 8;
  if (!jpeg_output_size(j)) return failed();
  const size_t w = j.cinfo.output_width, h = j.cinfo.output_height;
  std::vector<uint8_t> row(w * 7);  // CMYK, then its RGB
  out.resize(w * h * size_t(channels));
  if (!jpeg_read_rows(j, out.data(), channels, row.data())) return failed();
  info.channels = channels;
  return true;
}

// ---- PNG ----

struct PngSource {
  const uint8_t* data;
  size_t size, pos;
};

struct PngError {
  jmp_buf jump;
  char message[256];
};

[[noreturn]] void png_fail(png_structp png, png_const_charp msg) {
  auto* e = static_cast<PngError*>(png_get_error_ptr(png));
  snprintf(e->message, sizeof e->message, "%s", msg);
  longjmp(e->jump, 1);
}

void png_warning_ignored(png_structp, png_const_charp) {}

void png_read_memory(png_structp png, png_bytep out, png_size_t n) {
  auto* s = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > s->size - s->pos) png_error(png, "truncated file");
  memcpy(out, s->data + s->pos, n);
  s->pos += n;
}

uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

// The libpng calls, as the libjpeg ones above: each step under its own setjmp, no C++ object
// in their frames, false with err.message set on an error.
struct Png {
  png_structp png = nullptr;
  png_infop info = nullptr;
  PngError err;
  PngSource src;
};

bool png_open(Png& p) {
  if (setjmp(p.err.jump)) return false;
  png_set_read_fn(p.png, &p.src, png_read_memory);
  png_set_user_limits(p.png, kMaxImageSide, kMaxImageSide);
  png_read_info(p.png, p.info);
  return true;
}

// The transforms to 8-bit gray / gray+alpha / RGB / RGBA as stb_image: 16-bit samples keep
// their high byte (kept 16-bit when `keep16`), palettes expand, 1/2/4-bit gray scales up,
// tRNS becomes alpha when `alpha`.
bool png_transform(Png& p, bool keep16, bool alpha) {
  if (setjmp(p.err.jump)) return false;
  const int type = png_get_color_type(p.png, p.info), depth = png_get_bit_depth(p.png, p.info);
  if (depth == 16 && !keep16) png_set_strip_16(p.png);
  if (type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(p.png);
  if (type == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(p.png);
  if (alpha && png_get_valid(p.png, p.info, PNG_INFO_tRNS)) png_set_tRNS_to_alpha(p.png);
  png_set_interlace_handling(p.png);
  png_read_update_info(p.png, p.info);
  return true;
}

bool png_read_rows(Png& p, png_bytep* rows) {
  if (setjmp(p.err.jump)) return false;
  png_read_image(p.png, rows);
  return true;
}

bool decode_png(const uint8_t* data, size_t size, int channels, Mode mode, std::vector<uint8_t>& out,
                ImageInfo& info, std::string& reason) {
  // IHDR must be the first chunk: check its size before libpng does (its message would be
  // about its own limits).
  if (size >= 24 && memcmp(data + 12, "IHDR", 4) == 0 && !check_size("PNG", be32(data + 16), be32(data + 20), reason))
    return false;
  Png p;
  p.src = {data, size, 0};
  p.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &p.err, png_fail, png_warning_ignored);
  if (p.png) p.info = png_create_info_struct(p.png);
  struct Destroy {
    Png& p;
    ~Destroy() { png_destroy_read_struct(&p.png, p.info ? &p.info : nullptr, nullptr); }
  } destroy{p};
  if (!p.png || !p.info) fault("libpng: out of memory");
  auto failed = [&] {
    reason = fmt::format("PNG: {}", p.err.message);
    return false;
  };
  if (!png_open(p)) return failed();
  const uint32_t w = png_get_image_width(p.png, p.info), h = png_get_image_height(p.png, p.info);
  if (!check_size("PNG", w, h, reason)) return false;
  info.width = int(w);
  info.height = int(h);
  const int type = png_get_color_type(p.png, p.info), depth = png_get_bit_depth(p.png, p.info);
  if (mode == Mode::kHeader) {  // channels as stb_image reports them: a palette is RGB, RGBA with tRNS
    const bool trns = png_get_valid(p.png, p.info, PNG_INFO_tRNS) != 0;
    info.channels = type == PNG_COLOR_TYPE_PALETTE ? (trns ? 4 : 3) : int(png_get_channels(p.png, p.info));
    return true;
  }
  const bool luma16 = depth == 16 && (type & PNG_COLOR_MASK_COLOR) && type != PNG_COLOR_TYPE_PALETTE && channels <= 2;
  if (!png_transform(p, luma16, channels == 2 || channels == 4)) return failed();
  const int native = png_get_channels(p.png, p.info);
  const size_t pixel_bytes = size_t(native) * (luma16 ? 2 : 1);
  if (png_get_rowbytes(p.png, p.info) != size_t(w) * pixel_bytes || native > 4) {  // the transforms exclude it
    reason = fmt::format("PNG: rows of {} bytes for {} pixels of {} channels", png_get_rowbytes(p.png, p.info), w, native);
    return false;
  }
  const size_t n = size_t(w) * size_t(h);
  const bool direct = native == channels && !luma16;
  std::vector<uint8_t> native_px(direct ? 0 : n * pixel_bytes);
  std::vector<png_bytep> rows(h);
  out.resize(n * size_t(channels));
  uint8_t* px = direct ? out.data() : native_px.data();
  for (size_t y = 0; y < h; ++y) rows[y] = px + y * size_t(w) * pixel_bytes;
  if (!png_read_rows(p, rows.data())) return failed();
  if (luma16)
    luma16_pixels(native_px.data(), native, out.data(), channels, n);
  else if (!direct)
    convert_pixels(native_px.data(), native, out.data(), channels, n);
  info.channels = channels;
  return true;
}

// ---- BMP ----

uint32_t le32(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }
uint16_t le16(const uint8_t* p) { return uint16_t(p[0] | p[1] << 8); }

// stb_image reads zeros past the end of its buffer, so a truncated BMP would decode: the
// rows the header describes must all be in the file (uncompressed and bit-field BMPs; stb
// refuses the RLE ones).
bool bmp_complete(const uint8_t* data, size_t size, std::string& reason) {
  if (size < 30) return true;  // stb rejects it
  const uint32_t offset = le32(data + 10), hsz = le32(data + 14);
  int64_t w, h, bpp;
  if (hsz == 12) {
    w = le16(data + 18), h = le16(data + 20), bpp = le16(data + 24);
  } else {
    w = int32_t(le32(data + 18)), h = int32_t(le32(data + 22)), bpp = le16(data + 28);
  }
  h = h < 0 ? -h : h;
  if (w <= 0 || h <= 0 || bpp <= 0) return true;  // stb rejects it (after check_size)
  const int64_t stride = (w * bpp + 31) / 32 * 4, need = int64_t(offset) + (h - 1) * stride + (w * bpp + 7) / 8;
  if (int64_t(size) >= need) return true;
  reason = fmt::format("BMP: truncated ({}x{} at {} bits need {} bytes, the file has {})", w, h, bpp, need, size);
  return false;
}

bool decode_bmp(const uint8_t* data, size_t size, int channels, Mode mode, std::vector<uint8_t>& out,
                ImageInfo& info, std::string& reason) {
  int w = 0, h = 0, c = 0;
  if (size > size_t(INT_MAX) || !stbi_info_from_memory(data, int(size), &w, &h, &c)) {
    const char* r = size > size_t(INT_MAX) ? "larger than 2 GiB" : stbi_failure_reason();
    reason = fmt::format("BMP: {}", r ? r : "not readable");
    return false;
  }
  if (!check_size("BMP", w, h, reason) || !bmp_complete(data, size, reason)) return false;
  info.width = w;
  info.height = h;
  if (mode == Mode::kHeader) {
    info.channels = c;
    return true;
  }
  int file_channels = 0;
  stbi_uc* p = stbi_load_from_memory(data, int(size), &w, &h, &file_channels, channels);
  if (!p) {
    const char* r = stbi_failure_reason();  // thread-local in stb_image
    reason = fmt::format("BMP: {}", r ? r : "unknown decoder error");
    return false;
  }
  info.channels = channels;
  const size_t n = size_t(w) * size_t(h) * size_t(channels);
  try {
    out.assign(p, p + n);
  } catch (...) {
    stbi_image_free(p);
    throw;
  }
  stbi_image_free(p);
  return true;
}

bool dispatch(const uint8_t* data, size_t size, int channels, Mode mode, std::vector<uint8_t>& out,
              ImageInfo& info, std::string& reason) {
  info = {};
  if (size >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF)
    return decode_jpeg(data, size, channels, mode, out, info, reason);
  if (size >= 8 && memcmp(data, "\x89PNG\r\n\x1a\n", 8) == 0)
    return decode_png(data, size, channels, mode, out, info, reason);
  if (size >= 2 && data[0] == 'B' && data[1] == 'M') return decode_bmp(data, size, channels, mode, out, info, reason);
  reason = size == 0 ? "empty file" : "not a PNG, JPEG or BMP image";
  return false;
}

}  // namespace

bool image_info(const uint8_t* data, size_t size, ImageInfo& info, std::string& reason) {
  std::vector<uint8_t> unused;
  return dispatch(data, size, 0, Mode::kHeader, unused, info, reason);
}

bool decode_image(const uint8_t* data, size_t size, int channels, std::vector<uint8_t>& pixels, ImageInfo& info,
                  std::string& reason) {
  DTRAIN_CHECK(channels >= 1 && channels <= 4, "decode_image: {} channels", channels);
  return dispatch(data, size, channels, Mode::kDecode, pixels, info, reason);
}

bool check_image(const uint8_t* data, size_t size, ImageInfo& info, std::string& reason, std::vector<uint8_t>& scratch) {
  ImageInfo decoded;
  return image_info(data, size, info, reason) && dispatch(data, size, 1, Mode::kCheck, scratch, decoded, reason);
}

}  // namespace dtrain::data

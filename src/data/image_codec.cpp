#include "data/image_codec.h"

#include <climits>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STBI_WRITE_NO_STDIO
#include <stb/stb_image_write.h>

#define STB_IMAGE_RESIZE_IMPLEMENTATION
#define STB_IMAGE_RESIZE_STATIC
#include <stb/stb_image_resize.h>

namespace dtrain::data {

std::string encode_png(const uint8_t* pixels, int w, int h, int c) {
  DTRAIN_CHECK(w > 0 && h > 0 && c >= 1 && c <= 4, "encode_png: bad image {}x{}x{}", w, h, c);
  int len = 0;
  unsigned char* png = stbi_write_png_to_mem(pixels, w * c, w, h, c, &len);
  if (!png) fault("PNG encoding of a {}x{}x{} image failed (out of memory?)", w, h, c);
  std::string out(reinterpret_cast<const char*>(png), size_t(len));
  free(png);
  return out;
}

namespace {

// Python's round() of d / 2 (halves to even), as torchvision's CenterCrop computes offsets.
int half_round_even(int d) {
  const int q = d / 2;
  return (d % 2 == 0 || q % 2 == 0) ? q : q + 1;
}

}  // namespace

ResizePlan plan_resize_center_crop(int w, int h, int resize, int size) {
  DTRAIN_CHECK(w > 0 && h > 0 && size > 0 && resize >= size, "plan_resize_center_crop: {}x{} to {} then {}", w, h,
               resize, size);
  ResizePlan r;
  if (w <= h) {
    r.width = resize;
    r.height = int(int64_t(resize) * h / w);
  } else {
    r.height = resize;
    r.width = int(int64_t(resize) * w / h);
  }
  r.top = half_round_even(r.height - size);
  r.left = half_round_even(r.width - size);
  return r;
}

namespace {

void center_crop(const uint8_t* src, int w, int c, const ResizePlan& r, int size, std::vector<uint8_t>& out) {
  out.resize(size_t(size) * size_t(size) * size_t(c));
  for (int y = 0; y < size; ++y)
    memcpy(out.data() + size_t(y) * size_t(size) * size_t(c),
           src + (size_t(y + r.top) * size_t(w) + size_t(r.left)) * size_t(c), size_t(size) * size_t(c));
}

// src rows of `stride` bytes, iw x ih x c -> ow x oh x c into out (triangle filter)
void resize_triangle(const uint8_t* src, int iw, int ih, int stride, int c, int ow, int oh, uint8_t* out) {
  if (!stbir_resize_uint8_generic(src, iw, ih, stride, out, ow, oh, ow * c, c, STBIR_ALPHA_CHANNEL_NONE, 0,
                                  STBIR_EDGE_CLAMP, STBIR_FILTER_TRIANGLE, STBIR_COLORSPACE_LINEAR, nullptr))
    fault("resizing a {}x{}x{} image to {}x{} failed (out of memory?)", iw, ih, c, ow, oh);
}

// PyTorch's "nearest": destination (x, y) reads source (floor(x * iw / ow), floor(y * ih / oh))
// of the iw x ih window at (x0, y0) of a w-wide image.
void resize_nearest(const uint8_t* src, int w, int x0, int y0, int iw, int ih, int ow, int oh, int top, int left,
                    int size, std::vector<uint8_t>& out) {
  out.resize(size_t(size) * size_t(size));
  for (int y = 0; y < size; ++y) {
    const size_t sy = size_t(y0) + size_t(int64_t(y + top) * ih / oh);
    for (int x = 0; x < size; ++x)
      out[size_t(y) * size_t(size) + size_t(x)] = src[sy * size_t(w) + size_t(x0) + size_t(int64_t(x + left) * iw / ow)];
  }
}

}  // namespace

void resize_center_crop(const uint8_t* src, int w, int h, int c, int resize, int size, std::vector<uint8_t>& out) {
  const ResizePlan r = plan_resize_center_crop(w, h, resize, size);
  if (r.width == w && r.height == h) return center_crop(src, w, c, r, size, out);
  std::vector<uint8_t> scaled(size_t(r.width) * size_t(r.height) * size_t(c));
  resize_triangle(src, w, h, w * c, c, r.width, r.height, scaled.data());
  center_crop(scaled.data(), r.width, c, r, size, out);
}

void resize_center_crop_nearest(const uint8_t* src, int w, int h, int resize, int size, std::vector<uint8_t>& out) {
  const ResizePlan r = plan_resize_center_crop(w, h, resize, size);
  resize_nearest(src, w, 0, 0, w, h, r.width, r.height, r.top, r.left, size, out);
}

void resize_box(const uint8_t* src, int w, int c, const Box& b, int size, std::vector<uint8_t>& out) {
  out.resize(size_t(size) * size_t(size) * size_t(c));
  resize_triangle(src + (size_t(b.y) * size_t(w) + size_t(b.x)) * size_t(c), b.w, b.h, w * c, c, size, size,
                  out.data());
}

void resize_box_nearest(const uint8_t* src, int w, const Box& b, int size, std::vector<uint8_t>& out) {
  resize_nearest(src, w, b.x, b.y, b.w, b.h, size, size, 0, 0, size, out);
}

}  // namespace dtrain::data

#pragma once
// Image encode/decode through stb_image / stb_image_write (the only translation unit
// that compiles their implementations is image_codec.cpp).
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::data {

// PNG of an 8-bit image, rows of w*c bytes (c = 1 gray, 2 gray+alpha, 3 RGB, 4 RGBA).
std::string encode_png(const uint8_t* pixels, int w, int h, int c);

struct ImageInfo {
  int width = 0, height = 0, channels = 0;
};
// Reads the header only; false when stb_image does not recognise the data.
bool image_info(const uint8_t* data, size_t size, ImageInfo& info);

// Decodes to 8-bit pixels with `channels` channels (stb converts gray<->RGB);
// returns false (and a reason) when the data does not decode.
bool decode_image(const uint8_t* data, size_t size, int channels, std::vector<uint8_t>& pixels, ImageInfo& info,
                  std::string& reason);

// data.image_size / data.resize_size: torchvision's Resize(resize) then CenterCrop(size). The
// shorter side becomes `resize` (the longer one resize * long / short, truncated), then the
// centre size x size is kept (offsets round((scaled - size) / 2), halves to even, as Python
// rounds). resize >= size.
struct ResizePlan {
  int width = 0, height = 0;  // after the resize
  int top = 0, left = 0;      // of the crop
};
ResizePlan plan_resize_center_crop(int w, int h, int resize, int size);
// 8-bit pixels (rows of w*c bytes) -> size x size x c: triangle (bilinear) filter, widened
// when shrinking (antialiased, as PIL's and torchvision's bilinear), clamped edges. An image
// whose shorter side already is `resize` is only cropped.
void resize_center_crop(const uint8_t* src, int w, int h, int c, int resize, int size, std::vector<uint8_t>& out);
// The same geometry for class masks (one channel): nearest neighbour, so every output value
// is a class of the input.
void resize_center_crop_nearest(const uint8_t* src, int w, int h, int resize, int size, std::vector<uint8_t>& out);

// A rectangle of an image (RandomResizedCrop's choice) resized to size x size: the same
// filter as above over that rectangle only, and nearest neighbour for masks.
struct Box {
  int x = 0, y = 0, w = 0, h = 0;
};
void resize_box(const uint8_t* src, int w, int c, const Box& b, int size, std::vector<uint8_t>& out);
void resize_box_nearest(const uint8_t* src, int w, const Box& b, int size, std::vector<uint8_t>& out);

}  // namespace dtrain::data

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

}  // namespace dtrain::data

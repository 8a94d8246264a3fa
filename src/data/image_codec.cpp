#include "data/image_codec.h"

#include <climits>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

#define STB_IMAGE_IMPLEMENTATION
#define STBI_NO_STDIO
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_ONLY_BMP
#include <stb/stb_image.h>

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STBI_WRITE_NO_STDIO
#include <stb/stb_image_write.h>

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

bool image_info(const uint8_t* data, size_t size, ImageInfo& info) {
  if (size > size_t(INT_MAX)) return false;
  return stbi_info_from_memory(data, int(size), &info.width, &info.height, &info.channels) != 0;
}

bool decode_image(const uint8_t* data, size_t size, int channels, std::vector<uint8_t>& pixels, ImageInfo& info,
                  std::string& reason) {
  if (size > size_t(INT_MAX)) {
    reason = "image larger than 2 GiB";
    return false;
  }
  int file_channels = 0;
  stbi_uc* p = stbi_load_from_memory(data, int(size), &info.width, &info.height, &file_channels, channels);
  if (!p) {
    const char* r = stbi_failure_reason();  // thread-local in stb_image
    reason = r ? r : "unknown decoder error";
    return false;
  }
  info.channels = channels;
  size_t n = size_t(info.width) * size_t(info.height) * size_t(channels);
  pixels.resize(n);
  memcpy(pixels.data(), p, n);
  stbi_image_free(p);
  return true;
}

}  // namespace dtrain::data

#pragma once
// Images: decoding of untrusted bytes (image_decode.cpp: JPEG by libjpeg-turbo, PNG by
// libpng, BMP by stb_image), PNG encoding (stb_image_write) and resizing (stb_image_resize)
// in image_codec.cpp.
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::data {

// PNG of an 8-bit image, rows of w*c bytes (c = 1 gray, 2 gray+alpha, 3 RGB, 4 RGBA).
std::string encode_png(const uint8_t* pixels, int w, int h, int c);

struct ImageInfo {
  int width = 0, height = 0, channels = 0;
};
// The largest image decoded: a header claiming more is refused before anything is allocated.
// 89478485 pixels is 256 MiB as 8-bit RGB (and PIL's Image.MAX_IMAGE_PIXELS).
inline constexpr int kMaxImageSide = 32768;
inline constexpr int64_t kMaxImagePixels = 89478485;

// Reads the header only (size and channels: 1 gray, 2 gray+alpha, 3 RGB, 4 RGBA; a JPEG is 1
// or 3, a PNG palette 3, or 4 with transparency). False, with a one-line reason, when the
// data is not a PNG, JPEG or BMP, its header is unreadable or claims more than the limits.
bool image_info(const uint8_t* data, size_t size, ImageInfo& info, std::string& reason);

// Decodes to 8-bit pixels with `channels` (1..4) channels; false, with a one-line reason, when
// the data does not decode: corrupt, truncated, over the limits. Conversions are
// stb_image's: gray replicated to RGB, RGB to gray (77 R + 150 G + 29 B) >> 8, alpha
// dropped or 255 when absent, 16-bit samples keep their high byte; a colour JPEG wanted as
// gray is its Y plane. A JPEG decodes as PIL decodes it (libjpeg-turbo, ISLOW DCT, fancy
// upsampling, CMYK as Adobe's inverted CMYK) and a PNG as stb_image decoded it.
bool decode_image(const uint8_t* data, size_t size, int channels, std::vector<uint8_t>& pixels, ImageInfo& info,
                  std::string& reason);

// image_info, then a decode of the whole image to refuse a corrupt or truncated file before
// it is written into a dataset: as one gray channel, and a JPEG at 1/8 scale (every
// coefficient of every plane is still entropy-decoded, so corrupt data anywhere shows, but
// the IDCT is the DC term only). `scratch` holds the pixels.
bool check_image(const uint8_t* data, size_t size, ImageInfo& info, std::string& reason, std::vector<uint8_t>& scratch);

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

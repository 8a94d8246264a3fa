#pragma once
// Segmentation datasets (WebDataset shards with KEY.png + KEY.mask.png; the mask is an
// 8-bit single-channel PNG whose value is the class, 0 = background), and the two
// commands that write them:
//   dtrain data shapes --out DIR [--count N --size S --classes K --seed S --val-fraction F]
//     synthetic circles / rectangles / triangles (class 1..K-1, shape kind (class-1) % 3)
//     on noisy RGB backgrounds; splits "train" and "val" (the last round(N*F) samples).
//   dtrain data segmentation IMAGES MASKS --out DIR [--split S]
//     a user's folders: IMAGES/<stem>.png|jpg|jpeg|bmp paired with MASKS/<stem>.png.
// manifest.json is the image format (data/manifest.h) with num_classes = K and classes
// ["background", ...]. Generation is deterministic: sample i draws from
// Rng(seed, stream_id(i, 0x5348415045)).
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

namespace data {

struct ShapesSpec {
  std::string out;
  int count = 2000, size = 64, classes = 4;
  uint64_t seed = 0;
  double val_fraction = 0.1;
};
void write_shapes_dataset(const ShapesSpec& a);

struct SegmentationSpec {
  std::string images, masks, out, split = "train";
};
void convert_segmentation(const SegmentationSpec& a);

// One synthetic sample: rgb (size*size*3) and mask (size*size) for index i.
void make_shape_sample(uint64_t seed, int64_t index, int size, int classes,
                       std::vector<uint8_t>& rgb, std::vector<uint8_t>& mask);

// Names of the classes of a shapes dataset: background, circle, rectangle, triangle,
// circle2, ...
std::vector<std::string> shape_class_names(int classes);

}  // namespace data
}  // namespace dtrain

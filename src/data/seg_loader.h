#pragma once
// SegLoader: batches of (image, mask) pairs from a segmentation WebDataset split
// (KEY.<png|jpg|...> + KEY.mask.png, see data/shapes.h), decoded by prefetch threads.
//
// Sampling, prefetching and errors are LoaderCore's (data/loader_core.h).
// With image_size S > 0 the image and its mask first become S x S (as ImageLoader; the mask by
// nearest neighbour, so it keeps its classes); mixed-size splits need it.
// Augmentation of sample i in epoch e draws from Rng(seed, stream_id(e, i, 0x4155)), and
// applies identically to image and mask: random crop with `crop_padding` pixels of zero
// padding on each side (image pixel 0, mask 0 = background; two below(2p+1) draws), then
// horizontal flip (one uniform draw, p=0.5) when hflip, then vertical flip (one uniform
// draw) when vflip. Pixels become x/255, then (x-mean)/std. Results never depend on the
// worker count.
// Errors (UserError, naming the shard and key): a sample without a mask, a mask whose size
// differs from its image, a mask value >= num_classes; raised by next().
// Shards are read into memory at construction.
#include <cstdint>
#include <string>
#include <vector>

#include "data/image_loader.h"  // output_size, random_resized_box
#include "data/loader_core.h"

namespace dtrain::data {

struct SegLoaderOptions : LoaderOptions {
  bool vflip = false;
  int num_classes = 0;  // 0 = the manifest's
};

struct SegBatch {
  std::vector<float> images;    // NHWC f32
  std::vector<int32_t> labels;  // [n, h, w]
  int64_t n = 0, h = 0, w = 0, c = 0, epoch = 0;
};

class SegLoader : public BatchLoader<SegBatch> {
 public:
  explicit SegLoader(const SegLoaderOptions& o);
  ~SegLoader() override;

 private:
  struct Sample {
    int shard;
    std::string key;
    uint64_t img_off = 0, img_size = 0, mask_off = 0, mask_size = 0;
  };
  void produce(const BatchPlan& plan, SegBatch& b, int worker) override;

  SegLoaderOptions o_;
  std::vector<std::string> shard_names_;
  std::vector<std::vector<uint8_t>> shard_bytes_;
  std::vector<Sample> samples_;
};

}  // namespace dtrain::data

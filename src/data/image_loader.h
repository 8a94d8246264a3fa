#pragma once
// ImageLoader: batches of decoded, augmented, normalised images from a WebDataset split
// (see data/README.md), prefetched by worker threads.
//
// Sampling, prefetching and errors are LoaderCore's (data/loader_core.h).
// With image_size S > 0 every decoded image first becomes S x S: shorter side resized to
// R = resize_size (default S), centre crop S (torchvision's Resize(R) + CenterCrop(S)), or,
// with random_resized_crop (training), RandomResizedCrop(S) drawing from
// Rng(seed, stream_id(e, i, 0x525243)); a split of mixed sizes (manifest height = width = 0)
// needs image_size. Augmentation of sample i in epoch e draws from Rng(seed, stream_id(e, i, 0x4155)):
// random crop with `crop_padding` zero pixels on each side (two below(2p+1) draws), then
// horizontal flip with p=0.5 (one uniform draw); pixels become x/255, then (x-mean)/std.
// Results therefore never depend on the number of workers or thread timing. For eval,
// use shuffle=false, crop_padding=0, hflip=false.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "data/image_codec.h"
#include "data/loader_core.h"
#include "data/manifest.h"

namespace dtrain::data {

struct ImageLoaderOptions : LoaderOptions {
  int num_classes_expected = 0;  // 0 = don't check
  int channels_expected = 0;     // 0 = don't check
};

// torchvision's RandomResizedCrop.get_params: up to 10 tries of an area fraction uniform in
// [scale_min, 1] and a log-uniform aspect ratio in [3/4, 4/3] (w = round(sqrt(area * ratio)),
// h = round(sqrt(area / ratio))) that fits, at a uniform position; else the centre crop with
// the ratio clamped to that range. Draws from `rng` only.
Box random_resized_box(int width, int height, Rng& rng, double scale_min);

// The loaders' checks of image_size / resize_size / random_resized_crop / crop_scale_min
// (UserError naming the data.* key), and their output (height, width): image_size squared, or
// the split's one size; a split of mixed sizes (0 x 0) without image_size is a UserError.
std::pair<int, int> output_size(int image_size, int resize_size, bool random_resized_crop, float scale_min,
                                const SplitInfo& s, const std::string& root, const std::string& split);

struct ImageBatch {
  std::vector<float> images;  // NHWC f32, n*h*w*c
  std::vector<int32_t> labels;
  int64_t n = 0, h = 0, w = 0, c = 0;
  int64_t epoch = 0;
};

// A sample that fails to decode is a UserError naming shard and key, rethrown by next().
class ImageLoader : public BatchLoader<ImageBatch> {
 public:
  explicit ImageLoader(const ImageLoaderOptions& opt);
  ~ImageLoader() override;

 private:
  struct Sample {
    int32_t shard;
    int32_t label;
    uint64_t offset, size;
    std::string key;
  };
  struct Scratch {
    std::vector<uint8_t> enc, pix, sized;
  };

  void index_shards(const SplitInfo& s);
  void produce(const BatchPlan& plan, ImageBatch& b, int worker) override;

  ImageLoaderOptions opt_;
  std::vector<std::string> shard_paths_;
  std::vector<int> fds_;
  std::vector<Sample> samples_;
  std::vector<float> lut_;  // [channel][pixel value] -> (value/255 - mean)/std
  std::vector<Scratch> scratch_;  // one per worker
};

}  // namespace dtrain::data

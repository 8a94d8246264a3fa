#pragma once
// ImageLoader: batches of decoded, augmented, normalised images from a WebDataset split
// (see data/README.md), prefetched by worker threads.
//
// Sampling (like PyTorch's DistributedSampler + DataLoader):
//  - epoch e orders all N samples by a Fisher-Yates permutation drawn from
//    Rng(seed, stream_id(e, 0x5348)) (identity order when shuffle is off);
//  - drop_last=false: the permutation is padded by repeating its head to a multiple of
//    world_size, so every rank gets ceil(N/W) samples and the last batch may be short;
//    drop_last=true: it is truncated to floor(N/W)*W samples and each rank drops its
//    last partial batch;
//  - rank r takes positions r, r+W, r+2W, ... of that list (disjoint across ranks,
//    except for the few padded repeats).
// With image_size S > 0 every decoded image first becomes S x S: shorter side resized to
// R = resize_size (default S), centre crop S (torchvision's Resize(R) + CenterCrop(S)), or,
// with random_resized_crop (training), RandomResizedCrop(S) drawing from
// Rng(seed, stream_id(e, i, 0x525243)); a split of mixed sizes (manifest height = width = 0)
// needs image_size. Augmentation of sample i in epoch e draws from Rng(seed, stream_id(e, i, 0x4155)):
// random crop with `crop_padding` zero pixels on each side (two below(2p+1) draws), then
// horizontal flip with p=0.5 (one uniform draw); pixels become x/255, then (x-mean)/std.
// Results therefore never depend on the number of workers or thread timing. For eval,
// use shuffle=false, crop_padding=0, hflip=false.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/rng.h"
#include "data/image_codec.h"
#include "data/manifest.h"

namespace dtrain::data {

struct ImageLoaderOptions {
  std::string root;   // dataset directory holding manifest.json
  std::string split;  // "train", "test", ...
  int64_t batch_size = 0;
  bool shuffle = true;
  bool drop_last = true;
  uint64_t seed = 0;
  int rank = 0, world_size = 1;
  int workers = 2;   // decoding threads; 0 decodes on the calling thread
  int prefetch = 4;  // batches buffered ahead (ring slots)
  int image_size = 0;   // > 0: every image becomes this square (image_codec.h)
  int resize_size = 0;  // shorter side before the centre crop (0: image_size)
  bool random_resized_crop = false;  // training: RandomResizedCrop(image_size) instead
  float rrc_scale_min = 0.08f;       // its area range [rrc_scale_min, 1]
  int crop_padding = 0;
  bool hflip = false;
  std::vector<float> mean, std;  // per channel; empty = none (just /255)
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

struct LoaderState {
  int64_t epoch = 0;
  int64_t batch_in_epoch = 0;  // next batch to be returned
  bool operator==(const LoaderState&) const = default;
};

class ImageLoader {
 public:
  explicit ImageLoader(const ImageLoaderOptions& opt);
  ~ImageLoader();
  ImageLoader(const ImageLoader&) = delete;
  ImageLoader& operator=(const ImageLoader&) = delete;

  // Blocks until the next batch is ready; rolls over epochs forever. A sample that fails
  // to decode is rethrown here (UserError naming shard and key), and again on every later
  // call until restore().
  void next(ImageBatch& out);
  LoaderState state() const;              // position after the last batch returned
  void restore(const LoaderState& s);     // before or between next() calls

  int64_t samples_per_epoch() const { return per_rank_; }  // for this rank
  int64_t batches_per_epoch() const { return batches_; }
  int64_t dataset_size() const { return int64_t(samples_.size()); }
  int num_classes() const { return num_classes_; }
  int height() const { return h_; }
  int width() const { return w_; }
  int channels() const { return c_; }

  // This rank's sample indices (into the split) for epoch e, in order (tests, tools).
  std::vector<int64_t> epoch_indices(int64_t epoch) const;

 private:
  struct Sample {
    int32_t shard;
    int32_t label;
    uint64_t offset, size;
    std::string key;
  };
  struct Slot {
    int64_t seq = -1;
    bool ready = false;
    ImageBatch batch;
    std::exception_ptr error;
  };

  void index_shards(const std::string& split_name, const SplitInfo& s);
  std::shared_ptr<const std::vector<int64_t>> cached_indices(int64_t epoch);
  void produce(int64_t seq, ImageBatch& b, std::vector<uint8_t>& enc, std::vector<uint8_t>& pix);
  void worker_loop();
  void start();
  void stop();

  ImageLoaderOptions opt_;
  std::vector<std::string> shard_paths_;
  std::vector<int> fds_;
  std::vector<Sample> samples_;
  int64_t per_rank_ = 0, batches_ = 0;
  int num_classes_ = 0, h_ = 0, w_ = 0, c_ = 0;
  std::vector<float> lut_;  // [channel][pixel value] -> (value/255 - mean)/std

  std::mutex cache_mu_;
  std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> cache_;

  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_ready_;
  std::vector<Slot> ring_;
  std::vector<std::thread> threads_;
  int64_t next_job_ = 0, next_out_ = 0;
  bool running_ = false, stopping_ = false;
  std::exception_ptr failed_;
  std::vector<uint8_t> inline_enc_, inline_pix_;
};

}  // namespace dtrain::data

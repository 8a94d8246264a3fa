#pragma once
// SegLoader: batches of (image, mask) pairs from a segmentation WebDataset split
// (KEY.<png|jpg|...> + KEY.mask.png, see data/shapes.h), decoded by prefetch threads.
//
// Sampling is ImageLoader's (data/image_loader.h): epoch e orders the N samples by a
// Fisher-Yates permutation from Rng(seed, stream_id(e, 0x5348)) (identity without
// shuffle), padded (drop_last=false) or truncated (drop_last=true) to a multiple of
// world_size; rank r takes positions r, r+W, ...
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
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "data/image_loader.h"  // LoaderState

namespace dtrain::data {

struct SegLoaderOptions {
  std::string root, split;
  int64_t batch_size = 0;
  bool shuffle = true, drop_last = true;
  uint64_t seed = 0;
  int rank = 0, world_size = 1;
  int workers = 2;   // 0 decodes on the calling thread
  int prefetch = 4;  // batches ahead
  int image_size = 0;   // > 0: image and mask become this square (as ImageLoader's options)
  int resize_size = 0;  // shorter side before the centre crop (0: image_size)
  bool random_resized_crop = false;  // training: RandomResizedCrop(image_size), the same box for the mask
  float rrc_scale_min = 0.08f;
  int crop_padding = 0;
  bool hflip = false, vflip = false;
  std::vector<float> mean, std;
  int num_classes = 0;  // 0 = the manifest's
};

struct SegBatch {
  std::vector<float> images;    // NHWC f32
  std::vector<int32_t> labels;  // [n, h, w]
  int64_t n = 0, h = 0, w = 0, c = 0, epoch = 0;
};

class SegLoader {
 public:
  explicit SegLoader(const SegLoaderOptions& o);
  ~SegLoader();
  SegLoader(const SegLoader&) = delete;
  SegLoader& operator=(const SegLoader&) = delete;

  void next(SegBatch& out);
  LoaderState state() const;
  void restore(const LoaderState& s);
  int64_t batches_per_epoch() const { return batches_; }
  int64_t dataset_size() const { return int64_t(samples_.size()); }
  int num_classes() const { return k_; }
  int height() const { return h_; }
  int width() const { return w_; }
  int channels() const { return c_; }
  std::vector<int64_t> epoch_indices(int64_t epoch) const;

 private:
  struct Sample {
    int shard;
    std::string key;
    uint64_t img_off = 0, img_size = 0, mask_off = 0, mask_size = 0;
  };
  void produce(int64_t seq, SegBatch& b) const;
  void worker();
  void start();
  void stop();

  SegLoaderOptions o_;
  std::vector<std::string> shard_names_;
  std::vector<std::vector<uint8_t>> shard_bytes_;
  std::vector<Sample> samples_;
  int64_t per_rank_ = 0, batches_ = 0;
  int k_ = 0, h_ = 0, w_ = 0, c_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_ready_;
  std::map<int64_t, std::pair<SegBatch, std::exception_ptr>> done_;
  std::vector<std::thread> threads_;
  int64_t next_job_ = 0, next_out_ = 0;
  bool stopping_ = false;
};

}  // namespace dtrain::data

#pragma once
// The recipe keys every image loader shares (ImageLoaderOptions, SegLoaderOptions): one
// place that maps [data]/[train]/[eval] onto a loader's options.
#include <cstdint>
#include <string>

#include "config/config.h"

namespace dtrain {

// Training loaders shuffle, drop the last partial batch, augment and take this rank's
// part; evaluation loaders read the whole split in order.
template <typename Options>
void fill_loader_options(Options& o, const Config& cfg, const std::string& split, bool training, int rank,
                         int world) {
  if (training) {
    o.rank = rank;
    o.world_size = world;
    o.crop_padding = int(cfg.data.crop_padding);
    o.hflip = cfg.data.hflip;
    o.random_resized_crop = cfg.data.random_resized_crop;
    o.rrc_scale_min = float(cfg.data.crop_scale_min);
  }
  o.image_size = int(cfg.data.image_size);
  o.resize_size = int(cfg.data.resize_size);
  o.root = cfg.data.path;
  o.split = split;
  o.batch_size = training ? cfg.train.batch_size : cfg.eval.batch_size;
  o.shuffle = training;
  o.drop_last = training;
  o.seed = uint64_t(cfg.run.seed);
  o.workers = int(cfg.data.workers);
  o.prefetch = int(cfg.data.prefetch);
  for (double m : cfg.data.mean) o.mean.push_back(float(m));
  for (double s : cfg.data.std) o.std.push_back(float(s));
}

}  // namespace dtrain

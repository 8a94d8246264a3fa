#pragma once
// Synthetic image batches for benchmarks (data.kind = "synthetic"): standard-normal NHWC
// pixels and uniform labels. Batch g is drawn from Rng(seed, stream_id(g, 0x5359)), so
// it depends only on (seed, g); no I/O, no decoding.
#include <cstdint>

#include "data/image_loader.h"

namespace dtrain::data {

class SyntheticImageLoader {
 public:
  SyntheticImageLoader(int64_t batch_size, int height, int width, int channels, int num_classes, uint64_t seed,
                       int64_t batches_per_epoch = 1000);
  void next(ImageBatch& out);
  LoaderState state() const { return {pos_ / batches_, pos_ % batches_}; }
  void restore(const LoaderState& s) { pos_ = s.epoch * batches_ + s.batch_in_epoch; }
  int64_t batches_per_epoch() const { return batches_; }
  int num_classes() const { return classes_; }
  int height() const { return h_; }
  int width() const { return w_; }
  int channels() const { return c_; }

 private:
  int64_t batch_, batches_, pos_ = 0;
  int h_, w_, c_, classes_;
  uint64_t seed_;
};

}  // namespace dtrain::data

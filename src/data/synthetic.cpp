#include "data/synthetic.h"

#include "core/error.h"
#include "core/rng.h"

namespace dtrain::data {

SyntheticImageLoader::SyntheticImageLoader(int64_t batch_size, int height, int width, int channels, int num_classes,
                                           uint64_t seed, int64_t batches_per_epoch)
    : batch_(batch_size), batches_(batches_per_epoch), h_(height), w_(width), c_(channels), classes_(num_classes),
      seed_(seed) {
  if (batch_ < 1 || h_ < 1 || w_ < 1 || c_ < 1 || classes_ < 1 || batches_ < 1)
    user_error("synthetic data: batch {}, image {}x{}x{}, {} classes, {} batches per epoch must all be >= 1", batch_,
               h_, w_, c_, classes_, batches_);
}

void SyntheticImageLoader::next(ImageBatch& out) {
  Rng rng(seed_, stream_id(uint64_t(pos_), 0x5359));
  out.n = batch_;
  out.h = h_;
  out.w = w_;
  out.c = c_;
  out.epoch = pos_ / batches_;
  out.images.resize(size_t(batch_) * h_ * w_ * c_);
  for (float& v : out.images) v = rng.normal();
  out.labels.resize(size_t(batch_));
  for (int32_t& l : out.labels) l = int32_t(rng.below(uint64_t(classes_)));
  ++pos_;
}

}  // namespace dtrain::data

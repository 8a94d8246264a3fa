#pragma once
// LoaderCore / BatchLoader<Batch>: the sampling and prefetching shared by ImageLoader
// (data/image_loader.h) and SegLoader (data/seg_loader.h); the loaders only index their
// shards and turn one planned batch of sample indices into a batch.
//
// Sampling (like PyTorch's DistributedSampler + DataLoader):
//  - epoch e orders all N samples by a Fisher-Yates permutation drawn from
//    Rng(seed, stream_id(e, 0x5348)) (identity order when shuffle is off);
//  - drop_last=true (training): the permutation is cut into whole batches of batch_size
//    (the last partial one dropped), and rank r takes batches r, r+W, r+2W, ...
//    (floor(floor(N/B)/W) each): rank r's micro-batch j of a step is micro-batch j*W + r
//    of one process with grad_accum W (x the ranks' grad_accum), so N ranks see exactly
//    the batches one process does and give its losses (the same number of devices or not);
//  - drop_last=false (evaluation): the permutation is padded by repeating its head to a
//    multiple of world_size, every rank gets ceil(N/W) samples (the last batch may be
//    short), rank r taking positions r, r+W, r+2W, ... (disjoint across ranks, except
//    for the few padded repeats).
// Prefetching: `workers` threads produce batches in sequence order into `prefetch` ring
// slots ahead of the consumer (workers = 0: next() produces on the calling thread). Batch
// `seq` is (epoch seq / B, batch seq % B) for B batches an epoch, so results never depend
// on the number of workers or thread timing. A batch that fails to produce is rethrown by
// next(), and again on every later call until restore().
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dtrain::data {

// The options both image loaders share (session/loader_options.h fills them from the recipe).
struct LoaderOptions {
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
};

struct LoaderState {
  int64_t epoch = 0;
  int64_t batch_in_epoch = 0;  // next batch to be returned
  bool operator==(const LoaderState&) const = default;
};

// One batch to produce: this rank's samples [begin, begin + n) of epoch `epoch`.
struct BatchPlan {
  int64_t epoch = 0;
  std::shared_ptr<const std::vector<int64_t>> order;  // this rank's sample indices of the epoch
  int64_t begin = 0, n = 0;
  int64_t sample(int64_t j) const { return (*order)[size_t(begin + j)]; }  // j in [0, n)
};

class LoaderCore {
 public:
  LoaderState state() const;  // position after the last batch returned
  // Before or between next() calls; a position outside the epoch is a UserError.
  void restore(const LoaderState& s);

  int64_t samples_per_epoch() const { return per_rank_; }  // for this rank
  int64_t batches_per_epoch() const { return batches_; }
  int64_t dataset_size() const { return n_; }
  int num_classes() const { return num_classes_; }
  int height() const { return h_; }
  int width() const { return w_; }
  int channels() const { return c_; }

  // This rank's sample indices (into the split) for epoch e, in order (tests, tools).
  std::vector<int64_t> epoch_indices(int64_t epoch) const;

 protected:
  // Checks the sampling and prefetch options (UserError naming the key).
  explicit LoaderCore(const LoaderOptions& o);
  virtual ~LoaderCore();
  // The split has n samples: sets the per-rank sizes (UserError naming root and split when
  // a rank gets no sample or no batch). Call once, before next().
  void set_dataset_size(int64_t n);
  size_t ring_slots() const { return slots_; }  // prefetch, plus one for workers = 0
  // Fills ring slot `slot` with the batch `plan`; `worker` in [0, max(workers, 1)) names
  // the caller's scratch. Runs on worker threads.
  virtual void produce_slot(const BatchPlan& plan, size_t slot, int worker) = 0;
  // Waits for the next batch, calls take(slot) to move it out, advances.
  void next_slot(const std::function<void(size_t)>& take);
  void start();  // prefetch now (else on the first next())
  void stop();   // joins the workers: the derived destructor calls it first

  int num_classes_ = 0, h_ = 0, w_ = 0, c_ = 0;

 private:
  struct Slot {
    int64_t seq = -1;
    bool ready = false;
    std::exception_ptr error;
  };
  BatchPlan plan(int64_t seq);
  std::shared_ptr<const std::vector<int64_t>> cached_order(int64_t epoch);
  void worker_loop(int worker);

  std::string root_, split_;
  int64_t batch_size_;
  bool shuffle_, drop_last_;
  uint64_t seed_;
  int rank_, world_, workers_;
  size_t slots_;
  int64_t n_ = 0, per_rank_ = 0, batches_ = 0;

  std::mutex cache_mu_;
  std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> cache_;

  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_ready_;
  std::vector<Slot> ring_;
  std::vector<std::thread> threads_;
  int64_t next_job_ = 0, next_out_ = 0;
  bool running_ = false, stopping_ = false;
  std::exception_ptr failed_;
};

// A loader of `Batch`es: the derived loader implements produce(); the ring holds the
// batches (reused: next() swaps the caller's old buffers into the slot).
template <class Batch>
class BatchLoader : public LoaderCore {
 public:
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // Blocks until the next batch is ready; rolls over epochs forever.
  void next(Batch& out) {
    next_slot([&](size_t slot) { std::swap(out, ring_[slot]); });
  }

 protected:
  explicit BatchLoader(const LoaderOptions& o) : LoaderCore(o), ring_(ring_slots()) {}
  virtual void produce(const BatchPlan& plan, Batch& b, int worker) = 0;

 private:
  void produce_slot(const BatchPlan& plan, size_t slot, int worker) final { produce(plan, ring_[slot], worker); }
  std::vector<Batch> ring_;
};

}  // namespace dtrain::data

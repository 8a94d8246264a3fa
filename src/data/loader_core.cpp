#include "data/loader_core.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace dtrain::data {

LoaderCore::LoaderCore(const LoaderOptions& o)
    : root_(o.root),
      split_(o.split),
      batch_size_(o.batch_size),
      shuffle_(o.shuffle),
      drop_last_(o.drop_last),
      seed_(o.seed),
      rank_(o.rank),
      world_(o.world_size),
      workers_(o.workers) {
  if (o.batch_size < 1) user_error("data: batch_size must be >= 1, got {}", o.batch_size);
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    user_error("data: rank {} is not in [0, world_size={})", o.rank, o.world_size);
  if (o.workers < 0) user_error("data: workers must be >= 0, got {}", o.workers);
  if (o.prefetch < 1) user_error("data: prefetch must be >= 1, got {}", o.prefetch);
  if (o.crop_padding < 0) user_error("data: crop_padding must be >= 0, got {}", o.crop_padding);
  slots_ = size_t(o.prefetch) + 1;  // the last one takes the batches of workers = 0
  ring_.resize(size_t(o.prefetch));
}

LoaderCore::~LoaderCore() { stop(); }

void LoaderCore::set_dataset_size(int64_t n) {
  const int64_t W = world_;
  n_ = n;
  if (drop_last_) {  // whole batches of the epoch's order, dealt out to the ranks in turn
    batches_ = n / batch_size_ / W;
    per_rank_ = batches_ * batch_size_;
  } else {
    per_rank_ = (n + W - 1) / W;
    batches_ = (per_rank_ + batch_size_ - 1) / batch_size_;
  }
  if (per_rank_ == 0 && !drop_last_)
    user_error("{}: split '{}' has {} samples, fewer than the {} ranks", root_, split_, n, W);
  if (batches_ == 0)
    user_error("{}: split '{}' has {} samples, less than one batch of {} per rank for {} rank(s) (drop_last)", root_,
               split_, n, batch_size_, W);
}

std::vector<int64_t> LoaderCore::epoch_indices(int64_t epoch) const {
  const int64_t n = n_, W = world_;
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  if (shuffle_) {
    Rng rng(seed_, stream_id(uint64_t(epoch), 0x5348));
    for (int64_t i = n - 1; i > 0; --i) std::swap(perm[size_t(i)], perm[size_t(rng.below(uint64_t(i + 1)))]);
  }
  std::vector<int64_t> mine(static_cast<size_t>(per_rank_));
  if (drop_last_) {
    // Batch b of this rank is batch b * W + rank of the epoch's order: one process with
    // grad_accum W (and the same batch size) takes the same batches, so it sees the same
    // micro-batches (BatchNorm statistics included) as W ranks do.
    const int64_t B = batch_size_;
    for (int64_t k = 0; k < per_rank_; ++k) mine[size_t(k)] = perm[size_t(((k / B) * W + rank_) * B + k % B)];
  } else {
    // Pad (repeating the head) to per_rank_*W, then take every W-th from rank.
    for (int64_t k = 0; k < per_rank_; ++k) mine[size_t(k)] = perm[size_t((rank_ + k * W) % n)];
  }
  return mine;
}

std::shared_ptr<const std::vector<int64_t>> LoaderCore::cached_order(int64_t epoch) {
  std::lock_guard<std::mutex> lk(cache_mu_);
  auto it = cache_.find(epoch);
  if (it != cache_.end()) return it->second;
  auto p = std::make_shared<const std::vector<int64_t>>(epoch_indices(epoch));
  cache_[epoch] = p;
  while (cache_.size() > 3) cache_.erase(cache_.begin());
  return p;
}

BatchPlan LoaderCore::plan(int64_t seq) {
  BatchPlan p;
  p.epoch = seq / batches_;
  p.order = cached_order(p.epoch);
  p.begin = (seq % batches_) * batch_size_;
  p.n = std::min<int64_t>(batch_size_, per_rank_ - p.begin);
  return p;
}

void LoaderCore::worker_loop(int worker) {
  while (true) {
    int64_t seq;
    size_t slot;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return stopping_ || next_job_ < next_out_ + int64_t(ring_.size()); });
      if (stopping_) return;
      seq = next_job_++;
      slot = size_t(seq % int64_t(ring_.size()));
    }
    std::exception_ptr err;
    try {
      produce_slot(plan(seq), slot, worker);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      ring_[slot].seq = seq;
      ring_[slot].ready = true;
      ring_[slot].error = err;
    }
    cv_ready_.notify_all();
  }
}

void LoaderCore::start() {
  if (running_ || workers_ == 0) return;
  stopping_ = false;
  for (auto& s : ring_) s = Slot{};
  next_job_ = next_out_;
  for (int i = 0; i < workers_; ++i) threads_.emplace_back([this, i] { worker_loop(i); });
  running_ = true;
}

void LoaderCore::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  running_ = false;
}

void LoaderCore::next_slot(const std::function<void(size_t)>& take) {
  if (failed_) std::rethrow_exception(failed_);
  if (workers_ == 0) {
    const size_t slot = slots_ - 1;
    try {
      produce_slot(plan(next_out_), slot, 0);
    } catch (...) {
      failed_ = std::current_exception();
      throw;
    }
    take(slot);
    std::lock_guard<std::mutex> lk(mu_);
    ++next_out_;
    return;
  }
  start();
  {
    std::unique_lock<std::mutex> lk(mu_);
    const size_t slot = size_t(next_out_ % int64_t(ring_.size()));
    cv_ready_.wait(lk, [&] { return ring_[slot].ready && ring_[slot].seq == next_out_; });
    if (ring_[slot].error) {
      failed_ = ring_[slot].error;
      std::rethrow_exception(failed_);
    }
    take(slot);  // the slot keeps the caller's old buffers for reuse
    ring_[slot].ready = false;
    ++next_out_;
  }
  cv_work_.notify_all();
}

LoaderState LoaderCore::state() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {next_out_ / batches_, next_out_ % batches_};
}

void LoaderCore::restore(const LoaderState& s) {
  if (s.epoch < 0 || s.batch_in_epoch < 0 || s.batch_in_epoch >= batches_)
    user_error("data: cannot resume at epoch {} batch {}: an epoch has {} batches for this rank (batch size or world "
               "size changed?)",
               s.epoch, s.batch_in_epoch, batches_);
  stop();
  next_out_ = s.epoch * batches_ + s.batch_in_epoch;
  failed_ = nullptr;
}

}  // namespace dtrain::data

#include "data/image_loader.h"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <tuple>

#include "core/error.h"
#include "core/rng.h"
#include "core/sha256.h"
#include "data/image_codec.h"
#include "data/tar.h"

namespace dtrain::data {

namespace fs = std::filesystem;

std::pair<int, int> output_size(int image_size, int resize_size, bool random_resized_crop, float scale_min,
                                const SplitInfo& s, const std::string& root, const std::string& split) {
  if (image_size < 0) user_error("data.image_size = {}: expected >= 0", image_size);
  if (resize_size < 0 || (resize_size > 0 && (image_size == 0 || resize_size < image_size)))
    user_error("data.resize_size = {}: expected 0 or at least data.image_size = {} (> 0)", resize_size, image_size);
  if (random_resized_crop && image_size == 0)
    user_error("data.random_resized_crop needs data.image_size (the side of the crops)");
  if (!(scale_min > 0.f && scale_min <= 1.f))
    user_error("data.crop_scale_min = {}: expected a value in (0, 1]", scale_min);
  if (image_size > 0) return {image_size, image_size};
  if (s.height == 0)
    user_error("{}: split '{}' holds images of mixed sizes: set data.image_size to train on them (each image is "
               "resized and centre-cropped to that square)",
               root, split);
  return {int(s.height), int(s.width)};
}

Box random_resized_box(int width, int height, Rng& rng, double scale_min) {
  const double area = double(width) * double(height);
  const double log_lo = std::log(3.0 / 4.0), log_hi = std::log(4.0 / 3.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (scale_min + (1.0 - scale_min) * rng.uniform_double());
    const double ratio = std::exp(log_lo + (log_hi - log_lo) * rng.uniform_double());
    const int w = int(std::lround(std::sqrt(target * ratio)));
    const int h = int(std::lround(std::sqrt(target / ratio)));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const int y = int(rng.below(uint64_t(height - h + 1)));
      const int x = int(rng.below(uint64_t(width - w + 1)));
      return {x, y, w, h};
    }
  }
  const double in_ratio = double(width) / double(height);  // the centre crop, ratio clamped
  int w = width, h = height;
  if (in_ratio < 3.0 / 4.0) h = int(std::lround(double(w) / (3.0 / 4.0)));
  else if (in_ratio > 4.0 / 3.0) w = int(std::lround(double(h) * (4.0 / 3.0)));
  h = std::min(h, height);
  w = std::min(w, width);
  return {(width - w) / 2, (height - h) / 2, w, h};
}

ImageLoader::ImageLoader(const ImageLoaderOptions& opt) : opt_(opt) {
  if (opt_.batch_size < 1) user_error("data: batch_size must be >= 1, got {}", opt_.batch_size);
  if (opt_.world_size < 1 || opt_.rank < 0 || opt_.rank >= opt_.world_size)
    user_error("data: rank {} is not in [0, world_size={})", opt_.rank, opt_.world_size);
  if (opt_.workers < 0) user_error("data: workers must be >= 0, got {}", opt_.workers);
  if (opt_.prefetch < 1) user_error("data: prefetch must be >= 1, got {}", opt_.prefetch);
  if (opt_.crop_padding < 0) user_error("data: crop_padding must be >= 0, got {}", opt_.crop_padding);

  Manifest m = read_manifest(opt_.root);
  auto it = m.splits.find(opt_.split);
  if (it == m.splits.end()) {
    std::string have;
    for (auto& [k, v] : m.splits) have += (have.empty() ? "" : ", ") + k;
    user_error("{}/manifest.json: no split '{}' (it has: {})", opt_.root, opt_.split, have);
  }
  const SplitInfo& s = it->second;
  num_classes_ = int(s.num_classes);
  std::tie(h_, w_) = output_size(opt_.image_size, opt_.resize_size, opt_.random_resized_crop, opt_.rrc_scale_min, s,
                                 opt_.root, opt_.split);
  c_ = int(s.channels);
  if (opt_.num_classes_expected && opt_.num_classes_expected != num_classes_)
    user_error("{}: split '{}' has {} classes but the model expects {}", opt_.root, opt_.split, num_classes_,
               opt_.num_classes_expected);
  if (opt_.channels_expected && opt_.channels_expected != c_)
    user_error("{}: split '{}' has {}-channel images but the model expects {} channels", opt_.root, opt_.split, c_,
               opt_.channels_expected);
  if (opt_.mean.size() != opt_.std.size() || (!opt_.mean.empty() && opt_.mean.size() != size_t(c_)))
    user_error("data: mean and std need one value per channel ({}), got {} and {}", c_, opt_.mean.size(),
               opt_.std.size());
  for (int c = 0; c < c_; ++c) {
    float mean = opt_.mean.empty() ? 0.f : opt_.mean[size_t(c)];
    float sd = opt_.std.empty() ? 1.f : opt_.std[size_t(c)];
    if (!(sd > 0)) user_error("data: std[{}] must be > 0, got {}", c, sd);
    // Same arithmetic as torchvision ToTensor + Normalize: x/255, then (x - mean)/std.
    for (int v = 0; v < 256; ++v) lut_.push_back(opt_.mean.empty() ? float(v) / 255.0f : (float(v) / 255.0f - mean) / sd);
  }

  index_shards(opt_.split, s);

  int64_t n = int64_t(samples_.size()), W = opt_.world_size;
  per_rank_ = opt_.drop_last ? n / W : (n + W - 1) / W;
  if (per_rank_ == 0)
    user_error("{}: split '{}' has {} samples, fewer than the {} ranks", opt_.root, opt_.split, n, W);
  batches_ = opt_.drop_last ? per_rank_ / opt_.batch_size : (per_rank_ + opt_.batch_size - 1) / opt_.batch_size;
  if (batches_ == 0)
    user_error("{}: split '{}' gives {} samples per rank, less than one batch of {} (drop_last)", opt_.root,
               opt_.split, per_rank_, opt_.batch_size);
  ring_.resize(size_t(opt_.prefetch));
}

ImageLoader::~ImageLoader() {
  stop();
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
}

void ImageLoader::index_shards(const std::string& split_name, const SplitInfo& s) {
  for (const auto& sh : s.shards) {
    std::string path = (fs::path(opt_.root) / sh.file).string();
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) user_error("{}: shard listed in manifest.json is missing", path);
    std::vector<uint8_t> bytes = read_file_bytes(path);
    std::string got = sha256_hex(bytes.data(), bytes.size());
    if (got != sh.sha256)
      user_error("{}: sha256 {} does not match manifest.json ({}); the shard is corrupt or was modified", path, got,
                 sh.sha256);
    int32_t shard_id = int32_t(shard_paths_.size());
    shard_paths_.push_back(path);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fault("cannot open {}: {}", path, strerror(errno));
    fds_.push_back(fd);

    std::vector<TarMember> members = tar_index(bytes.data(), bytes.size(), path);
    int64_t count = 0;
    size_t i = 0;
    while (i < members.size()) {
      std::string key, ext;
      split_key(members[i].name, key, ext);
      const TarMember *img = nullptr, *cls = nullptr;
      for (; i < members.size(); ++i) {
        std::string k2, e2;
        split_key(members[i].name, k2, e2);
        if (k2 != key) break;
        if (is_image_ext(e2)) {
          if (img) user_error("{}: sample '{}' has two images", path, key);
          img = &members[i];
        } else if (e2 == "cls") {
          cls = &members[i];
        }
      }
      if (!img && !cls) continue;  // e.g. a __meta__ member
      if (!img) user_error("{}: sample '{}' has no image (.png/.jpg/.jpeg/.bmp)", path, key);
      if (!cls) user_error("{}: sample '{}' has no .cls label", path, key);
      int64_t label = 0;
      if (!parse_label(bytes.data() + cls->offset, cls->size, label))
        user_error("{}: sample '{}' label '{}' is not an integer", path, key,
                   std::string(reinterpret_cast<const char*>(bytes.data() + cls->offset), std::min<size_t>(cls->size, 20)));
      if (label < 0 || label >= num_classes_)
        user_error("{}: sample '{}' has label {}, outside 0..{} (num_classes {} in manifest.json)", path, key, label,
                   num_classes_ - 1, num_classes_);
      samples_.push_back({shard_id, int32_t(label), img->offset, img->size, key});
      ++count;
    }
    if (count != sh.samples)
      user_error("{}: holds {} samples but manifest.json says {}", path, count, sh.samples);
  }
  (void)split_name;
}

std::vector<int64_t> ImageLoader::epoch_indices(int64_t epoch) const {
  int64_t n = int64_t(samples_.size()), W = opt_.world_size;
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  if (opt_.shuffle) {
    Rng rng(opt_.seed, stream_id(uint64_t(epoch), 0x5348));
    for (int64_t i = n - 1; i > 0; --i) std::swap(perm[size_t(i)], perm[size_t(rng.below(uint64_t(i + 1)))]);
  }
  // Pad (repeating the head) or truncate to per_rank_*W, then take every W-th from rank.
  std::vector<int64_t> mine(static_cast<size_t>(per_rank_));
  for (int64_t k = 0; k < per_rank_; ++k) mine[size_t(k)] = perm[size_t((opt_.rank + k * W) % n)];
  return mine;
}

std::shared_ptr<const std::vector<int64_t>> ImageLoader::cached_indices(int64_t epoch) {
  std::lock_guard<std::mutex> lk(cache_mu_);
  auto it = cache_.find(epoch);
  if (it != cache_.end()) return it->second;
  auto p = std::make_shared<const std::vector<int64_t>>(epoch_indices(epoch));
  cache_[epoch] = p;
  while (cache_.size() > 3) cache_.erase(cache_.begin());
  return p;
}

void ImageLoader::produce(int64_t seq, ImageBatch& b, std::vector<uint8_t>& enc, std::vector<uint8_t>& pix) {
  std::vector<uint8_t> sized;
  int64_t epoch = seq / batches_, bi = seq % batches_;
  auto idx = cached_indices(epoch);
  int64_t begin = bi * opt_.batch_size;
  int64_t n = std::min<int64_t>(opt_.batch_size, per_rank_ - begin);
  const int H = h_, W = w_, C = c_, P = opt_.crop_padding;
  b.n = n;
  b.h = H;
  b.w = W;
  b.c = C;
  b.epoch = epoch;
  b.images.resize(size_t(n) * H * W * C);
  b.labels.resize(size_t(n));
  for (int64_t j = 0; j < n; ++j) {
    int64_t si = (*idx)[size_t(begin + j)];
    const Sample& s = samples_[size_t(si)];
    enc.resize(s.size);
    size_t got = 0;
    while (got < s.size) {
      ssize_t r = ::pread(fds_[size_t(s.shard)], enc.data() + got, s.size - got, off_t(s.offset + got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        fault("{}: read of sample '{}' failed: {}", shard_paths_[size_t(s.shard)], s.key,
              r < 0 ? strerror(errno) : "file shrank since it was opened");
      got += size_t(r);
    }
    ImageInfo info;
    std::string reason;
    if (!decode_image(enc.data(), enc.size(), C, pix, info, reason))
      user_error("{}: sample '{}' does not decode as an image ({})", shard_paths_[size_t(s.shard)], s.key, reason);
    if (opt_.random_resized_crop) {
      Rng rr(opt_.seed, stream_id(uint64_t(epoch), uint64_t(si), 0x525243));
      resize_box(pix.data(), info.width, C, random_resized_box(info.width, info.height, rr, opt_.rrc_scale_min),
                 opt_.image_size, sized);
      pix.swap(sized);
    } else if (opt_.image_size > 0 &&
               (info.width != W || info.height != H || (opt_.resize_size && opt_.resize_size != opt_.image_size))) {
      resize_center_crop(pix.data(), info.width, info.height, C, opt_.resize_size ? opt_.resize_size : opt_.image_size,
                         opt_.image_size, sized);
      pix.swap(sized);
    } else if (info.width != W || info.height != H)
      user_error("{}: sample '{}' is {}x{}, manifest.json says {}x{}", shard_paths_[size_t(s.shard)], s.key,
                 info.width, info.height, W, H);
    int dy = P, dx = P;
    bool flip = false;
    if (P > 0 || opt_.hflip) {
      Rng rng(opt_.seed, stream_id(uint64_t(epoch), uint64_t(si), 0x4155));
      if (P > 0) {
        dy = int(rng.below(uint64_t(2 * P + 1)));
        dx = int(rng.below(uint64_t(2 * P + 1)));
      }
      if (opt_.hflip) flip = rng.uniform() < 0.5f;
    }
    // out(y, x) = padded(y + dy, xs + dx) with xs = flip ? W-1-x : x; padded = image shifted by P, zeros outside.
    float* o = b.images.data() + size_t(j) * H * W * C;
    for (int y = 0; y < H; ++y) {
      int sy = y + dy - P;
      for (int x = 0; x < W; ++x) {
        int sx = (flip ? W - 1 - x : x) + dx - P;
        bool inside = sy >= 0 && sy < H && sx >= 0 && sx < W;
        const uint8_t* p = inside ? pix.data() + (size_t(sy) * W + sx) * C : nullptr;
        for (int c = 0; c < C; ++c) *o++ = lut_[size_t(c) * 256 + (inside ? p[c] : 0)];
      }
    }
    b.labels[size_t(j)] = s.label;
  }
}

void ImageLoader::worker_loop() {
  std::vector<uint8_t> enc, pix;
  while (true) {
    int64_t seq;
    Slot* slot;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return stopping_ || next_job_ < next_out_ + int64_t(ring_.size()); });
      if (stopping_) return;
      seq = next_job_++;
      slot = &ring_[size_t(seq % int64_t(ring_.size()))];
    }
    std::exception_ptr err;
    try {
      produce(seq, slot->batch, enc, pix);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      slot->seq = seq;
      slot->ready = true;
      slot->error = err;
    }
    cv_ready_.notify_all();
  }
}

void ImageLoader::start() {
  stopping_ = false;
  for (auto& s : ring_) {
    s.ready = false;
    s.seq = -1;
    s.error = nullptr;
  }
  next_job_ = next_out_;
  for (int i = 0; i < opt_.workers; ++i) threads_.emplace_back([this] { worker_loop(); });
  running_ = true;
}

void ImageLoader::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  running_ = false;
}

void ImageLoader::next(ImageBatch& out) {
  if (failed_) std::rethrow_exception(failed_);
  if (opt_.workers == 0) {
    try {
      produce(next_out_, out, inline_enc_, inline_pix_);
    } catch (...) {
      failed_ = std::current_exception();
      throw;
    }
    std::lock_guard<std::mutex> lk(mu_);
    ++next_out_;
    return;
  }
  if (!running_) start();
  {
    std::unique_lock<std::mutex> lk(mu_);
    Slot& slot = ring_[size_t(next_out_ % int64_t(ring_.size()))];
    cv_ready_.wait(lk, [&] { return slot.ready && slot.seq == next_out_; });
    if (slot.error) {
      failed_ = slot.error;
      std::rethrow_exception(failed_);
    }
    std::swap(out, slot.batch);  // the slot keeps out's old buffers for reuse
    slot.ready = false;
    ++next_out_;
  }
  cv_work_.notify_all();
}

LoaderState ImageLoader::state() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {next_out_ / batches_, next_out_ % batches_};
}

void ImageLoader::restore(const LoaderState& s) {
  if (s.epoch < 0 || s.batch_in_epoch < 0 || s.batch_in_epoch >= batches_)
    user_error("data: cannot resume at epoch {} batch {}: an epoch has {} batches for this rank (batch size or world "
               "size changed?)",
               s.epoch, s.batch_in_epoch, batches_);
  stop();
  next_out_ = s.epoch * batches_ + s.batch_in_epoch;
  failed_ = nullptr;
}

}  // namespace dtrain::data

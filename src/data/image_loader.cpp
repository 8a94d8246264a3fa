#include "data/image_loader.h"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
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

ImageLoader::ImageLoader(const ImageLoaderOptions& opt) : BatchLoader<ImageBatch>(opt), opt_(opt) {
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

  index_shards(s);
  set_dataset_size(int64_t(samples_.size()));
  scratch_.resize(size_t(std::max(opt_.workers, 1)));
}

ImageLoader::~ImageLoader() {
  stop();  // the workers read samples_ and fds_
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
}

void ImageLoader::index_shards(const SplitInfo& s) {
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
}

void ImageLoader::produce(const BatchPlan& plan, ImageBatch& b, int worker) {
  std::vector<uint8_t>& enc = scratch_[size_t(worker)].enc;
  std::vector<uint8_t>& pix = scratch_[size_t(worker)].pix;
  std::vector<uint8_t>& sized = scratch_[size_t(worker)].sized;
  const int64_t epoch = plan.epoch, n = plan.n;
  const int H = h_, W = w_, C = c_, P = opt_.crop_padding;
  b.n = n;
  b.h = H;
  b.w = W;
  b.c = C;
  b.epoch = epoch;
  b.images.resize(size_t(n) * H * W * C);
  b.labels.resize(size_t(n));
  for (int64_t j = 0; j < n; ++j) {
    int64_t si = plan.sample(j);
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

}  // namespace dtrain::data

#include "data/seg_loader.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "core/error.h"
#include "core/rng.h"
#include "data/image_codec.h"
#include "data/tar.h"

namespace dtrain::data {

SegLoader::SegLoader(const SegLoaderOptions& o) : BatchLoader<SegBatch>(o), o_(o) {
  Manifest m = read_manifest(o_.root);
  auto it = m.splits.find(o_.split);
  if (it == m.splits.end())
    user_error("{}: manifest.json has no split '{}'", o_.root, o_.split);
  const SplitInfo& s = it->second;
  num_classes_ = o_.num_classes ? o_.num_classes : int(s.num_classes);
  std::tie(h_, w_) =
      output_size(o_.image_size, o_.resize_size, o_.random_resized_crop, o_.rrc_scale_min, s, o_.root, o_.split);
  c_ = int(s.channels);
  if (!o_.mean.empty() && (int(o_.mean.size()) != c_ || o_.std.size() != o_.mean.size()))
    user_error("data.mean/std: expected {} values each", c_);
  for (const ShardInfo& si : s.shards) {
    const std::string path = o_.root + "/" + si.file;
    shard_bytes_.push_back(read_file_bytes(path));
    shard_names_.push_back(si.file);
    const auto& bytes = shard_bytes_.back();
    std::map<std::string, Sample> by_key;
    std::vector<std::string> order;
    for (const TarMember& mem : tar_index(bytes.data(), bytes.size(), path)) {
      std::string key, ext;
      split_key(mem.name, key, ext);
      auto [pos, fresh] = by_key.try_emplace(key, Sample{int(shard_bytes_.size() - 1), key});
      if (fresh) order.push_back(key);
      if (ext == "mask.png") {
        pos->second.mask_off = mem.offset, pos->second.mask_size = mem.size;
      } else if (ext == "png" || ext == "jpg" || ext == "jpeg" || ext == "bmp") {
        pos->second.img_off = mem.offset, pos->second.img_size = mem.size;
      }
    }
    for (const std::string& k : order) {
      const Sample& smp = by_key[k];
      if (!smp.img_size) user_error("{}: sample '{}' has no image member", si.file, k);
      if (!smp.mask_size) user_error("{}: sample '{}' has no KEY.mask.png member", si.file, k);
      samples_.push_back(smp);
    }
  }
  if (samples_.empty()) user_error("{}: split '{}' has no samples", o_.root, o_.split);
  set_dataset_size(int64_t(samples_.size()));
  start();
}

SegLoader::~SegLoader() { stop(); }  // the workers read samples_ and shard_bytes_

void SegLoader::produce(const BatchPlan& plan, SegBatch& b, int) {
  const int64_t epoch = plan.epoch;
  b.n = plan.n, b.h = h_, b.w = w_, b.c = c_, b.epoch = epoch;
  const size_t plane = size_t(h_) * size_t(w_);
  b.images.assign(size_t(b.n) * plane * size_t(c_), 0.f);
  b.labels.assign(size_t(b.n) * plane, 0);
  std::vector<uint8_t> img, mask, sized;
  for (int64_t j = 0; j < b.n; ++j) {
    const int64_t si = plan.sample(j);
    const Sample& s = samples_[size_t(si)];
    const auto& bytes = shard_bytes_[size_t(s.shard)];
    const std::string& shard = shard_names_[size_t(s.shard)];
    ImageInfo ii, mi;
    std::string why;
    if (!decode_image(bytes.data() + s.img_off, s.img_size, c_, img, ii, why))
      user_error("{}: sample '{}': image does not decode: {}", shard, s.key, why);
    if (!decode_image(bytes.data() + s.mask_off, s.mask_size, 1, mask, mi, why))
      user_error("{}: sample '{}': mask does not decode: {}", shard, s.key, why);
    if (mi.width != ii.width || mi.height != ii.height)
      user_error("{}: sample '{}': mask is {}x{} but its image is {}x{}", shard, s.key, mi.width, mi.height,
                 ii.width, ii.height);
    const int resize = o_.resize_size ? o_.resize_size : o_.image_size;
    if (o_.random_resized_crop) {
      Rng rr(o_.seed, stream_id(uint64_t(epoch), uint64_t(si), 0x525243));
      const Box box = random_resized_box(ii.width, ii.height, rr, o_.rrc_scale_min);
      resize_box(img.data(), ii.width, c_, box, o_.image_size, sized);
      img.swap(sized);
      resize_box_nearest(mask.data(), mi.width, box, o_.image_size, sized);
      mask.swap(sized);
    } else if (o_.image_size > 0 && (ii.width != w_ || ii.height != h_ || resize != o_.image_size)) {
      resize_center_crop(img.data(), ii.width, ii.height, c_, resize, o_.image_size, sized);
      img.swap(sized);
      resize_center_crop_nearest(mask.data(), mi.width, mi.height, resize, o_.image_size, sized);
      mask.swap(sized);
    } else if (ii.width != w_ || ii.height != h_) {
      user_error("{}: sample '{}': image is {}x{}, expected {}x{} (manifest)", shard, s.key, ii.width, ii.height, w_, h_);
    }
    for (uint8_t v : mask)
      if (v >= num_classes_) user_error("{}: sample '{}': mask value {} is not a class (expected 0..{})", shard, s.key, int(v), num_classes_ - 1);
    Rng r(o_.seed, stream_id(uint64_t(epoch), uint64_t(si), 0x4155));
    const int p = o_.crop_padding;
    int dy = 0, dx = 0;
    if (p > 0) {
      dy = int(r.below(uint64_t(2 * p + 1))) - p;
      dx = int(r.below(uint64_t(2 * p + 1))) - p;
    }
    const bool hf = o_.hflip && r.uniform() < 0.5f;
    const bool vf = o_.vflip && r.uniform() < 0.5f;
    float* out = b.images.data() + size_t(j) * plane * size_t(c_);
    int32_t* lab = b.labels.data() + size_t(j) * plane;
    for (int y = 0; y < h_; ++y)
      for (int x = 0; x < w_; ++x) {
        int sy = (vf ? h_ - 1 - y : y) + dy, sx = (hf ? w_ - 1 - x : x) + dx;
        const bool inside = sy >= 0 && sy < h_ && sx >= 0 && sx < w_;
        const size_t o = size_t(y) * size_t(w_) + size_t(x);
        const size_t src = inside ? size_t(sy) * size_t(w_) + size_t(sx) : 0;
        lab[o] = inside ? mask[src] : 0;
        for (int c = 0; c < c_; ++c) {
          float v = inside ? float(img[src * size_t(c_) + size_t(c)]) / 255.f : 0.f;
          if (!o_.mean.empty()) v = (v - o_.mean[size_t(c)]) / o_.std[size_t(c)];
          out[o * size_t(c_) + size_t(c)] = v;
        }
      }
  }
}

}  // namespace dtrain::data

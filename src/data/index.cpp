#include "data/index.h"

#include <fmt/ranges.h>
#include <fnmatch.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/sha256.h"
#include "data/image_codec.h"
#include "data/manifest.h"
#include "data/tar.h"

namespace dtrain {

namespace {

namespace fs = std::filesystem;
using data::ImageInfo;
using data::Manifest;
using data::ShardInfo;
using data::SplitInfo;
using data::TarMember;

struct SplitSpec {
  std::string name, glob;  // glob relative to the dataset directory
};

bool has_wildcard(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// The shard files (paths relative to `root`) that `glob` names, in name order.
std::vector<std::string> expand(const std::string& root, const SplitSpec& sp) {
  const fs::path g(sp.glob);
  const std::string parent = g.parent_path().string(), pattern = g.filename().string();
  if (sp.glob.empty() || g.is_absolute() || sp.glob.find("..") != std::string::npos || has_wildcard(parent) ||
      pattern.empty())
    user_error("--split {}={}: expected NAME=GLOB with GLOB relative to {} and wildcards only in its last part",
               sp.name, sp.glob, root);
  std::vector<std::string> out;
  std::error_code ec;
  const fs::path dir = fs::path(root) / parent;
  if (fs::is_directory(dir, ec))
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.is_regular_file(ec) && fnmatch(pattern.c_str(), e.path().filename().c_str(), 0) == 0)
        out.push_back((fs::path(parent) / e.path().filename()).lexically_normal().string());
  std::sort(out.begin(), out.end());
  if (out.empty()) user_error("--split {}={}: no file of {} matches", sp.name, sp.glob, dir.lexically_normal().string());
  return out;
}

bool holds_tars(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file(ec) && e.path().extension() == ".tar") return true;
  return false;
}

// Default splits: the subdirectories of root holding *.tar files.
std::vector<SplitSpec> discover(const std::string& root) {
  std::vector<SplitSpec> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.is_directory(ec) && holds_tars(e.path()))
      out.push_back({e.path().filename().string(), e.path().filename().string() + "/*.tar"});
  std::sort(out.begin(), out.end(), [](const SplitSpec& a, const SplitSpec& b) { return a.name < b.name; });
  if (out.empty()) {
    if (holds_tars(root))
      user_error("{}: its .tar shards are not in split subdirectories; name the splits with --split NAME=GLOB "
                 "(e.g. --split train='train-*.tar' --split val='val-*.tar')",
                 root);
    user_error("{}: no .tar shards found (expected {}/<split>/*.tar, or --split NAME=GLOB)", root, root);
  }
  return out;
}

// What indexing one split found.
struct SplitScan {
  SplitInfo info;
  bool all_cls = true, all_mask = true;
  std::string no_cls, no_mask;  // "shard: sample 'key'" of the first sample without one
  int64_t max_label = -1, max_mask = -1;
  bool gray = true;
  data::SplitSize sizes;
};

void scan_shard(const std::string& root, const std::string& file, SplitScan& sc) {
  const std::string path = (fs::path(root) / file).string();
  const std::vector<uint8_t> bytes = data::read_file_bytes(path);
  ShardInfo sh{file, 0, sha256_hex(bytes.data(), bytes.size())};
  const std::vector<TarMember> members = data::tar_index(bytes.data(), bytes.size(), path);
  std::vector<uint8_t> pixels;
  size_t i = 0;
  while (i < members.size()) {
    std::string key, ext;
    data::split_key(members[i].name, key, ext);
    const TarMember *img = nullptr, *cls = nullptr, *mask = nullptr;
    std::vector<std::string> other;
    for (; i < members.size(); ++i) {
      std::string k2, e2;
      data::split_key(members[i].name, k2, e2);
      if (k2 != key) break;
      if (data::is_image_ext(e2)) {
        if (img) user_error("{}: sample '{}' has two images", path, key);
        img = &members[i];
      } else if (e2 == "cls") {
        cls = &members[i];
      } else if (e2 == "mask.png") {
        mask = &members[i];
      } else {
        other.push_back(e2);
      }
    }
    if (!img && !cls && !mask) continue;  // e.g. a __meta__ member
    if (!img)
      user_error("{}: sample '{}' has no image (.png/.jpg/.jpeg/.bmp){}", path, key,
                 other.empty() ? std::string() : fmt::format("; it has .{}", fmt::join(other, ", .")));
    ImageInfo ii;
    std::string why;
    if (!data::image_info(bytes.data() + img->offset, img->size, ii, why))
      user_error("{}: sample '{}': {}: {}", path, key, img->name, why);
    sc.sizes.add(ii.width, ii.height, fmt::format("{}: sample '{}'", path, key));
    sc.gray = sc.gray && ii.channels <= 2;
    if (cls) {
      int64_t label = 0;
      if (!data::parse_label(bytes.data() + cls->offset, cls->size, label) || label < 0)
        user_error("{}: sample '{}': label '{}' is not a non-negative integer", path, key,
                   std::string(reinterpret_cast<const char*>(bytes.data() + cls->offset),
                               std::min<size_t>(cls->size, 20)));
      sc.max_label = std::max(sc.max_label, label);
    } else if (sc.all_cls) {
      sc.all_cls = false;
      sc.no_cls = fmt::format("{}: sample '{}'", path, key);
    }
    if (mask) {
      ImageInfo mi;
      if (!data::decode_image(bytes.data() + mask->offset, mask->size, 1, pixels, mi, why))
        user_error("{}: sample '{}': mask does not decode: {}", path, key, why);
      if (mi.width != ii.width || mi.height != ii.height)
        user_error("{}: sample '{}': mask is {}x{} but its image is {}x{}", path, key, mi.width, mi.height, ii.width,
                   ii.height);
      for (uint8_t v : pixels) sc.max_mask = std::max<int64_t>(sc.max_mask, v);
    } else if (sc.all_mask) {
      sc.all_mask = false;
      sc.no_mask = fmt::format("{}: sample '{}'", path, key);
    }
    ++sh.samples;
  }
  if (sh.samples == 0) user_error("{}: holds no samples (members KEY.png/jpg/jpeg/bmp with KEY.cls or KEY.mask.png)", path);
  sc.info.samples += sh.samples;
  sc.info.shards.push_back(sh);
}

}  // namespace

void data::index_dataset(const data::IndexSpec& a) {
  std::error_code ec;
  if (!fs::is_directory(a.dir, ec)) user_error("{}: not a directory", a.dir);
  const std::string mpath = (fs::path(a.dir) / "manifest.json").string();
  if (fs::exists(mpath, ec) && !a.force)
    user_error("{}: exists; pass --force to index the shards again and replace it", mpath);
  std::vector<SplitSpec> specs;
  for (const std::string& s : a.splits) {
    const size_t eq = s.find('=');
    if (eq == std::string::npos || eq == 0)
      user_error("--split {}: expected NAME=GLOB, e.g. --split train='train-*.tar'", s);
    SplitSpec sp{s.substr(0, eq), s.substr(eq + 1)};
    for (const auto& o : specs)
      if (o.name == sp.name) user_error("--split {}: split '{}' is given twice", s, sp.name);
    specs.push_back(sp);
  }
  if (specs.empty()) specs = discover(a.dir);

  std::map<std::string, SplitScan> scans;
  int64_t max_class = -1;
  for (const SplitSpec& sp : specs) {
    SplitScan& sc = scans[sp.name];
    const std::vector<std::string> files = expand(a.dir, sp);
    Progress progress("index " + sp.name, int64_t(files.size()), "shards");
    for (const std::string& f : files) {
      scan_shard(a.dir, f, sc);
      progress.add(1);
    }
    progress.finish();
    if (!sc.all_cls && !sc.all_mask)
      user_error("{} has no KEY.cls label and {} has no KEY.mask.png: every sample of a split needs one of them",
                 sc.no_cls, sc.no_mask);
    max_class = std::max(max_class, sc.all_cls ? sc.max_label : sc.max_mask);
  }
  int64_t num_classes = max_class + 1;
  if (a.num_classes > 0) {
    if (a.num_classes < num_classes)
      user_error("--num-classes {}: the shards hold class {}; expected at least {}", a.num_classes, max_class,
                 num_classes);
    num_classes = a.num_classes;
  }
  if (num_classes < 2) user_error("{}: every label is 0: a dataset needs at least 2 classes (or give --num-classes)", a.dir);

  Manifest m;
  for (auto& [name, sc] : scans) {
    sc.info.num_classes = num_classes;
    sc.info.channels = sc.gray ? 1 : 3;
    sc.sizes.apply(sc.info, name);
    m.splits[name] = sc.info;
  }
  data::write_manifest(mpath, m);
  for (const auto& [name, sc] : scans)
    log::console(fmt::format("{}: split '{}': {} samples in {} shard(s), {}x{}x{}, {} ({} classes)", a.dir, name,
                             sc.info.samples, sc.info.shards.size(),
                             sc.sizes.mixed() ? std::string("mixed sizes") : std::to_string(sc.info.height),
                             sc.info.width, sc.info.channels,
                             sc.all_cls ? "labels (.cls)" : "masks (.mask.png)", num_classes));
  log::console(fmt::format("wrote {}", mpath));
}

}  // namespace dtrain

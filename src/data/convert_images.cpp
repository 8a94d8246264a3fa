// `dtrain data images SRC --out OUT --split S`: an ImageFolder tree (SRC/<class>/<image>)
// -> WebDataset shards. Images keep their encoded bytes; classes are sorted by name.
#include <algorithm>
#include <chrono>
#include <filesystem>

#include "core/error.h"
#include "core/log.h"
#include "data/convert.h"
#include "data/dataset_writer.h"
#include "data/image_codec.h"

namespace dtrain::data {

namespace fs = std::filesystem;

namespace {

bool image_ext(const fs::path& p, std::string& ext) {
  ext = p.extension().string();
  if (!ext.empty()) ext = ext.substr(1);
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return ext == "png" || ext == "jpg" || ext == "jpeg" || ext == "bmp";
}

struct Item {
  std::string path, ext;
  int64_t label;
};

}  // namespace

ConvertResult convert_image_folder(const data::ImageFolderSpec& a) {
  auto t0 = std::chrono::steady_clock::now();
  std::error_code ec;
  if (a.src.empty() || !fs::is_directory(a.src, ec))
    user_error("{}: image folder not found (expected SRC/<class>/<image>.png|jpg|jpeg|bmp)", a.src);
  if (a.out.empty()) user_error("dtrain data images: --out is required");
  if (a.split.empty() || a.split.find('/') != std::string::npos || a.split[0] == '.')
    user_error("--split '{}' must be a plain name like train or test", a.split);
  if (a.shard_size < 1) user_error("--shard-size must be >= 1, got {}", a.shard_size);

  std::vector<std::string> classes;
  for (const auto& e : fs::directory_iterator(a.src))
    if (e.is_directory() && e.path().filename().string()[0] != '.') classes.push_back(e.path().filename().string());
  std::sort(classes.begin(), classes.end());
  if (classes.empty()) user_error("{}: no class directories (expected SRC/<class>/<image>)", a.src);

  std::vector<Item> items;
  size_t skipped = 0;
  for (size_t c = 0; c < classes.size(); ++c) {
    fs::path cdir = fs::path(a.src) / classes[c];
    std::vector<Item> mine;
    for (const auto& e : fs::recursive_directory_iterator(cdir)) {
      if (!e.is_regular_file()) continue;
      std::string ext;
      if (e.path().filename().string()[0] == '.' || !image_ext(e.path(), ext)) {
        ++skipped;
        continue;
      }
      mine.push_back({e.path().string(), ext, int64_t(c)});
    }
    if (mine.empty()) user_error("{}: class directory has no images (.png .jpg .jpeg .bmp)", cdir.string());
    std::sort(mine.begin(), mine.end(), [](const Item& x, const Item& y) { return x.path < y.path; });
    items.insert(items.end(), mine.begin(), mine.end());
  }
  if (skipped) log::warn("{}: skipped {} files that are not .png/.jpg/.jpeg/.bmp", a.src, skipped);

  DatasetStager stager(a.out);
  ConvertResult res;
  if (stager.existing() && !stager.existing()->classes.empty() && stager.existing()->classes != classes)
    user_error("{}: its manifest.json lists other classes than {} ({} vs {} classes); use another --out", a.out, a.src,
               stager.existing()->classes.size(), classes.size());

  SplitInfo s;
  s.num_classes = int64_t(classes.size());
  ShardedSplitWriter w(stager.split_dir(a.split), a.split, a.shard_size);
  int digits = std::max<int>(6, int(std::to_string(items.size()).size()));
  SplitSize sizes;
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<uint8_t> bytes = read_file_bytes(items[i].path);
    ImageInfo info;
    if (!image_info(bytes.data(), bytes.size(), info))
      user_error("{}: not a decodable PNG/JPEG/BMP image", items[i].path);
    sizes.add(info.width, info.height, items[i].path);
    // Gray (+alpha) stays 1 channel; any colour image makes the split RGB (alpha dropped).
    s.channels = std::max<int64_t>(s.channels, info.channels >= 3 ? 3 : 1);
    std::string key = fmt::format("{}_{:0{}d}", a.split, i, digits);
    w.add(key, items[i].ext, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
          items[i].label);
  }
  s.shards = w.finish();
  s.samples = int64_t(items.size());
  sizes.apply(s, a.split);
  res.splits.push_back({a.split, s.samples});

  Manifest m = stager.existing() ? *stager.existing() : Manifest{};
  auto old = m.splits.find(a.split);
  if (old != m.splits.end()) {
    if (old->second == s) {
      stager.abandon();
      res.already_prepared = true;
      return res;
    }
    user_error("{}: split '{}' already exists with different contents; remove {} to rebuild it, or use another --out",
               a.out, a.split, a.out);
  }
  m.classes = classes;
  m.splits[a.split] = s;
  stager.commit(m, {a.split});
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace dtrain::data

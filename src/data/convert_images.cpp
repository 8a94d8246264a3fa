// `dtrain data images SRC --out OUT --split S`: an ImageFolder tree (SRC/<class>/<image>)
// -> WebDataset shards. Images keep their encoded bytes; classes are sorted by name. Every
// image is decoded once here (on all cores, ahead of the writer), so a corrupt or truncated
// file stops the conversion naming it instead of a training run hours later.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <system_error>
#include <thread>

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
  uint64_t size;  // of the file, to bound the bytes read ahead
};

struct Checked {
  std::vector<uint8_t> bytes;
  ImageInfo info;
  bool ok = false;
  std::string reason;       // why it does not decode
  std::exception_ptr fail;  // a read error
};

// Reads and decodes items [begin, end) on every core.
void check_batch(const std::vector<Item>& items, size_t begin, size_t end, std::vector<Checked>& out) {
  out.clear();
  out.resize(end - begin);
  std::atomic<size_t> next{begin};
  auto work = [&] {
    std::vector<uint8_t> scratch;
    for (size_t i; (i = next++) < end;) {
      Checked& c = out[i - begin];
      try {
        c.bytes = read_file_bytes(items[i].path);
        c.ok = check_image(c.bytes.data(), c.bytes.size(), c.info, c.reason, scratch);
      } catch (...) {
        c.fail = std::current_exception();
      }
    }
  };
  const size_t threads = std::min<size_t>(end - begin, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  try {
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  } catch (const std::system_error&) {  // no more threads: the ones running (and this one) do it all
  }
  work();
  for (auto& t : pool) t.join();
}

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
      std::error_code fec;
      const uint64_t size = e.file_size(fec);
      mine.push_back({e.path().string(), ext, int64_t(c), fec ? 0 : size});
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
  w.expect(int64_t(items.size()));
  int digits = std::max<int>(6, int(std::to_string(items.size()).size()));
  SplitSize sizes;
  // Batches read ahead: 32 images a core, at most 256 MiB of files.
  const size_t batch_items = 32 * size_t(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<Checked> checked;
  for (size_t b = 0; b < items.size();) {
    size_t e = b;
    uint64_t bytes = 0;
    while (e < items.size() && e - b < batch_items && (e == b || bytes + items[e].size <= (256u << 20)))
      bytes += items[e++].size;
    check_batch(items, b, e, checked);
    for (size_t i = b; i < e; ++i) {
      Checked& c = checked[i - b];
      if (c.fail) std::rethrow_exception(c.fail);
      if (!c.ok) user_error("{}: not a decodable PNG/JPEG/BMP image ({})", items[i].path, c.reason);
      sizes.add(c.info.width, c.info.height, items[i].path);
      // Gray (+alpha) stays 1 channel; any colour image makes the split RGB (alpha dropped).
      s.channels = std::max<int64_t>(s.channels, c.info.channels >= 3 ? 3 : 1);
      std::string key = fmt::format("{}_{:0{}d}", a.split, i, digits);
      w.add(key, items[i].ext, std::string_view(reinterpret_cast<const char*>(c.bytes.data()), c.bytes.size()),
            items[i].label);
      c.bytes = {};
    }
    b = e;
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

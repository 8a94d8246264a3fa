// `dtrain data fashion-mnist`: IDX files of Debian's dataset-fashion-mnist -> PNG shards.
#include <zlib.h>

#include <chrono>
#include <filesystem>

#include "core/error.h"
#include "core/log.h"
#include "data/convert.h"
#include "data/dataset_writer.h"
#include "data/image_codec.h"

namespace dtrain::data {

namespace fs = std::filesystem;

const std::vector<std::string> kFashionMnistClasses = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                                       "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

namespace {

struct GzFile {
  gzFile f = nullptr;
  ~GzFile() {
    if (f) gzclose(f);
  }
};

// Reads exactly n bytes; returns the count read (short at end of file).
size_t gz_read(gzFile f, uint8_t* p, size_t n, const std::string& path) {
  size_t got = 0;
  while (got < n) {
    unsigned chunk = unsigned(std::min<size_t>(n - got, 1u << 30));
    int r = gzread(f, p + got, chunk);
    if (r < 0) {
      int err = 0;
      const char* msg = gzerror(f, &err);
      user_error("{}: corrupt gzip data ({})", path, msg ? msg : "unknown zlib error");
    }
    if (r == 0) break;
    got += size_t(r);
  }
  return got;
}

}  // namespace

std::vector<uint8_t> read_idx_gz(const std::string& path, int ndims, std::vector<uint32_t>& dims) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) user_error("{}: file not found", path);
  GzFile g;
  g.f = gzopen(path.c_str(), "rb");
  if (!g.f) fault("cannot open {}", path);
  uint8_t head[4];
  if (gz_read(g.f, head, 4, path) != 4) user_error("{}: too short for an IDX header", path);
  if (head[0] != 0 || head[1] != 0 || head[2] != 0x08 || head[3] != ndims)
    user_error("{}: bad IDX magic {:02x}{:02x}{:02x}{:02x} (expected 000008{:02x}: unsigned bytes, {} dims)", path,
               head[0], head[1], head[2], head[3], ndims, ndims);
  dims.assign(size_t(ndims), 0);
  uint64_t total = 1;
  for (int i = 0; i < ndims; ++i) {
    uint8_t b[4];
    if (gz_read(g.f, b, 4, path) != 4) user_error("{}: truncated IDX header", path);
    dims[size_t(i)] = (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | b[3];
    total *= dims[size_t(i)];
  }
  if (total > (uint64_t(1) << 34)) user_error("{}: IDX dims describe {} bytes, too large", path, total);
  std::vector<uint8_t> data(total);
  size_t got = gz_read(g.f, data.data(), data.size(), path);
  if (got != total) user_error("{}: truncated IDX data ({} of {} bytes)", path, got, total);
  uint8_t extra;
  if (gz_read(g.f, &extra, 1, path) != 0) user_error("{}: trailing bytes after the IDX data", path);
  return data;
}

ConvertResult convert_fashion_mnist(const data::FashionMnistSpec& a, int64_t limit_per_split) {
  auto t0 = std::chrono::steady_clock::now();
  ConvertResult res;
  std::error_code ec;
  if (!fs::is_directory(a.src, ec))
    user_error("{}: Fashion-MNIST source directory not found (install it with: apt-get install dataset-fashion-mnist, "
               "or pass --src DIR with the *-ubyte.gz files)",
               a.src);
  if (a.shard_size < 1) user_error("--shard-size must be >= 1, got {}", a.shard_size);

  if (a.holdout < 0) user_error("--holdout must be >= 0, got {}", a.holdout);
  std::vector<std::string> splits = {"train", "test"};
  if (a.holdout > 0) splits.emplace_back("val");

  // Friendly re-run: a complete, verified output of the same splits is left alone.
  if (fs::exists(fs::path(a.out) / "manifest.json", ec)) {
    Manifest m = read_manifest(a.out);
    std::string problem;
    const auto val = m.splits.find("val");
    const int64_t had = val == m.splits.end() ? 0 : val->second.samples;
    if (had != a.holdout)
      user_error("{}: exists with {} held-out validation images, not --holdout {}; remove it or use another --out",
                 a.out, had, a.holdout);
    for (const std::string& s : splits) {
      auto it = m.splits.find(s);
      if (it == m.splits.end()) {
        problem = fmt::format("split '{}' missing from manifest.json", s);
        break;
      }
      problem = verify_split(a.out, s, it->second);
      if (!problem.empty()) break;
    }
    if (!problem.empty())
      user_error("{}: exists but is not a complete Fashion-MNIST dataset ({}); remove it and run again", a.out,
                 problem);
    for (const std::string& s : splits) res.splits.push_back({s, m.splits[s].samples});
    res.already_prepared = true;
    return res;
  }

  DatasetStager stager(a.out);
  Manifest m;
  m.classes = kFashionMnistClasses;
  for (const char* split : {"train", "test"}) {
    std::string prefix = std::string(split) == "train" ? "train" : "t10k";
    std::string img_path = (fs::path(a.src) / (prefix + "-images-idx3-ubyte.gz")).string();
    std::string lbl_path = (fs::path(a.src) / (prefix + "-labels-idx1-ubyte.gz")).string();
    std::vector<uint32_t> idims, ldims;
    std::vector<uint8_t> images = read_idx_gz(img_path, 3, idims);
    std::vector<uint8_t> labels = read_idx_gz(lbl_path, 1, ldims);
    if (idims[1] != 28 || idims[2] != 28)
      user_error("{}: images are {}x{}, expected 28x28", img_path, idims[1], idims[2]);
    if (idims[0] != ldims[0])
      user_error("{}: {} labels but {} has {} images", lbl_path, ldims[0], img_path, idims[0]);
    int64_t n = idims[0];
    if (limit_per_split > 0) n = std::min<int64_t>(n, limit_per_split);
    // images [begin, end) of the file go to split `name` (keys keep the file's index)
    auto write = [&](const std::string& name, int64_t begin, int64_t end) {
      ShardedSplitWriter w(stager.split_dir(name), name, a.shard_size);
      w.expect(end - begin);
      for (int64_t i = begin; i < end; ++i) {
        if (labels[size_t(i)] >= kFashionMnistClasses.size())
          user_error("{}: label {} at index {} is out of range 0..9", lbl_path, labels[size_t(i)], i);
        std::string png = encode_png(images.data() + size_t(i) * 784, 28, 28, 1);
        w.add(fmt::format("{}_{:06d}", split, i), "png", png, labels[size_t(i)]);
      }
      SplitInfo s;
      s.shards = w.finish();
      s.samples = end - begin;
      s.num_classes = int64_t(kFashionMnistClasses.size());
      s.channels = 1;
      s.height = 28;
      s.width = 28;
      m.splits[name] = s;
      res.splits.push_back({name, end - begin});
    };
    const bool train = std::string(split) == "train";
    const int64_t held = train ? a.holdout : 0;
    if (held >= n)
      user_error("--holdout {}: the training split has only {} images (at least one must stay for training)", held, n);
    write(split, 0, n - held);
    if (held > 0) write("val", n - held, n);
  }
  stager.commit(m, splits);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace dtrain::data

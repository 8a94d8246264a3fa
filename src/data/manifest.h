#pragma once
// manifest.json of an image dataset (WebDataset shards), see data/README.md:
//   {"format":"dtrain-webdataset","version":1,
//    "splits":{"train":{"samples":60000,"num_classes":10,"channels":1,"height":28,"width":28,
//                       "shards":[{"file":"train/000000.tar","samples":10000,"sha256":"..."}]}},
//    "classes":["T-shirt/top", ...]}
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtrain::data {

struct ShardInfo {
  std::string file;  // relative to the dataset root
  int64_t samples = 0;
  std::string sha256;
  bool operator==(const ShardInfo&) const = default;
};

struct SplitInfo {
  int64_t samples = 0, num_classes = 0, channels = 0, height = 0, width = 0;
  std::vector<ShardInfo> shards;
  bool operator==(const SplitInfo&) const = default;
};

struct Manifest {
  std::map<std::string, SplitInfo> splits;
  std::vector<std::string> classes;
};

constexpr const char* kManifestFormat = "dtrain-webdataset";
constexpr int kManifestVersion = 1;

// The one-line "not found" message, with the command that creates the dataset.
std::string dataset_not_found_message(const std::string& root);

// Reads ROOT/manifest.json. Missing root or manifest -> UserError with
// dataset_not_found_message(); malformed -> UserError naming the file and key.
Manifest read_manifest(const std::string& root);
std::string manifest_to_json(const Manifest& m);
// Writes to PATH.tmp, fsyncs and renames over PATH.
void write_manifest(const std::string& path, const Manifest& m);

// The one size of a split's images, or 0 x 0 when they differ: such a split is trained on with
// data.image_size, which resizes every image to one square. Converters add every image.
class SplitSize {
 public:
  void add(int width, int height, const std::string& where);
  // Sets s.width/s.height; for mixed sizes also logs a warning naming two of them and the key.
  void apply(SplitInfo& s, const std::string& split) const;
  bool mixed() const { return mixed_; }

 private:
  int w_ = 0, h_ = 0;
  bool mixed_ = false;
  std::string first_, other_;
};

// Checks that every shard of `split` exists and matches its sha256; returns "" when it
// does, otherwise a one-line description of the first problem.
std::string verify_split(const std::string& root, const std::string& split_name, const SplitInfo& s);

}  // namespace dtrain::data

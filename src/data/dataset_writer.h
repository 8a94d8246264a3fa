#pragma once
// Writing image datasets: samples go into WebDataset tar shards of `shard_size` samples
// (SPLIT/000000.tar, ...), and a staging directory is renamed into place only when
// everything is written and fsynced, so a crash never leaves a half dataset behind.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "core/progress.h"
#include "data/manifest.h"
#include "data/tar.h"

namespace dtrain::data {

// One member of a sample: KEY.<ext> holding `bytes`.
struct SampleMember {
  std::string_view ext;
  std::string_view bytes;
};

// Writes the shards of one split into `dir` (created), every converter's (classification
// and segmentation); manifest file names are "<split>/<NNNNNN>.tar", relative to the
// dataset root.
class ShardedSplitWriter {
 public:
  ShardedSplitWriter(std::string dir, std::string split, int64_t shard_size);
  ~ShardedSplitWriter();
  // One sample: its members in this order (a key holds no '.' or '/').
  void add(const std::string& key, std::initializer_list<SampleMember> members);
  // A classification sample: members KEY.<image_ext> and KEY.cls (the label as decimal text).
  void add(const std::string& key, const std::string& image_ext, std::string_view image, int64_t label);
  std::vector<ShardInfo> finish();  // closes the last shard, hashes every shard
  // The number of samples to come, when known (the progress line's percentage and ETA).
  void expect(int64_t samples);
  int64_t samples() const { return total_; }

 private:
  void close_shard();
  std::string dir_, split_;
  int64_t shard_size_, total_ = 0, in_shard_ = 0;
  std::unique_ptr<TarWriter> tar_;
  std::vector<ShardInfo> shards_;
  std::unique_ptr<Progress> progress_;  // a line per split written (core/progress.h)
};

void fsync_dir(const std::string& dir);

// Where a converter writes, and how it publishes.
//  - OUT missing (or an empty directory): everything is written to the sibling
//    OUT.tmp-<pid>/ and renamed to OUT at commit.
//  - OUT holding a valid manifest.json: new splits are written to OUT/.tmp-<pid>/<split>/,
//    renamed to OUT/<split>, then manifest.json is replaced atomically (merge).
// The staging directory is removed if commit() never happens.
class DatasetStager {
 public:
  explicit DatasetStager(const std::string& out);
  ~DatasetStager();
  const std::optional<Manifest>& existing() const { return existing_; }
  std::string split_dir(const std::string& split) const;  // where to write that split now
  // `m` is the complete manifest to publish (merged by the caller with existing()).
  void commit(const Manifest& m, const std::vector<std::string>& new_splits);
  void abandon();  // removes the staging directory now

 private:
  std::string out_, staging_;
  std::optional<Manifest> existing_;
  bool done_ = false;
};

}  // namespace dtrain::data

#include "data/dataset_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/log.h"
#include "core/sha256.h"

namespace dtrain::data {

namespace fs = std::filesystem;

ShardedSplitWriter::ShardedSplitWriter(std::string dir, std::string split, int64_t shard_size)
    : dir_(std::move(dir)), split_(std::move(split)), shard_size_(shard_size) {
  if (shard_size_ < 1) user_error("--shard-size must be >= 1, got {}", shard_size_);
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) fault("cannot create {}: {}", dir_, ec.message());
  progress_ = std::make_unique<Progress>("write " + split_, 0, "samples");
}

ShardedSplitWriter::~ShardedSplitWriter() = default;

void ShardedSplitWriter::expect(int64_t samples) { progress_->set_total(samples); }

void ShardedSplitWriter::add(const std::string& key, const std::string& image_ext, std::string_view image,
                             int64_t label) {
  const std::string text = std::to_string(label);
  add(key, {{image_ext, image}, {"cls", text}});
}

void ShardedSplitWriter::add(const std::string& key, std::initializer_list<SampleMember> members) {
  if (key.find('.') != std::string::npos || key.find('/') != std::string::npos)
    user_error("sample key '{}' must not contain '.' or '/'", key);
  if (!tar_) {
    std::string name = fmt::format("{:06d}.tar", shards_.size());
    tar_ = std::make_unique<TarWriter>((fs::path(dir_) / name).string());
    shards_.push_back({split_ + "/" + name, 0, ""});
  }
  for (const SampleMember& m : members) tar_->add(key + "." + std::string(m.ext), m.bytes);
  ++in_shard_;
  ++total_;
  progress_->add(1);
  if (in_shard_ == shard_size_) close_shard();
}

void ShardedSplitWriter::close_shard() {
  if (!tar_) return;
  tar_->finish();
  shards_.back().samples = in_shard_;
  shards_.back().sha256 = sha256_file(tar_->path());
  tar_.reset();
  in_shard_ = 0;
}

std::vector<ShardInfo> ShardedSplitWriter::finish() {
  close_shard();
  fsync_dir(dir_);
  progress_->finish();
  return shards_;
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fault("cannot open directory {}: {}", dir, strerror(errno));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fault("fsync {} failed: {}", dir, strerror(errno));
}

namespace {
std::string parent_of(const std::string& p) {
  fs::path parent = fs::path(p).lexically_normal().parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}
}  // namespace

DatasetStager::DatasetStager(const std::string& out) : out_(fs::path(out).lexically_normal().string()) {
  if (!out_.empty() && out_.back() == '/') out_.pop_back();
  std::error_code ec;
  if (fs::exists(out_, ec) && !fs::is_directory(out_, ec)) user_error("{}: exists and is not a directory", out_);
  if (fs::is_directory(out_, ec) && fs::is_empty(out_, ec)) fs::remove(out_, ec);  // empty: start fresh
  std::string pid = std::to_string(::getpid());
  if (fs::is_directory(out_, ec)) {
    if (!fs::exists(fs::path(out_) / "manifest.json", ec))
      user_error("{}: directory exists but has no manifest.json (not a dtrain dataset); remove it or choose another --out",
                 out_);
    existing_ = read_manifest(out_);
    staging_ = (fs::path(out_) / (".tmp-" + pid)).string();
  } else {
    fs::create_directories(parent_of(out_), ec);
    if (ec) fault("cannot create {}: {}", parent_of(out_), ec.message());
    staging_ = out_ + ".tmp-" + pid;
  }
  fs::remove_all(staging_, ec);
  fs::create_directories(staging_, ec);
  if (ec) fault("cannot create {}: {}", staging_, ec.message());
}

DatasetStager::~DatasetStager() {
  if (!done_) abandon();
}

void DatasetStager::abandon() {
  std::error_code ec;
  fs::remove_all(staging_, ec);
  done_ = true;
}

std::string DatasetStager::split_dir(const std::string& split) const {
  return (fs::path(staging_) / split).string();
}

void DatasetStager::commit(const Manifest& m, const std::vector<std::string>& new_splits) {
  DTRAIN_CHECK(!done_, "DatasetStager::commit twice for {}", out_);
  std::error_code ec;
  if (!existing_) {
    write_manifest((fs::path(staging_) / "manifest.json").string(), m);
    fsync_dir(staging_);
    fs::rename(staging_, out_, ec);
    if (ec) fault("rename {} -> {} failed: {}", staging_, out_, ec.message());
    fsync_dir(parent_of(out_));
  } else {
    for (const auto& s : new_splits) {
      fs::path dst = fs::path(out_) / s;
      if (fs::exists(dst, ec))
        user_error("{}: exists but split '{}' is not in its manifest.json; remove it and run again", dst.string(), s);
      fs::rename(split_dir(s), dst, ec);
      if (ec) fault("rename {} -> {} failed: {}", split_dir(s), dst.string(), ec.message());
    }
    fsync_dir(out_);
    write_manifest((fs::path(out_) / "manifest.json").string(), m);
    fsync_dir(out_);
    fs::remove_all(staging_, ec);
  }
  done_ = true;
}

}  // namespace dtrain::data

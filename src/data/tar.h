#pragma once
// POSIX ustar archives, the container of WebDataset shards.
//
// TarWriter appends regular-file members (512-byte ustar header, data padded to 512),
// finishes with two zero blocks and fsyncs: the result reads with GNU tar, Python's
// tarfile and webdataset. Member names are stored as given (mode 0644, mtime 0, owner 0)
// so the same input gives byte-identical shards.
//
// tar_index() parses an archive held in memory and returns its regular-file members with
// data offsets; it validates every header's checksum and magic. A file that is not a tar
// or ends before the end-of-archive blocks is a UserError naming the path. Pax ('x') and
// GNU long-name ('L') headers override the next member's name; directories and other
// non-file entries are skipped.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::data {

class TarWriter {
 public:
  explicit TarWriter(const std::string& path);  // creates/truncates; RuntimeFault on I/O
  ~TarWriter();                                 // closes without finishing if finish() wasn't called
  TarWriter(const TarWriter&) = delete;
  TarWriter& operator=(const TarWriter&) = delete;

  // name: up to 255 bytes (split into ustar prefix/name at a '/' when over 100).
  void add(const std::string& name, const void* data, size_t size);
  void add(const std::string& name, std::string_view data) { add(name, data.data(), data.size()); }
  void finish();  // end-of-archive blocks, fsync, close
  uint64_t bytes_written() const { return written_; }
  const std::string& path() const { return path_; }

 private:
  void write_all(const void* p, size_t n);
  std::string path_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

struct TarMember {
  std::string name;
  uint64_t offset = 0;  // of the data, from the start of the archive
  uint64_t size = 0;
};

// `path` is only used in error messages.
std::vector<TarMember> tar_index(const uint8_t* data, size_t size, const std::string& path);

// Reads a whole file into memory (RuntimeFault when unreadable, UserError when missing).
std::vector<uint8_t> read_file_bytes(const std::string& path);

// WebDataset grouping: "dir/train_000123.png" -> key "dir/train_000123", ext "png"
// (the key ends at the first '.' after the last '/').
void split_key(const std::string& name, std::string& key, std::string& ext);

// A WebDataset image member's extension that the loaders decode (png, jpg, jpeg, bmp).
bool is_image_ext(const std::string& ext);

// A KEY.cls member: "7", " 7\n" -> 7; false when not a decimal integer.
bool parse_label(const uint8_t* p, size_t n, int64_t& v);

}  // namespace dtrain::data

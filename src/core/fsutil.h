#pragma once
// Durable file-system helpers for the run directory (checkpoints, `latest`, logs).
// Every failure throws RuntimeFault naming the path and strerror (I/O is a runtime fault;
// the callers that read user-supplied files turn bad *content* into UserError).
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::fs {

// Writes a file through a raw descriptor; close() fsyncs before closing.
// The destructor closes without fsync (only reached when an exception is unwinding).
class FileWriter {
 public:
  explicit FileWriter(const std::string& path);  // creates/truncates, mode 0644
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  void write(const void* data, size_t n);
  void close();  // fsync + close; throws on failure
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// Writes `data` to `path` and fsyncs it (not atomic: the caller owns atomicity).
void write_file(const std::string& path, const void* data, size_t n);
inline void write_file(const std::string& path, const std::string& s) { write_file(path, s.data(), s.size()); }
// Atomic replace: writes path.tmp-<pid>, fsyncs, renames over path, fsyncs the directory.
void write_file_atomic(const std::string& path, const std::string& s);
// The whole file; RuntimeFault if unreadable or longer than max_bytes (a bound for files that
// are small by nature, so that a link to /dev/zero is an error rather than a full memory).
std::string read_file(const std::string& path, size_t max_bytes = SIZE_MAX);

void fsync_path(const std::string& path);  // a file or a directory
void fsync_dir(const std::string& dir);
void rename_path(const std::string& from, const std::string& to);  // rename(2)
void mkdirs(const std::string& dir);                                // mkdir -p
void remove_tree(const std::string& path);                          // rm -rf (no error if absent)
bool exists(const std::string& path);
bool is_dir(const std::string& path);
std::string parent_dir(const std::string& path);  // "." when there is no slash
std::string base_name(const std::string& path);

}  // namespace dtrain::fs

#include "core/fsutil.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace dtrain::fs {

namespace {
std::string errstr() { return std::strerror(errno); }
}  // namespace

FileWriter::FileWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fault("cannot create {}: {}", path, errstr());
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(const void* data, size_t n) {
  DTRAIN_CHECK(fd_ >= 0, "write to closed file {}", path_);
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fault("cannot write {}: {}", path_, errstr());
    }
    p += w;
    n -= size_t(w);
  }
}

void FileWriter::close() {
  if (fd_ < 0) return;
  int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0) {
    std::string e = errstr();
    ::close(fd);
    fault("cannot fsync {}: {}", path_, e);
  }
  if (::close(fd) != 0) fault("cannot close {}: {}", path_, errstr());
}

void write_file(const std::string& path, const void* data, size_t n) {
  FileWriter w(path);
  w.write(data, n);
  w.close();
}

void write_file_atomic(const std::string& path, const std::string& s) {
  std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  write_file(tmp, s);
  rename_path(tmp, path);
  fsync_dir(parent_dir(path));
}

std::string read_file(const std::string& path, size_t max_bytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fault("cannot open {}: {}", path, errstr());
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t r = ::read(fd, buf, sizeof buf);
    if (r < 0) {
      if (errno == EINTR) continue;
      std::string e = errstr();
      ::close(fd);
      fault("cannot read {}: {}", path, e);
    }
    if (r == 0) break;
    out.append(buf, size_t(r));
    if (out.size() > max_bytes) {  // /dev/zero, or a file that is not what the caller reads
      ::close(fd);
      fault("{}: more than {} bytes (not the file expected there)", path, max_bytes);
    }
  }
  ::close(fd);
  return out;
}

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fault("cannot open {} for fsync: {}", path, errstr());
  if (::fsync(fd) != 0) {
    std::string e = errstr();
    ::close(fd);
    fault("cannot fsync {}: {}", path, e);
  }
  ::close(fd);
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fault("cannot open directory {} for fsync: {}", dir, errstr());
  // Some file systems refuse fsync on directories (EINVAL); there is nothing more to do then.
  if (::fsync(fd) != 0 && errno != EINVAL) {
    std::string e = errstr();
    ::close(fd);
    fault("cannot fsync directory {}: {}", dir, e);
  }
  ::close(fd);
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fault("cannot rename {} to {}: {}", from, to, errstr());
}

void mkdirs(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fault("cannot create directory {}: {}", dir, ec.message());
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) fault("cannot remove {}: {}", path, ec.message());
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string parent_dir(const std::string& path) {
  size_t p = path.find_last_of('/');
  if (p == std::string::npos) return ".";
  if (p == 0) return "/";
  return path.substr(0, p);
}

std::string base_name(const std::string& path) {
  size_t p = path.find_last_of('/');
  return p == std::string::npos ? path : path.substr(p + 1);
}

}  // namespace dtrain::fs

#include "obs/jsonl.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>

#include "core/error.h"
#include "core/log.h"

namespace dtrain {

namespace {

// Length of `fd`'s content up to and including its last '\n' (0 when it has none).
off_t complete_length(int fd, off_t size, const std::string& path) {
  char buf[4096];
  off_t end = size;
  while (end > 0) {
    const off_t begin = end > off_t(sizeof buf) ? end - off_t(sizeof buf) : 0;
    const ssize_t n = ::pread(fd, buf, size_t(end - begin), begin);
    if (n != end - begin) fault("cannot read {}: {}", path, n < 0 ? std::strerror(errno) : "short read");
    for (ssize_t i = n - 1; i >= 0; --i)
      if (buf[i] == '\n') return begin + i + 1;
    end = begin;
  }
  return 0;
}

}  // namespace

JsonlWriter::JsonlWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) fault("cannot open {} for appending: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fault("cannot stat {}: {}", path, std::strerror(errno));
  if (st.st_size > 0) {
    const int rfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (rfd < 0) fault("cannot read {}: {}", path, std::strerror(errno));
    const off_t keep = complete_length(rfd, st.st_size, path);
    ::close(rfd);
    if (keep != st.st_size) {
      log::warn("{}: dropping a truncated last line ({} bytes) left by an interrupted write", path,
                int64_t(st.st_size - keep));
      if (::ftruncate(fd_, keep) != 0) fault("cannot truncate {}: {}", path, std::strerror(errno));
    }
  }
}

JsonlWriter::~JsonlWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void JsonlWriter::write(const nlohmann::json& obj) {
  // Invalid UTF-8 in a string (e.g. a path) is replaced rather than aborting the run.
  std::string line = obj.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  line.push_back('\n');
  size_t off = 0;
  while (off < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + off, line.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fault("cannot write {}: {}", path_, n < 0 ? std::strerror(errno) : "no progress");
    off += size_t(n);
  }
}

std::string iso8601_now() {
  using namespace std::chrono;
  auto now = system_clock::now();
  auto ms = duration_cast<milliseconds>(now.time_since_epoch()).count();
  std::time_t secs = std::time_t(ms / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, int(ms % 1000));
  return buf;
}

}  // namespace dtrain

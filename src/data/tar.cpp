#include "data/tar.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace dtrain::data {

namespace {

constexpr size_t kBlock = 512;

// ustar header field offsets (POSIX.1-1988).
constexpr size_t kName = 0, kMode = 100, kUid = 108, kGid = 116, kSize = 124, kMtime = 136,
                 kChksum = 148, kType = 156, kMagic = 257, kVersion = 263, kUname = 265,
                 kGname = 297, kPrefix = 345;

void put_octal(uint8_t* h, size_t off, size_t width, uint64_t v) {
  // width-1 octal digits, zero-padded, NUL-terminated.
  std::string s = fmt::format("{:0{}o}", v, width - 1);
  DTRAIN_CHECK(s.size() == width - 1, "tar octal field overflow: {}", v);
  memcpy(h + off, s.data(), s.size());
  h[off + width - 1] = 0;
}

uint32_t header_sum(const uint8_t* h, bool as_signed) {
  uint32_t sum = 0;
  for (size_t i = 0; i < kBlock; ++i) {
    uint8_t c = (i >= kChksum && i < kChksum + 8) ? uint8_t(' ') : h[i];
    sum += as_signed ? uint32_t(int32_t(int8_t(c))) : uint32_t(c);
  }
  return sum;
}

bool parse_octal(const uint8_t* p, size_t width, uint64_t& v) {
  size_t i = 0;
  while (i < width && (p[i] == ' ')) ++i;
  if (i < width && (p[i] & 0x80)) {  // GNU base-256 for big sizes
    v = p[i] & 0x3f;
    for (++i; i < width; ++i) v = (v << 8) | p[i];
    return true;
  }
  v = 0;
  bool any = false;
  for (; i < width && p[i] >= '0' && p[i] <= '7'; ++i) {
    v = v * 8 + uint64_t(p[i] - '0');
    any = true;
  }
  for (; i < width; ++i)
    if (p[i] != 0 && p[i] != ' ') return false;
  return any;
}

std::string cstr(const uint8_t* p, size_t width) {
  size_t n = 0;
  while (n < width && p[n]) ++n;
  return std::string(reinterpret_cast<const char*>(p), n);
}

bool all_zero(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (p[i]) return false;
  return true;
}

// Pax extended header records: "LEN key=value\n"; returns the value of "path" (or "").
std::string pax_path(const uint8_t* p, size_t n, const std::string& path) {
  size_t i = 0;
  std::string result;
  while (i < n) {
    size_t sp = i;
    while (sp < n && p[sp] != ' ') ++sp;
    size_t len = 0;
    for (size_t j = i; j < sp; ++j) {
      if (p[j] < '0' || p[j] > '9') user_error("{}: malformed pax header record at byte {}", path, i);
      len = len * 10 + size_t(p[j] - '0');
    }
    if (len == 0 || i + len > n || sp >= i + len) user_error("{}: malformed pax header record at byte {}", path, i);
    std::string rec(reinterpret_cast<const char*>(p) + sp + 1, i + len - sp - 2);  // drop '\n'
    auto eq = rec.find('=');
    if (eq != std::string::npos && rec.compare(0, eq, "path") == 0) result = rec.substr(eq + 1);
    i += len;
  }
  return result;
}

}  // namespace

TarWriter::TarWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fault("cannot create {}: {}", path, strerror(errno));
}

TarWriter::~TarWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TarWriter::write_all(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd_, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fault("write to {} failed: {}", path_, strerror(errno));
    }
    c += w;
    n -= size_t(w);
    written_ += uint64_t(w);
  }
}

void TarWriter::add(const std::string& name, const void* data, size_t size) {
  DTRAIN_CHECK(fd_ >= 0, "TarWriter::add after finish on {}", path_);
  if (name.empty()) user_error("{}: empty tar member name", path_);
  std::string prefix, base = name;
  if (name.size() > 100) {
    // ustar: prefix (155) + '/' + name (100); split at a '/' that makes both fit.
    size_t cut = std::string::npos;
    for (size_t i = 0; i < name.size() && i <= 155; ++i)
      if (name[i] == '/' && name.size() - i - 1 <= 100 && name.size() - i - 1 > 0) { cut = i; break; }
    if (cut == std::string::npos)
      user_error("{}: tar member name '{}' is too long for ustar (max 100 bytes, or 255 with a '/')", path_, name);
    prefix = name.substr(0, cut);
    base = name.substr(cut + 1);
  }
  uint8_t h[kBlock] = {};
  memcpy(h + kName, base.data(), base.size());
  put_octal(h, kMode, 8, 0644);
  put_octal(h, kUid, 8, 0);
  put_octal(h, kGid, 8, 0);
  put_octal(h, kSize, 12, size);
  put_octal(h, kMtime, 12, 0);
  h[kType] = '0';
  memcpy(h + kMagic, "ustar", 6);  // with its NUL
  memcpy(h + kVersion, "00", 2);
  memcpy(h + kUname, "dtrain", 6);
  memcpy(h + kGname, "dtrain", 6);
  memcpy(h + kPrefix, prefix.data(), prefix.size());
  // Checksum: 6 octal digits, NUL, space.
  std::string ck = fmt::format("{:06o}", header_sum(h, false));
  memcpy(h + kChksum, ck.data(), 6);
  h[kChksum + 6] = 0;
  h[kChksum + 7] = ' ';
  write_all(h, kBlock);
  if (size) write_all(data, size);
  static const uint8_t zeros[kBlock] = {};
  if (size % kBlock) write_all(zeros, kBlock - size % kBlock);
}

void TarWriter::finish() {
  DTRAIN_CHECK(fd_ >= 0, "TarWriter::finish twice on {}", path_);
  static const uint8_t zeros[2 * kBlock] = {};
  write_all(zeros, sizeof zeros);
  if (::fsync(fd_) != 0) fault("fsync {} failed: {}", path_, strerror(errno));
  if (::close(fd_) != 0) fault("close {} failed: {}", path_, strerror(errno));
  fd_ = -1;
}

std::vector<TarMember> tar_index(const uint8_t* d, size_t size, const std::string& path) {
  std::vector<TarMember> out;
  std::string next_name;  // from a pax or GNU long-name header
  size_t pos = 0;
  while (true) {
    if (pos + kBlock > size) {
      if (pos == 0) user_error("{}: not a tar archive (file is {} bytes, shorter than one header)", path, size);
      user_error("{}: truncated tar archive (ends at byte {} without the end-of-archive blocks)", path, size);
    }
    const uint8_t* h = d + pos;
    if (all_zero(h, kBlock)) break;  // end of archive (a second zero block normally follows)
    uint64_t stored = 0, sz = 0;
    if (!parse_octal(h + kChksum, 8, stored) ||
        (stored != header_sum(h, false) && stored != header_sum(h, true))) {
      if (pos == 0) user_error("{}: not a tar archive (bad header checksum at byte 0)", path);
      user_error("{}: corrupt tar header at byte {} (checksum mismatch)", path, pos);
    }
    if (memcmp(h + kMagic, "ustar", 5) != 0)
      user_error("{}: tar header at byte {} is not ustar (magic '{}')", path, pos, cstr(h + kMagic, 6));
    if (!parse_octal(h + kSize, 12, sz)) user_error("{}: bad size field in tar header at byte {}", path, pos);
    size_t data_off = pos + kBlock;
    if (sz > size || data_off + sz > size)
      user_error("{}: truncated tar archive (member at byte {} needs {} bytes, file has {})", path, pos, sz,
                 size - data_off);
    char type = char(h[kType]);
    std::string name = cstr(h + kName, 100);
    std::string prefix = cstr(h + kPrefix, 155);
    if (!prefix.empty() && h[kMagic + 5] == 0) name = prefix + "/" + name;  // POSIX ustar, not GNU
    if (type == 'x') {
      next_name = pax_path(d + data_off, sz, path);
    } else if (type == 'L') {
      next_name = cstr(d + data_off, sz);
    } else if (type == 'g') {
      // global pax header: ignored
    } else {
      if (!next_name.empty()) name = next_name;
      next_name.clear();
      if (type == '0' || type == '\0' || type == '7') out.push_back({name, data_off, sz});
    }
    pos = data_off + (sz + kBlock - 1) / kBlock * kBlock;
  }
  return out;
}

std::vector<uint8_t> read_file_bytes(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) user_error("{}: file not found", path);
    fault("cannot open {}: {}", path, strerror(errno));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    fault("cannot stat {}: {}", path, strerror(errno));
  }
  std::vector<uint8_t> buf(size_t(st.st_size));
  size_t got = 0;
  while (got < buf.size()) {
    ssize_t r = ::read(fd, buf.data() + got, buf.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      ::close(fd);
      fault("read {} failed: {}", path, r < 0 ? strerror(errno) : "unexpected end of file");
    }
    got += size_t(r);
  }
  ::close(fd);
  return buf;
}

void split_key(const std::string& name, std::string& key, std::string& ext) {
  size_t slash = name.rfind('/');
  size_t start = slash == std::string::npos ? 0 : slash + 1;
  size_t dot = name.find('.', start);
  if (dot == std::string::npos) {
    key = name;
    ext.clear();
  } else {
    key = name.substr(0, dot);
    ext = name.substr(dot + 1);
  }
}

bool is_image_ext(const std::string& e) { return e == "png" || e == "jpg" || e == "jpeg" || e == "bmp"; }

// "7", " 7\n" -> 7; false when not a decimal integer.
bool parse_label(const uint8_t* p, size_t n, int64_t& v) {
  size_t i = 0;
  while (i < n && std::isspace(p[i])) ++i;
  bool neg = false;
  if (i < n && (p[i] == '-' || p[i] == '+')) neg = p[i++] == '-';
  size_t digits = 0;
  v = 0;
  for (; i < n && p[i] >= '0' && p[i] <= '9'; ++i, ++digits) {
    if (v > 100000000000LL) return false;
    v = v * 10 + (p[i] - '0');
  }
  while (i < n && std::isspace(p[i])) ++i;
  if (neg) v = -v;
  return digits > 0 && i == n;
}

}  // namespace dtrain::data

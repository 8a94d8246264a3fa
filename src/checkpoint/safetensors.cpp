#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fsutil.h"

namespace dtrain {

namespace {

// The safetensors header is limited to 100 MB by the reference implementation.
constexpr uint64_t kMaxHeader = 100u * 1000u * 1000u;

// Elements * element size, or false on overflow / negative dimension.
bool tensor_bytes(const std::vector<int64_t>& shape, size_t elem, uint64_t* out) {
  unsigned __int128 n = elem;
  for (int64_t d : shape) {
    if (d < 0) return false;
    n *= uint64_t(d);
    if (n > (unsigned __int128)UINT64_MAX) return false;
  }
  *out = uint64_t(n);
  return true;
}

void put_u64le(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}

uint64_t get_u64le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

// pread the whole range or report how many bytes were available.
bool pread_full(int fd, void* dst, size_t n, uint64_t off) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, off_t(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (r == 0) return false;
    p += r;
    n -= size_t(r);
    off += uint64_t(r);
  }
  return true;
}

}  // namespace

size_t safetensors_dtype_size(const std::string& d) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2},
      {"U16", 2},  {"F16", 2}, {"BF16", 2}, {"I32", 4},    {"U32", 4},     {"F32", 4},
      {"I64", 8},  {"U64", 8}, {"F64", 8}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const StTensor& t : tensors) {
    size_t es = safetensors_dtype_size(t.dtype);
    DTRAIN_CHECK(es != 0, "{}: tensor {}: unknown safetensors dtype '{}'", path, t.name, t.dtype);
    DTRAIN_CHECK(t.name != "__metadata__" && !t.name.empty(), "{}: invalid tensor name '{}'", path, t.name);
    DTRAIN_CHECK(!header.contains(t.name), "{}: duplicate tensor name {}", path, t.name);
    uint64_t want = 0;
    DTRAIN_CHECK(tensor_bytes(t.shape, es, &want), "{}: tensor {}: invalid shape", path, t.name);
    DTRAIN_CHECK(want == t.nbytes, "{}: tensor {}: shape needs {} bytes, got {}", path, t.name, want, t.nbytes);
    DTRAIN_CHECK(t.data != nullptr || t.nbytes == 0, "{}: tensor {}: null data", path, t.name);
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + want}}};
    offset += want;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;

  std::string h = header.dump();
  // Pad with spaces so the data begins at an 8-byte aligned file offset (8 + N ≡ 0 mod 8).
  while (h.size() % 8 != 0) h.push_back(' ');
  uint8_t len[8];
  put_u64le(len, h.size());

  fs::FileWriter w(path);
  w.write(len, 8);
  w.write(h.data(), h.size());
  for (const StTensor& t : tensors)
    if (t.nbytes) w.write(t.data, t.nbytes);
  w.close();
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) user_error("{}: cannot open safetensors file: {}", path, std::strerror(errno));
  try {
    struct stat st;
    if (::fstat(fd_, &st) != 0) fault("{}: cannot stat: {}", path, std::strerror(errno));
    const uint64_t fsize = uint64_t(st.st_size);
    if (fsize < 8) user_error("{}: not a safetensors file: {} bytes, shorter than the 8-byte header length", path, fsize);
    uint8_t len8[8];
    if (!pread_full(fd_, len8, 8, 0)) fault("{}: cannot read header length", path);
    const uint64_t hlen = get_u64le(len8);
    if (hlen < 2 || hlen > kMaxHeader)
      user_error("{}: not a safetensors file: header length {} (expected 2..{})", path, hlen, kMaxHeader);
    if (hlen > fsize - 8)
      user_error("{}: truncated safetensors file: header length {} but only {} bytes follow", path, hlen, fsize - 8);
    std::string text(hlen, '\0');
    if (!pread_full(fd_, text.data(), hlen, 8)) fault("{}: cannot read header", path);
    data_start_ = 8 + hlen;
    const uint64_t data_size = fsize - data_start_;

    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      user_error("{}: malformed safetensors header JSON: {}", path, e.what());
    }
    if (!j.is_object()) user_error("{}: safetensors header is not a JSON object", path);

    struct Span { uint64_t b, e; std::string name; };
    std::vector<Span> spans;
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& name = it.key();
      const nlohmann::json& v = it.value();
      if (name == "__metadata__") {
        if (!v.is_object()) user_error("{}: __metadata__ must be an object of strings", path);
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string())
            user_error("{}: __metadata__ key '{}' must be a string, got {}", path, m.key(), m.value().dump());
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      if (!v.is_object()) user_error("{}: tensor '{}': header entry must be an object", path, name);
      Entry e;
      auto dt = v.find("dtype");
      if (dt == v.end() || !dt->is_string()) user_error("{}: tensor '{}': missing string 'dtype'", path, name);
      e.dtype = dt->get<std::string>();
      size_t es = safetensors_dtype_size(e.dtype);
      if (es == 0) user_error("{}: tensor '{}': unknown dtype '{}'", path, name, e.dtype);
      auto sh = v.find("shape");
      if (sh == v.end() || !sh->is_array()) user_error("{}: tensor '{}': missing array 'shape'", path, name);
      for (const auto& d : *sh) {
        if (!d.is_number_unsigned()) user_error("{}: tensor '{}': shape {} must hold non-negative integers", path, name, sh->dump());
        e.shape.push_back(int64_t(d.get<uint64_t>()));
      }
      auto off = v.find("data_offsets");
      if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
          !(*off)[1].is_number_unsigned())
        user_error("{}: tensor '{}': 'data_offsets' must be [begin, end] non-negative integers", path, name);
      e.begin = (*off)[0].get<uint64_t>();
      e.end = (*off)[1].get<uint64_t>();
      if (e.end < e.begin) user_error("{}: tensor '{}': data_offsets [{}, {}] end before begin", path, name, e.begin, e.end);
      if (e.end > data_size)
        user_error("{}: tensor '{}': data_offsets [{}, {}] beyond the {} data bytes in the file (truncated?)", path, name,
                   e.begin, e.end, data_size);
      uint64_t want = 0;
      if (!tensor_bytes(e.shape, es, &want) || want != e.end - e.begin)
        user_error("{}: tensor '{}': shape {} of {} needs {} bytes but data_offsets span {}", path, name, sh->dump(),
                   e.dtype, want, e.end - e.begin);
      spans.push_back({e.begin, e.end, name});
      entries_.emplace(name, std::move(e));
    }
    // Tensors must tile the data region exactly: sorted by offset, each begins where the
    // previous ended, and the last ends at the end of the file.
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.b != b.b ? a.b < b.b : a.e < b.e;
    });
    uint64_t pos = 0;
    for (const Span& s : spans) {
      if (s.b < pos) user_error("{}: tensor '{}': data_offsets [{}, {}] overlap the previous tensor", path, s.name, s.b, s.e);
      if (s.b > pos) user_error("{}: tensor '{}': gap in data before offset {} (previous tensor ends at {})", path, s.name, s.b, pos);
      pos = s.e;
      order_.push_back(s.name);
    }
    if (pos != data_size)
      user_error("{}: tensors cover {} data bytes but the file holds {} (trailing bytes)", path, pos, data_size);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<std::string> SafetensorsReader::names() const { return order_; }

bool SafetensorsReader::has(const std::string& name) const { return entries_.count(name) != 0; }

const SafetensorsReader::Entry& SafetensorsReader::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) user_error("{}: no tensor named '{}'", path_, name);
  return it->second;
}

const std::string& SafetensorsReader::dtype(const std::string& name) const { return entry(name).dtype; }

std::vector<int64_t> SafetensorsReader::shape(const std::string& name) const { return entry(name).shape; }

size_t SafetensorsReader::nbytes(const std::string& name) const {
  const Entry& e = entry(name);
  return size_t(e.end - e.begin);
}

void SafetensorsReader::read(const std::string& name, void* dst, size_t nbytes) const {
  const Entry& e = entry(name);
  if (nbytes != e.end - e.begin)
    user_error("{}: tensor '{}' holds {} bytes, expected {}", path_, name, e.end - e.begin, nbytes);
  if (!pread_full(fd_, dst, nbytes, data_start_ + e.begin))
    fault("{}: cannot read tensor '{}' ({} bytes at offset {})", path_, name, nbytes, data_start_ + e.begin);
}

void SafetensorsReader::read_range(const std::string& name, uint64_t offset, void* dst, size_t nbytes) const {
  const Entry& e = entry(name);
  const uint64_t size = e.end - e.begin;
  if (offset > size || nbytes > size - offset)
    user_error("{}: tensor '{}' holds {} bytes, cannot read {} bytes at offset {}", path_, name, size, nbytes, offset);
  if (nbytes && !pread_full(fd_, dst, nbytes, data_start_ + e.begin + offset))
    fault("{}: cannot read tensor '{}' ({} bytes at offset {})", path_, name, nbytes, data_start_ + e.begin + offset);
}

std::vector<float> read_f32(const TensorSource& r, const std::string& name) {
  const std::string& dt = r.dtype(name);
  int64_t n = 1;
  for (int64_t d : r.shape(name)) n *= d;
  std::vector<float> out(static_cast<size_t>(n));
  if (dt == "F32") {
    r.read(name, out.data(), out.size() * 4);
  } else if (dt == "F16" || dt == "BF16") {
    std::vector<uint16_t> raw(static_cast<size_t>(n));
    r.read(name, raw.data(), raw.size() * 2);
    for (size_t i = 0; i < raw.size(); ++i)
      out[i] = dt == "F16" ? f16_to_f32(f16_t{raw[i]}) : bf16_to_f32(bf16_t{raw[i]});
  } else {
    user_error("{}: tensor '{}' has dtype {}: expected F32, F16 or BF16", r.origin(), name, dt);
  }
  return out;
}

}  // namespace dtrain

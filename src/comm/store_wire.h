#pragma once
// dtrain's store protocol on the wire (see store.h), shared by StoreClient (store.cpp) and
// StoreServer (store_server.cpp). Internal to the comm layer.
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::comm::wire {

enum Op : uint8_t { HELLO = 1, SET = 2, GET = 3, ADD = 4, CHECK = 5, DEL = 6 };

inline void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i)));
}
inline void put_i64(std::vector<uint8_t>& b, int64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(uint8_t(uint64_t(v) >> (8 * i)));
}
inline void put_bytes(std::vector<uint8_t>& b, const void* p, size_t n) {
  put_u32(b, uint32_t(n));
  auto* c = static_cast<const uint8_t*>(p);
  b.insert(b.end(), c, c + n);
}
inline void put_str(std::vector<uint8_t>& b, const std::string& s) { put_bytes(b, s.data(), s.size()); }

inline uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int k = 0; k < 4; ++k) v |= uint32_t(p[k]) << (8 * k);
  return v;
}

// Bounds-checked reader over a frame body; `ok` turns false on any overrun.
struct Reader {
  const uint8_t* p;
  size_t n, i = 0;
  bool ok = true;
  bool need(size_t k) {
    if (!ok || n - i < k) ok = false;
    return ok;
  }
  uint8_t u8() { return need(1) ? p[i++] : 0; }
  uint32_t u32() {
    if (!need(4)) return 0;
    uint32_t v = get_u32(p + i);
    i += 4;
    return v;
  }
  int64_t i64() {
    if (!need(8)) return 0;
    uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v |= uint64_t(p[i + k]) << (8 * k);
    i += 8;
    return int64_t(v);
  }
  std::string str() {
    uint32_t len = u32();
    if (!need(len)) return {};
    std::string s(reinterpret_cast<const char*>(p + i), len);
    i += len;
    return s;
  }
  bool done() const { return ok && i == n; }
};

inline std::vector<uint8_t> frame(const std::vector<uint8_t>& body) {
  std::vector<uint8_t> f;
  f.reserve(body.size() + 4);
  put_u32(f, uint32_t(body.size()));
  f.insert(f.end(), body.begin(), body.end());
  return f;
}

// An error reply frame (status 1 + message).
inline std::vector<uint8_t> error_frame(const std::string& msg) {
  std::vector<uint8_t> r{1};
  put_str(r, msg);
  return frame(r);
}

}  // namespace dtrain::comm::wire

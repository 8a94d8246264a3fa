#pragma once
// SHA-256 (FIPS 180-4) for checkpoint and shard checksums.
#include <array>
#include <cstdint>
#include <string>

namespace dtrain {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t len);
  std::array<uint8_t, 32> digest();  // finalises
  std::string hex();                  // finalises

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

std::string sha256_hex(const void* data, size_t len);
std::string sha256_file(const std::string& path);  // throws RuntimeFault when unreadable

}  // namespace dtrain

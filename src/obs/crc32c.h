#pragma once
// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by TFRecord / TensorBoard
// event files. crc32c("123456789") == 0xE3069283.
#include <cstddef>
#include <cstdint>

namespace dtrain {

// Continues a CRC: crc32c(crc32c(0, a), b) == crc32c of a followed by b.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(const void* data, size_t n) { return crc32c(0, data, n); }
// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
inline uint32_t crc32c_masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace dtrain

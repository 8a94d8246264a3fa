#include "core/rng.h"

namespace dtrain {

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = uint64_t(M0) * c[0];
    uint64_t p1 = uint64_t(M1) * c[2];
    uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
    uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += W0;
    k[1] += W1;
  }
  return c;
}

void Rng::refill() {
  std::array<uint32_t, 4> ctr = {uint32_t(counter_), uint32_t(counter_ >> 32), uint32_t(stream_),
                                 uint32_t(stream_ >> 32)};
  block_ = philox4x32_10(ctr, {uint32_t(seed_), uint32_t(seed_ >> 32)});
  idx_ = 0;
}

uint32_t Rng::next_u32() {
  if (idx_ == 4) refill();
  uint32_t v = block_[idx_++];
  if (idx_ == 4) counter_++;
  return v;
}

void Rng::set_position(uint64_t pos) {
  counter_ = pos / 4;
  idx_ = 4;
  int skip = int(pos % 4);
  if (skip) {
    refill();
    idx_ = skip;
  }
}

float Rng::normal() {
  // Two uniforms in (0,1]; one normal per call keeps the stream position simple.
  float u1 = (float(next_u32() >> 8) + 1.0f) * (1.0f / 16777216.0f);
  float u2 = uniform();
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.283185307179586f * u2);
}

uint64_t Rng::below(uint64_t n) {
  if (n <= 0xffffffffull) {
    uint32_t n32 = uint32_t(n);
    uint64_t m = uint64_t(next_u32()) * n32;
    uint32_t l = uint32_t(m);
    if (l < n32) {
      uint32_t t = uint32_t(-n32) % n32;
      while (l < t) {
        m = uint64_t(next_u32()) * n32;
        l = uint32_t(m);
      }
    }
    return m >> 32;
  }
  uint64_t lim = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = next_u64();
  while (x >= lim);
  return x % n;
}

static uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t stream_id(uint64_t a, uint64_t b, uint64_t c) {
  return splitmix(splitmix(splitmix(a) ^ b) ^ c);
}

}  // namespace dtrain

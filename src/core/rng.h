#pragma once
// Counter-based RNG: Philox 4x32-10 (Salmon et al., SC'11). A stream is identified by
// (seed, stream id words); the state is just a counter, so every (seed, rank, step,
// purpose) gets its own reproducible sequence and checkpointing the RNG is saving two
// integers.
#include <array>
#include <cmath>
#include <cstdint>

namespace dtrain {

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

class Rng {
 public:
  Rng() = default;
  // seed -> key; (stream_hi, stream_lo) occupy the high counter words.
  Rng(uint64_t seed, uint64_t stream = 0) : seed_(seed), stream_(stream) {}

  uint32_t next_u32();
  uint64_t next_u64() { return (uint64_t(next_u32()) << 32) | next_u32(); }
  float uniform() { return float(next_u32() >> 8) * (1.0f / 16777216.0f); }  // [0,1)
  double uniform_double() { return double(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
  float normal();  // Box-Muller, standard normal
  // Uniform integer in [0, n), n > 0 (Lemire's multiply, unbiased via rejection).
  uint64_t below(uint64_t n);

  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }
  uint64_t position() const { return counter_ * 4 + (idx_ == 4 ? 0 : idx_); }  // values drawn
  void set_position(uint64_t pos);

 private:
  void refill();
  uint64_t seed_ = 0, stream_ = 0;
  uint64_t counter_ = 0;  // block index
  std::array<uint32_t, 4> block_{};
  int idx_ = 4;  // 4 means empty
};

// Mix several ids into one 64-bit stream id (splitmix64-based).
uint64_t stream_id(uint64_t a, uint64_t b = 0, uint64_t c = 0);

}  // namespace dtrain

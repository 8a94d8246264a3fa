#pragma once
// Fine-tuning shards for tests (data/sft_shards.h): a split of `docs` documents of byte tokens
// (vocabulary 256), lengths drawn from [min_len, max_len], each a prompt (its first third, not
// targets) and a completion (targets), written as DIR/SPLIT_000000.bin + .sft.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/sft_shards.h"
#include "data/token_shards.h"

struct SftSplit {
  std::vector<uint16_t> tokens;
  dtrain::SftSide side;
};

inline SftSplit make_sft_split(int docs, int min_len, int max_len, uint64_t seed) {
  dtrain::Rng r(seed);
  SftSplit s;
  s.side.starts.push_back(0);
  for (int d = 0; d < docs; ++d) {
    const int len = min_len + int(r.below(uint64_t(max_len - min_len + 1)));
    const int prompt = std::max(1, len / 3);
    for (int i = 0; i < len; ++i) {
      s.tokens.push_back(uint16_t(32 + r.below(90)));  // printable bytes
      s.side.mask.push_back(i >= prompt ? 1 : 0);
    }
    s.side.starts.push_back(uint32_t(s.tokens.size()));
  }
  return s;
}

inline void write_sft_split(const std::string& dir, const std::string& split, const SftSplit& s) {
  std::filesystem::create_directories(dir);
  const std::string bin = dir + "/" + split + "_000000.bin";
  dtrain::write_token_shard(bin, s.tokens);
  dtrain::write_sft_side(dtrain::sft_side_path(bin), s.side);
}

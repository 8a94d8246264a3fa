#include "data/token_shards.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "data/tokenizer.h"

namespace dtrain {

void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_token_shard(path, tokens.data(), tokens.size());
}

namespace {

// The header (magic, version, count) and the tokens in their width.
template <class T>
void write_shard(const std::string& path, int32_t magic, int32_t version, const T* tokens, size_t n) {
  if (n > size_t(INT32_MAX)) fault("token shard {}: {} tokens exceed the int32 header", path, n);
  int32_t header[256] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = int32_t(n);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) fault("token shard {}: cannot open for writing", path);
  f.write(reinterpret_cast<const char*>(header), sizeof(header));
  f.write(reinterpret_cast<const char*>(tokens), std::streamsize(n * sizeof(T)));
  f.flush();
  if (!f) fault("token shard {}: write failed", path);
}

}  // namespace

void write_token_shard(const std::string& path, const uint16_t* tokens, size_t n) {
  write_shard(path, kTokenShardMagic, kTokenShardVersion, tokens, n);
}

void write_token_shard(const std::string& path, const uint32_t* tokens, size_t n) {
  write_shard(path, kTokenShardMagicU32, kTokenShardVersionU32, tokens, n);
}

namespace {

// Reads the n tokens after the header into t and checks each against vocab_size.
template <class T>
void read_tokens(std::ifstream& f, const std::string& path, int32_t n, int vocab_size, std::vector<T>& t) {
  // the file's size against the header's count before allocating for it (a count of 2^31 on a
  // short file is a truncated shard, not 8 GB to reserve); not for pipes, which cannot seek
  if (const std::streamoff here = f.tellg(); here >= 0 && f.seekg(0, std::ios::end)) {
    const std::streamoff end = f.tellg();
    f.seekg(here);
    const uint64_t avail = uint64_t(end - here), want = uint64_t(n) * sizeof(T);
    if (avail < want)
      user_error("token shard {}: truncated: header says {} tokens, file holds {}", path, n, avail / sizeof(T));
  } else {
    f.clear();
  }
  t.resize(static_cast<size_t>(n));
  f.read(reinterpret_cast<char*>(t.data()), std::streamsize(t.size() * sizeof(T)));
  if (size_t(f.gcount()) != t.size() * sizeof(T))
    user_error("token shard {}: truncated: header says {} tokens, file holds {}", path, n,
               size_t(f.gcount()) / sizeof(T));
  char extra;
  if (f.read(&extra, 1); f.gcount() != 0)
    user_error("token shard {}: trailing bytes after the {} tokens the header declares", path, n);
  for (size_t i = 0; i < t.size(); ++i)
    if (uint64_t(t[i]) >= uint64_t(vocab_size))
      user_error("token shard {}: token id {} at index {} is >= model.vocab_size {}", path, t[i], i,
                 vocab_size);
}

}  // namespace

TokenShard read_token_shard(const std::string& path, int vocab_size) {
  std::ifstream f(path, std::ios::binary);
  if (!f) user_error("token shard {}: cannot open", path);
  int32_t header[256];
  f.read(reinterpret_cast<char*>(header), sizeof(header));
  if (f.gcount() != std::streamsize(sizeof(header)))
    user_error("token shard {}: truncated header ({} of 1024 bytes)", path, f.gcount());
  TokenShard s;
  s.wide = header[0] == kTokenShardMagicU32;
  if (header[0] != kTokenShardMagic && !s.wide)
    user_error("token shard {}: bad magic {} (expected {}, or {} for uint32 tokens; not an llm.c token shard)",
               path, header[0], kTokenShardMagic, kTokenShardMagicU32);
  const int32_t version = s.wide ? kTokenShardVersionU32 : kTokenShardVersion;
  if (header[1] != version)
    user_error("token shard {}: unsupported version {} (expected {} with magic {})", path, header[1], version,
               header[0]);
  if (header[2] < 0) user_error("token shard {}: negative token count {}", path, header[2]);
  if (s.wide)
    read_tokens(f, path, header[2], vocab_size, s.u32);
  else
    read_tokens(f, path, header[2], vocab_size, s.u16);
  return s;
}

TokenLoader::TokenLoader(std::vector<std::string> files, int vocab_size, int batch, int seq_len,
                         int rank, int world_size, uint64_t seed)
    : files_(std::move(files)), B_(batch), T_(seq_len), rank_(rank), world_(world_size),
      seed_(seed) {
  if (files_.empty()) user_error("token data: no shard files given");
  if (B_ < 1 || T_ < 1 || world_ < 1 || rank_ < 0 || rank_ >= world_)
    fault("token loader: batch {} seq_len {} rank {} world {}", B_, T_, rank_, world_);
  int64_t acc = 0;
  start_prefix_.push_back(0);
  for (const auto& f : files_) {
    shards_.push_back(read_token_shard(f, vocab_size));
    acc += std::max<int64_t>(0, int64_t(shards_.back().size()) - T_);
    start_prefix_.push_back(acc);
  }
  if (acc == 0)
    user_error("token data: no shard among {} (first: {}) holds seq_len+1 = {} tokens",
               files_.size(), files_[0], T_ + 1);
}

void TokenLoader::window(size_t shard, int64_t start, int32_t* in, int32_t* tg) const {
  auto copy = [&](const auto* p) {
    for (int t = 0; t < T_; ++t) {
      in[t] = int32_t(p[t]);
      tg[t] = int32_t(p[t + 1]);
    }
  };
  const TokenShard& s = shards_[shard];
  if (s.wide)
    copy(s.u32.data() + start);
  else
    copy(s.u16.data() + start);
}

void TokenLoader::next(int32_t* inputs, int32_t* targets) {
  const int64_t total = start_prefix_.back();
  for (int i = 0; i < B_; ++i) {
    Rng rng(seed_, stream_id(uint64_t(rank_), pos_, uint64_t(i)));
    const int64_t u = int64_t(rng.below(uint64_t(total)));
    const size_t s = size_t(std::upper_bound(start_prefix_.begin(), start_prefix_.end(), u) -
                            start_prefix_.begin() - 1);
    window(s, u - start_prefix_[s], inputs + int64_t(i) * T_, targets + int64_t(i) * T_);
  }
  ++pos_;
}

int64_t TokenLoader::eval_batches() const {
  int64_t windows = 0;
  for (const auto& s : shards_) windows += s.size() > 0 ? (int64_t(s.size()) - 1) / T_ : 0;
  return windows / (int64_t(B_) * world_);
}

void TokenLoader::eval_batch(int64_t k, int32_t* inputs, int32_t* targets) const {
  DTRAIN_CHECK(k >= 0 && k < eval_batches(), "eval batch {} of {}", k, eval_batches());
  int64_t w = (k * world_ + rank_) * B_;  // first global window index
  for (int i = 0; i < B_; ++i, ++w) {
    int64_t rem = w;
    for (size_t s = 0; s < shards_.size(); ++s) {
      const int64_t n = shards_[s].size() > 0 ? (int64_t(shards_[s].size()) - 1) / T_ : 0;
      if (rem < n) {
        window(s, rem * T_, inputs + int64_t(i) * T_, targets + int64_t(i) * T_);
        break;
      }
      rem -= n;
    }
  }
}

int64_t TokenLoader::total_tokens() const {
  int64_t n = 0;
  for (const auto& s : shards_) n += int64_t(s.size());
  return n;
}

}  // namespace dtrain

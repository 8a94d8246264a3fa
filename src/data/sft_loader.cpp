#include "data/sft_loader.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"
#include "core/targets.h"
#include "data/sft_shards.h"

namespace dtrain {

SftLoader::SftLoader(std::vector<std::string> files, int vocab_size, const SftLoaderOptions& o) : o_(o) {
  DTRAIN_CHECK(o.batch > 0 && o.seq_len > 0, "sft loader: batch {} sequence {}", o.batch, o.seq_len);
  const int64_t T = o.seq_len;
  for (size_t f = 0; f < files.size(); ++f) {
    shards_.push_back(read_token_shard(files[f], vocab_size));
    SftSide side = read_sft_side(sft_side_path(files[f]), shards_.back().size());
    masks_.push_back(std::move(side.mask));
    for (size_t d = 0; d < side.documents(); ++d) {
      const int64_t b = side.starts[d], e = side.starts[d + 1], len = e - b;
      if (len > T && o.overflow == SftOverflow::Refuse)
        user_error("{}: document {} ({} tokens) is longer than a sequence of {} tokens{}", files[f], d, len, T,
                   o.refusal);
      const int64_t end = o.overflow == SftOverflow::Truncate ? std::min(e, b + T) : e;
      for (int64_t p = b; p < end; p += T) {  // Split: pieces of T; otherwise one piece
        Example x{uint32_t(f), p, std::min(end, p + T), end, 0};
        for (int64_t i = x.begin; i < x.end; ++i) x.targets += is_target(x, i);
        tokens_ += x.end - x.begin;
        targets_ += x.targets;
        examples_.push_back(x);
      }
    }
  }
  if (examples_.empty()) user_error("{}: no documents in the SFT shards", files.empty() ? "sft" : files[0]);
  if (!o.packing) {
    for (int64_t i = 0; i < int64_t(examples_.size()); ++i) {
      const Example& e = examples_[size_t(i)];
      rows_.push_back({{i}, e.targets, e.end - e.begin});
    }
    return;
  }
  // Best-fit decreasing: longest first (ties in file order), each into the row with the least
  // room that still fits it (the earliest such row on ties), else a new row.
  std::vector<int64_t> by_len(examples_.size());
  std::iota(by_len.begin(), by_len.end(), 0);
  auto len = [&](int64_t i) { return examples_[size_t(i)].end - examples_[size_t(i)].begin; };
  std::stable_sort(by_len.begin(), by_len.end(), [&](int64_t a, int64_t b) { return len(a) > len(b); });
  std::multimap<int64_t, int64_t> room;  // free tokens -> row
  for (int64_t i : by_len) {
    auto it = room.lower_bound(len(i));
    int64_t r;
    if (it == room.end()) {
      r = int64_t(rows_.size());
      rows_.push_back({});
    } else {
      r = it->second;
      room.erase(it);
    }
    Row& row = rows_[size_t(r)];
    row.examples.push_back(i);
    row.targets += examples_[size_t(i)].targets;
    row.tokens += len(i);
    if (row.tokens < T) room.emplace(T - row.tokens, r);
  }
}

int32_t SftLoader::token(const Example& e, int64_t i) const {
  const TokenShard& s = shards_[e.shard];
  return s.wide ? int32_t(s.u32[size_t(i)]) : int32_t(s.u16[size_t(i)]);
}

bool SftLoader::is_target(const Example& e, int64_t i) const {
  return i + 1 < e.doc_end && masks_[e.shard][size_t(i + 1)] != 0;
}

const std::vector<int64_t>& SftLoader::order(uint64_t epoch) const {
  auto it = orders_.find(epoch);
  if (it != orders_.end()) return it->second;
  if (orders_.size() >= 4) orders_.erase(orders_.begin());  // batches of a step span at most two epochs
  std::vector<int64_t> p(rows_.size());
  std::iota(p.begin(), p.end(), 0);
  Rng r(stream_id(o_.seed, epoch, 0x534654));  // Fisher-Yates from (seed, epoch)
  for (size_t i = p.size(); i > 1; --i) std::swap(p[i - 1], p[size_t(r.below(i))]);
  return orders_.emplace(epoch, std::move(p)).first->second;
}

int64_t SftLoader::row_at(uint64_t g) const {
  const uint64_t n = rows_.size();
  if (!o_.shuffle) return g < n ? int64_t(g) : -1;
  return order(g / n)[size_t(g % n)];
}

void SftLoader::fill_row(int64_t r, int32_t* in, int32_t* tg, int32_t* pos, SftBatch& b) const {
  const int64_t T = o_.seq_len;
  int64_t t = 0;
  if (r >= 0) {
    for (int64_t ei : rows_[size_t(r)].examples) {
      const Example& e = examples_[size_t(ei)];
      for (int64_t i = e.begin; i < e.end; ++i, ++t) {
        in[t] = token(e, i);
        tg[t] = is_target(e, i) ? token(e, i + 1) : kIgnoreTarget;
        pos[t] = int32_t(i - e.begin);
      }
    }
    b.targets += rows_[size_t(r)].targets;
    b.tokens += t;
  }
  for (int64_t p = 0; t < T; ++t, ++p) {  // padding: a document of its own, no targets
    in[t] = 0;
    tg[t] = kIgnoreTarget;
    pos[t] = int32_t(p);
  }
}

SftBatch SftLoader::batch(uint64_t k, int32_t* in, int32_t* tg, int32_t* pos) const {
  SftBatch b;
  const int64_t B = o_.batch, T = o_.seq_len;
  for (int64_t i = 0; i < B; ++i)
    fill_row(row_at(k * uint64_t(B) + uint64_t(i)), in + i * T, tg + i * T, pos + i * T, b);
  return b;
}

SftBatch SftLoader::totals(uint64_t first, uint64_t count) const {
  SftBatch n;
  const uint64_t B = uint64_t(o_.batch);
  for (uint64_t g = first * B; g < (first + count) * B; ++g) {
    const int64_t r = row_at(g);
    if (r < 0) continue;
    n.targets += rows_[size_t(r)].targets;
    n.tokens += rows_[size_t(r)].tokens;
  }
  return n;
}

int64_t SftLoader::eval_batches() const { return (rows() + o_.batch - 1) / o_.batch; }

}  // namespace dtrain

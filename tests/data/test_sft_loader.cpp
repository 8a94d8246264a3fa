// SftLoader (data/sft_loader.h): fine-tuning rows from SFT shards, one example per row or packed
// best-fit decreasing, targets only where the side file's mask says so, positions restarting per
// document, examples longer than a sequence refused, split or truncated, and a per-epoch shuffle
// that is a permutation fixed by the seed.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>

#include "process_work_dir.h"
#include "sft_fixture.h"
#include "core/error.h"
#include "core/targets.h"
#include "data/sft_loader.h"

using namespace dtrain;

namespace {

const std::string kWork = process_work_dir("test_sft_loader");

std::string split_file(const std::string& name, const SftSplit& s) {
  const std::string dir = kWork + "/" + name;
  write_sft_split(dir, "train", s);
  return dir + "/train_000000.bin";
}

struct Got {
  std::vector<int32_t> in, tg, pos;
  SftBatch b;
};
Got get(const SftLoader& l, uint64_t k, int B, int T) {
  Got g;
  g.in.resize(size_t(B * T)), g.tg.resize(size_t(B * T)), g.pos.resize(size_t(B * T));
  g.b = l.batch(k, g.in.data(), g.tg.data(), g.pos.data());
  return g;
}

// The documents of a row, as (start, length) from its positions (0 starts one), padding left out.
std::vector<std::pair<int, int>> docs_of(const Got& g, int row, int T) {
  std::vector<std::pair<int, int>> d;
  for (int t = 0; t < T; ++t) {
    if (g.pos[size_t(row * T + t)] == 0) d.push_back({t, 0});
    d.back().second++;
  }
  return d;
}

}  // namespace

TEST_CASE("sft loader: one example per row - targets where the mask says - positions from 0 - padding ignored") {
  const SftSplit s = make_sft_split(5, 3, 9, 1);
  SftLoaderOptions o;
  o.batch = 5, o.seq_len = 10, o.shuffle = false;
  SftLoader l({split_file("plain", s)}, 256, o);
  CHECK(l.rows() == 5);
  CHECK(l.examples() == 5);
  const Got g = get(l, 0, 5, 10);
  int64_t targets = 0;
  for (int d = 0; d < 5; ++d) {
    const int64_t b = s.side.starts[size_t(d)], len = s.side.starts[size_t(d + 1)] - b;
    for (int t = 0; t < 10; ++t) {
      const size_t i = size_t(d * 10 + t);
      CHECK(g.pos[i] == (t < len ? t : t - len));
      if (t >= len) {
        CHECK(g.tg[i] == kIgnoreTarget);
        continue;
      }
      CHECK(g.in[i] == s.tokens[size_t(b + t)]);
      const bool target = t + 1 < len && s.side.mask[size_t(b + t + 1)];
      CHECK(g.tg[i] == (target ? int32_t(s.tokens[size_t(b + t + 1)]) : kIgnoreTarget));
      targets += target;
    }
  }
  CHECK(g.b.targets == targets);
  CHECK(g.b.targets == l.targets());
  CHECK(g.b.tokens == int64_t(s.tokens.size()));
  // evaluation past the end: empty rows
  const Got e = get(l, 1, 5, 10);
  CHECK(e.b.targets == 0);
  CHECK(std::all_of(e.tg.begin(), e.tg.end(), [](int32_t v) { return v == kIgnoreTarget; }));
}

TEST_CASE("sft loader: packing fills rows best-fit decreasing with whole examples - each once per epoch") {
  const SftSplit s = make_sft_split(40, 2, 15, 2);
  SftLoaderOptions o;
  o.batch = 1, o.seq_len = 16, o.packing = true, o.seed = 3;
  SftLoader l({split_file("packed", s)}, 256, o);
  // the lower bound of rows: the tokens over 16, rounded up; best-fit decreasing stays close to it
  const int64_t bound = (int64_t(s.tokens.size()) + 15) / 16;
  MESSAGE("40 examples, " << s.tokens.size() << " tokens: " << l.rows() << " packed rows of 16 (at least " << bound
                          << "; 40 unpacked)");
  CHECK(l.rows() >= bound);
  CHECK(l.rows() <= bound + bound / 5 + 1);
  // an epoch holds every example exactly once, each whole and starting at position 0
  std::multiset<std::vector<int32_t>> seen, want;
  for (int d = 0; d < 40; ++d)
    want.insert(std::vector<int32_t>(s.tokens.begin() + s.side.starts[size_t(d)],
                                     s.tokens.begin() + s.side.starts[size_t(d + 1)]));
  int64_t targets = 0, tokens = 0;
  for (int64_t k = 0; k < l.rows(); ++k) {
    const Got g = get(l, uint64_t(k), 1, 16);
    targets += g.b.targets, tokens += g.b.tokens;
    int used = 0;
    for (auto [start, len] : docs_of(g, 0, 16))
      if (start < g.b.tokens) {
        seen.insert(std::vector<int32_t>(g.in.begin() + start, g.in.begin() + start + len));
        used += len;
        CHECK(g.tg[size_t(start + len - 1)] == kIgnoreTarget);  // a document's last token predicts nothing
      }
    CHECK(used == g.b.tokens);
  }
  CHECK(seen == want);
  CHECK(targets == l.targets());
  CHECK(tokens == int64_t(s.tokens.size()));
  // totals() counts without making the rows; the next epoch is another order of the same rows
  CHECK(l.totals(0, uint64_t(l.rows())).targets == targets);
  std::vector<int32_t> e0, e1;
  for (int64_t k = 0; k < l.rows(); ++k) {
    const Got a = get(l, uint64_t(k), 1, 16), b = get(l, uint64_t(l.rows() + k), 1, 16);
    e0.insert(e0.end(), a.in.begin(), a.in.end());
    e1.insert(e1.end(), b.in.begin(), b.in.end());
  }
  CHECK(e0 != e1);
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  CHECK(e0 == e1);
  // the same seed, the same batches; another seed, another order
  SftLoader again({kWork + "/packed/train_000000.bin"}, 256, o);
  CHECK(get(again, 7, 1, 16).in == get(l, 7, 1, 16).in);
  o.seed = 4;
  SftLoader other({kWork + "/packed/train_000000.bin"}, 256, o);
  bool differs = false;
  for (uint64_t k = 0; k < 5; ++k) differs |= get(other, k, 1, 16).in != get(l, k, 1, 16).in;
  CHECK(differs);
}

TEST_CASE("sft loader: an example longer than a sequence is refused - split or truncated") {
  SftSplit s = make_sft_split(3, 4, 4, 5);
  // a fourth document of 11 tokens, all targets
  for (int i = 0; i < 11; ++i) s.tokens.push_back(uint16_t(40 + i)), s.side.mask.push_back(1);
  s.side.starts.push_back(uint32_t(s.tokens.size()));
  const std::string f = split_file("long", s);
  SftLoaderOptions o;
  o.batch = 1, o.seq_len = 5, o.shuffle = false, o.refusal = " (the hint)";
  try {
    SftLoader l({f}, 256, o);
    FAIL("a document longer than the sequence was accepted");
  } catch (const UserError& e) {
    const std::string m = e.what();
    CHECK(m.find("train_000000.bin: document 3 (11 tokens) is longer than a sequence of 5 tokens (the hint)") !=
          std::string::npos);
  }
  o.overflow = SftOverflow::Split;
  SftLoader split({f}, 256, o);
  CHECK(split.examples() == 6);  // 3 + pieces of 5, 5, 1
  Got p = get(split, 3, 1, 5);
  CHECK(p.in == std::vector<int32_t>{40, 41, 42, 43, 44});
  CHECK(p.tg == std::vector<int32_t>{41, 42, 43, 44, 45});  // the last target is the next piece's first
  CHECK(p.pos == std::vector<int32_t>{0, 1, 2, 3, 4});
  p = get(split, 5, 1, 5);
  CHECK(p.in[0] == 50);
  CHECK(p.tg[0] == kIgnoreTarget);
  o.overflow = SftOverflow::Truncate;
  SftLoader cut({f}, 256, o);
  CHECK(cut.examples() == 4);
  p = get(cut, 3, 1, 5);
  CHECK(p.in == std::vector<int32_t>{40, 41, 42, 43, 44});
  CHECK(p.tg == std::vector<int32_t>{41, 42, 43, 44, kIgnoreTarget});
}

TEST_CASE("sft loader: a shard without its side file is refused naming it") {
  const SftSplit s = make_sft_split(2, 3, 4, 6);
  const std::string f = split_file("noside", s);
  std::filesystem::remove(sft_side_path(f));
  SftLoaderOptions o;
  o.seq_len = 8;
  CHECK_THROWS_WITH_AS(SftLoader({f}, 256, o), doctest::Contains("train_000000.sft: cannot open"), UserError);
}

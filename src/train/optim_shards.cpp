#include "train/optim_shards.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "core/error.h"

namespace dtrain {

namespace {

const char* kPrefix = "optim-";
const char* kSuffix = ".safetensors";

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

int64_t meta_int(const SafetensorsReader& r, const std::string& key) {
  auto it = r.metadata().find(key);
  if (it == r.metadata().end()) user_error("{}: __metadata__ has no '{}' (not an optimizer shard of dtrain?)", r.path(), key);
  int64_t v = -1;
  const std::string& s = it->second;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < 0)
    user_error("{}: __metadata__ '{}' = '{}': expected a non-negative integer", r.path(), key, s);
  return v;
}

std::string meta_str(const SafetensorsReader& r, const std::string& key) {
  auto it = r.metadata().find(key);
  return it == r.metadata().end() ? "" : it->second;
}

}  // namespace

uint64_t write_exported(const std::string& path, const std::vector<ParamStore::Exported>& ex,
                        const std::map<std::string, std::string>& meta) {
  std::vector<StTensor> ts;
  uint64_t bytes = 0;
  for (const auto& e : ex) {
    ts.push_back(StTensor{e.name, e.dtype, e.shape, e.bytes.data(), e.bytes.size()});
    bytes += e.bytes.size();
  }
  write_safetensors(path, ts, meta);
  return bytes;
}

std::string optim_shard_name(int index, int count) {
  DTRAIN_CHECK(count >= 1 && index >= 0 && index < count, "optimizer shard {} of {}", index, count);
  return fmt::format("{}{:05d}-of-{:05d}{}", kPrefix, index, count, kSuffix);
}

bool parse_optim_shard_name(const std::string& name, int* index, int* count) {
  const std::string pre = kPrefix, suf = kSuffix;
  if (name.size() <= pre.size() + suf.size() || name.compare(0, pre.size(), pre) != 0 ||
      name.compare(name.size() - suf.size(), suf.size(), suf) != 0)
    return false;
  const std::string mid = name.substr(pre.size(), name.size() - pre.size() - suf.size());
  const size_t of = mid.find("-of-");
  if (of == std::string::npos) return false;
  const std::string a = mid.substr(0, of), b = mid.substr(of + 4);
  if (!all_digits(a) || !all_digits(b) || a.size() < 5 || b.size() < 5 || a.size() > 9 || b.size() > 9) return false;
  const int i = std::stoi(a), n = std::stoi(b);
  if (n < 1 || i >= n) return false;
  *index = i;
  *count = n;
  return true;
}

// "b0:e0,b1:e1,..." of __metadata__ "ranges"
static std::vector<std::pair<int64_t, int64_t>> parse_ranges(const std::string& path, const std::string& text) {
  std::vector<std::pair<int64_t, int64_t>> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const size_t colon = item.find(':');
    int64_t b = -1, e = -1;
    try {
      size_t nb = 0, ne = 0;
      if (colon != std::string::npos) {
        b = std::stoll(item.substr(0, colon), &nb);
        e = std::stoll(item.substr(colon + 1), &ne);
      }
      if (colon == std::string::npos || nb != colon || ne != item.size() - colon - 1) b = -1;
    } catch (const std::exception&) {
      b = -1;
    }
    if (b < 0 || e < b) user_error("{}: __metadata__ 'ranges': '{}' is not begin:end", path, item);
    out.push_back({b, e});
    at = comma + 1;
  }
  return out;
}

namespace {

uint64_t write_optim_file(const std::string& kind, const std::vector<ParamStore::Exported>& ex,
                          const std::vector<FlatPiece>& pieces, int64_t num_params, const std::string& layout,
                          int64_t step, const std::string& dir, int index, int count, int64_t b, int64_t e) {
  std::map<std::string, std::string> meta = {
      {"format", "pt"},
      {"producer", "dtrain " DTRAIN_VERSION},
      {"step", std::to_string(step)},
      {"optimizer", kind},
      {"shard_index", std::to_string(index)},
      {"shard_count", std::to_string(count)},
      {"range_begin", std::to_string(b)},
      {"range_end", std::to_string(e)},
      {"num_params", std::to_string(num_params)},
      {"param_layout", layout},
  };
  if (pieces.size() > 1) {
    std::string r;
    for (const FlatPiece& p : pieces)
      r += fmt::format("{}{}:{}", r.empty() ? "" : ",", p.global, p.global + p.count);
    meta["ranges"] = r;
  }
  return write_exported(dir + "/" + optim_shard_name(index, count), ex, meta);
}

}  // namespace

uint64_t write_optim_shard(const Optimizer& opt, const ParamStore& ps, int64_t step, const std::string& dir,
                           int index, int count) {
  const std::vector<FlatPiece>& pieces = opt.pieces();
  // no piece (a shard with nothing to own): the empty range [b, b)
  const int64_t b = pieces.empty() ? opt.range_begin() : pieces.front().global;
  const int64_t e = pieces.empty() ? b : pieces.back().global + pieces.back().count;
  DTRAIN_CHECK(count > 1 || (b == 0 && e == ps.num_params() && opt.owned() == ps.num_params()),
               "a single optimizer file must hold the full range");
  return write_optim_file(opt.kind(), opt.export_state(), pieces, ps.num_params(), ps.layout_hash(), step, dir, index,
                          count, b, e);
}

uint64_t write_optim_universal(const std::string& kind, const std::vector<ParamStore::Exported>& states,
                               const ParamStore& ps, int64_t step, const std::string& dir) {
  const int64_t n = ps.universal_num_params();
  return write_optim_file(kind, states, {FlatPiece{0, 0, n}}, n, ps.layout_hash(), step, dir, 0, 1, 0, n);
}


std::string powersgd_state_name(int rank, int world) {
  return fmt::format("powersgd-{:05d}-of-{:05d}.safetensors", rank, world);
}

uint64_t write_powersgd_state(const std::vector<ParamStore::Exported>& state, int64_t step, const std::string& dir,
                              int rank, int world) {
  const std::map<std::string, std::string> meta = {{"format", "pt"},
                                                   {"producer", "dtrain " DTRAIN_VERSION},
                                                   {"step", std::to_string(step)},
                                                   {"rank", std::to_string(rank)},
                                                   {"world_size", std::to_string(world)}};
  return write_exported(dir + "/" + powersgd_state_name(rank, world), state, meta);
}

std::string read_powersgd_state(const std::string& dir, int rank, int world,
                                const std::function<bool(const TensorLookup&)>& load) {
  const std::string path = dir + "/" + powersgd_state_name(rank, world);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return fmt::format("no {} in the checkpoint", powersgd_state_name(rank, world));
  SafetensorsReader r(path);
  std::map<std::string, std::vector<uint8_t>> held;
  TensorLookup lookup = [&](const std::string& name) -> std::optional<ImportTensor> {
    if (!r.has(name)) return std::nullopt;
    auto [it, fresh] = held.try_emplace(name);
    if (fresh) {
      it->second.resize(r.nbytes(name));
      r.read(name, it->second.data(), it->second.size());
    }
    return ImportTensor{r.dtype(name), r.shape(name), it->second.data(), it->second.size()};
  };
  if (!load(lookup)) return fmt::format("{} does not fit this run's gradient buckets", path);
  return "";
}

OptimShards::~OptimShards() = default;

std::string OptimShards::origin() const {
  return fmt::format("{}/{}*-of-{:05d}{}", dir_, kPrefix, count(), kSuffix);
}

OptimShards::OptimShards(const std::string& dir, int expected_count) : dir_(dir) {
  // 1. names: every optim-* file must be a shard name, all with the same count
  std::map<int, std::string> found;  // index -> name
  int count = -1;
  std::string count_from;
  std::vector<std::string> listed;  // sorted, so that messages do not depend on the listing order
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kPrefix, 0) == 0) listed.push_back(name);
  }
  if (ec) fault("cannot list {}: {}", dir, ec.message());
  std::sort(listed.begin(), listed.end());
  for (const std::string& name : listed) {
    int i = 0, n = 0;
    if (!parse_optim_shard_name(name, &i, &n))
      user_error("{}/{}: not an optimizer shard name (expected optim-<index>-of-<count>.safetensors)", dir, name);
    if (count >= 0 && n != count)
      user_error("{}/{}: belongs to a set of {} shards but {} belongs to a set of {}", dir, name, n, count_from, count);
    if (count < 0) count_from = name;
    count = n;
    found[i] = name;
  }
  if (count < 0) {
    if (expected_count > 0)
      user_error("{}/{}: missing (shard 0 of {})", dir, optim_shard_name(0, expected_count), expected_count);
    return;
  }
  if (expected_count > 0 && count != expected_count)
    user_error("{}/{}: belongs to a set of {} shards but state.json announces {}", dir, count_from, count,
               expected_count);
  for (int i = 0; i < count; ++i)
    if (!found.count(i)) user_error("{}/{}: missing (shard {} of {})", dir, optim_shard_name(i, count), i, count);

  // 2. every file's header and metadata, compared with shard 0's
  for (int i = 0; i < count; ++i) {
    const std::string path = dir + "/" + found[i];
    readers_.push_back(std::make_unique<SafetensorsReader>(path));
    const SafetensorsReader& r = *readers_.back();
    OptimShardInfo info{found[i], i, 0, 0, {}};
    std::string kind = meta_str(r, "optimizer");
    if (kind.empty()) user_error("{}: __metadata__ has no 'optimizer' (not an optimizer state file of dtrain?)", path);
    int64_t total = 0;
    std::vector<std::string> names;
    for (const auto& n : r.names())
      if (n != "step") names.push_back(n);
    if (r.metadata().count("shard_count")) {
      if (meta_int(r, "shard_index") != i || meta_int(r, "shard_count") != count)
        user_error("{}: __metadata__ says shard {} of {}, the file name says {} of {}", path, meta_str(r, "shard_index"),
                   meta_str(r, "shard_count"), i, count);
      info.begin = meta_int(r, "range_begin");
      info.end = meta_int(r, "range_end");
      total = meta_int(r, "num_params");
      if (r.metadata().count("ranges"))
        info.ranges = parse_ranges(path, meta_str(r, "ranges"));
      else
        info.ranges = {{info.begin, info.end}};
      for (auto [b, e] : info.ranges)
        if (b < 0 || b > e || e > total) user_error("{}: range [{}, {}) is not inside [0, {})", path, b, e, total);
    } else {
      // written before shards existed: one file with the full state
      if (count != 1) user_error("{}: __metadata__ has no 'shard_count' (expected in a set of {} shards)", path, count);
      if (names.empty()) user_error("{}: __metadata__ has no 'num_params' and no state tensor gives it", path);
      auto sh = r.shape(names.front());
      if (sh.size() != 1) user_error("{}: tensor '{}': expected F32 [n], got {} dims", path, names.front(), sh.size());
      total = info.end = sh[0];
      info.ranges = {{0, total}};
    }
    const std::string layout = meta_str(r, "param_layout");
    if (i == 0) {
      kind_ = kind;
      num_params_ = total;
      layout_ = layout;
      names_ = names;
    } else {
      const std::string& first = shards_.front().file;
      if (kind != kind_) user_error("{}: optimizer '{}' but {} holds '{}'", path, kind, first, kind_);
      if (total != num_params_) user_error("{}: num_params {} but {} says {}", path, total, first, num_params_);
      if (layout != layout_)
        user_error("{}: param_layout {} but {} says {} (shards of different models)", path, layout.substr(0, 12), first,
                   layout_.substr(0, 12));
      if (names != names_)
        user_error("{}: holds other state tensors than {} ({} vs {})", path, first, names.size(), names_.size());
    }
    int64_t elems = 0;
    for (auto [b, e] : info.ranges) elems += e - b;
    for (const auto& n : names) {
      const std::vector<int64_t> want{elems};
      if (r.dtype(n) != "F32" || r.shape(n) != want)
        user_error("{}: tensor '{}': expected F32 [{}] for range [{}, {}), got {} with {} dims", path, n, want[0],
                   info.begin, info.end, r.dtype(n), r.shape(n).size());
    }
    if (!r.has("step") || r.dtype("step") != "I64" || !r.shape("step").empty())
      user_error("{}: tensor 'step': expected an I64 scalar", path);
    int64_t step = 0;
    r.read("step", &step, 8);
    if (step < 0) user_error("{}: tensor 'step': expected >= 0, got {}", path, step);
    if (i == 0)
      step_ = step;
    else if (step != step_)
      user_error("{}: optimizer step {} but {} holds {}", path, step, shards_.front().file, step_);
    shards_.push_back(info);
  }
  // 3. the ranges of all files tile [0, num_params)
  struct R { int64_t b, e; size_t file; };
  std::vector<R> all;
  for (size_t i = 0; i < shards_.size(); ++i)
    for (auto [b, e] : shards_[i].ranges)
      if (e > b || shards_[i].ranges.size() == 1) all.push_back({b, e, i});
  std::stable_sort(all.begin(), all.end(), [](const R& x, const R& y) { return x.b < y.b; });
  int64_t at = 0;
  for (size_t k = 0; k < all.size(); ++k) {
    const R& x = all[k];
    const std::string path = dir + "/" + shards_[x.file].file;
    if (k == 0 && x.b != 0) user_error("{}: range [{}, {}) does not start at 0", path, x.b, x.e);
    if (k > 0 && x.b != at) {
      const R& p = all[k - 1];
      user_error("{}: range [{}, {}) does not continue {}'s [{}, {}) ({})", path, x.b, x.e, shards_[p.file].file,
                 p.b, p.e, x.b < at ? "overlap" : "gap");
    }
    at = x.e;
  }
  if (at != num_params_)
    user_error("{}/{}: range ends at {} but num_params is {} (the shards do not cover the state)", dir,
               shards_[all.empty() ? 0 : all.back().file].file, at, num_params_);
}

std::vector<uint8_t> OptimShards::read(const std::string& name, int64_t b, int64_t e) const {
  DTRAIN_CHECK(0 <= b && b <= e && e <= num_params_, "optimizer range [{}, {}) of {}", b, e, num_params_);
  DTRAIN_CHECK(std::find(names_.begin(), names_.end(), name) != names_.end(), "no optimizer state '{}'", name);
  std::vector<uint8_t> out(size_t(e - b) * 4);
  for (size_t i = 0; i < shards_.size(); ++i) {
    int64_t in_file = 0;  // elements of the file's earlier ranges
    for (auto [rb, re] : shards_[i].ranges) {
      const int64_t lo = std::max(b, rb), hi = std::min(e, re);
      if (lo < hi)
        readers_[i]->read_range(name, uint64_t(in_file + lo - rb) * 4, out.data() + (lo - b) * 4,
                                size_t(hi - lo) * 4);
      in_file += re - rb;
    }
  }
  return out;
}

std::string optim_shards_problem(const std::string& dir, int expected_count) {
  try {
    OptimShards s(dir, expected_count);
  } catch (const Error& e) {
    std::string m = e.what();
    const std::string pre = dir + "/";
    if (m.rfind(pre, 0) == 0) m = m.substr(pre.size());
    return m;
  }
  return "";
}

}  // namespace dtrain

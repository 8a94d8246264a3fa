#include "checkpoint/flat_shards.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "core/error.h"

namespace dtrain {

namespace {

const char* kSuffix = ".safetensors";
const char* prefix(FlatKind k) { return k == FlatKind::Model ? "model-" : "optim-"; }
const char* what(FlatKind k) { return k == FlatKind::Model ? "model" : "optimizer"; }

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

int64_t meta_int(const SafetensorsReader& r, const std::string& key) {
  auto it = r.metadata().find(key);
  if (it == r.metadata().end()) user_error("{}: __metadata__ has no '{}' (not a shard file of dtrain?)", r.path(), key);
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

std::string flat_shard_name(FlatKind kind, int index, int count) {
  DTRAIN_CHECK(count >= 1 && index >= 0 && index < count, "{} shard {} of {}", what(kind), index, count);
  return fmt::format("{}{:05d}-of-{:05d}{}", prefix(kind), index, count, kSuffix);
}

bool parse_flat_shard_name(FlatKind kind, const std::string& name, int* index, int* count) {
  const std::string pre = prefix(kind), suf = kSuffix;
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

// `optimizer`: the optimizer's kind, "" for a model file
uint64_t write_flat_file(FlatKind what, const std::string& optimizer, const std::vector<ParamStore::Exported>& ex,
                         const std::vector<FlatPiece>& pieces, int64_t num_params, const std::string& layout,
                         int64_t step, const std::string& dir, int index, int count, int64_t b, int64_t e) {
  std::map<std::string, std::string> meta = {
      {"format", "pt"},
      {"producer", "dtrain " DTRAIN_VERSION},
      {"step", std::to_string(step)},
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
  if (what == FlatKind::Optimizer) meta["optimizer"] = optimizer;
  return write_exported(dir + "/" + flat_shard_name(what, index, count), ex, meta);
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
  return write_flat_file(FlatKind::Optimizer, opt.kind(), opt.export_state(), pieces, ps.num_params(),
                         ps.layout_hash(), step, dir, index, count, b, e);
}

uint64_t write_optim_universal(const std::string& kind, const std::vector<ParamStore::Exported>& states,
                               const ParamStore& ps, int64_t step, const std::string& dir) {
  const int64_t n = ps.universal_num_params();
  return write_flat_file(FlatKind::Optimizer, kind, states, {FlatPiece{0, 0, n}}, n, ps.layout_hash(), step, dir, 0,
                         1, 0, n);
}

uint64_t write_model_shard(const ParamStore& ps, int64_t step, const std::string& dir, int index, int count) {
  DTRAIN_CHECK(ps.sharded() && ps.shard_world() == count && ps.shard_rank() == index,
               "write_model_shard: shard {} of {} from a store sharded as {} of {}", index, count, ps.shard_rank(),
               ps.shard_world());
  const std::vector<FlatPiece> pieces = ps.shard_pieces();
  const std::vector<float> values = ps.shard_values();
  std::vector<ParamStore::Exported> ex{
      {"params", "F32", {int64_t(values.size())}, std::vector<uint8_t>(values.size() * 4)}};
  if (!values.empty()) std::memcpy(ex[0].bytes.data(), values.data(), values.size() * 4);
  if (index == 0)
    for (ParamStore::Exported& x : ps.export_buffers()) ex.push_back(std::move(x));
  // no piece (units too small to give this rank any element): the empty range at the end
  const int64_t b = pieces.empty() ? ps.num_params() : pieces.front().global;
  const int64_t e = pieces.empty() ? b : pieces.back().global + pieces.back().count;
  return write_flat_file(FlatKind::Model, "", ex, pieces, ps.num_params(), ps.layout_hash(), step, dir, index, count,
                         b, e);
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

FlatShards::~FlatShards() = default;

std::string FlatShards::origin() const {
  return fmt::format("{}/{}*-of-{:05d}{}", dir_, prefix(what_), count(), kSuffix);
}

FlatShards::FlatShards(const std::string& dir, FlatKind kind, int expected_count) : dir_(dir), what_(kind) {
  const char* pre = prefix(kind);
  // 1. names: every file of the kind's prefix must be a shard name, all with the same count
  std::map<int, std::string> found;  // index -> name
  int count = -1;
  std::string count_from;
  std::vector<std::string> listed;  // sorted, so that messages do not depend on the listing order
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(pre, 0) == 0) listed.push_back(name);
  }
  if (ec) fault("cannot list {}: {}", dir, ec.message());
  std::sort(listed.begin(), listed.end());
  for (const std::string& name : listed) {
    int i = 0, n = 0;
    if (!parse_flat_shard_name(kind, name, &i, &n))
      user_error("{}/{}: not {} {} shard name (expected {}<index>-of-<count>.safetensors)", dir, name,
                 kind == FlatKind::Model ? "a" : "an", what(kind), pre);
    if (count >= 0 && n != count)
      user_error("{}/{}: belongs to a set of {} shards but {} belongs to a set of {}", dir, name, n, count_from, count);
    if (count < 0) count_from = name;
    count = n;
    found[i] = name;
  }
  if (count < 0) {
    if (expected_count > 0)
      user_error("{}/{}: missing (shard 0 of {})", dir, flat_shard_name(kind, 0, expected_count), expected_count);
    return;
  }
  if (expected_count > 0 && count != expected_count)
    user_error("{}/{}: belongs to a set of {} shards but state.json announces {}", dir, count_from, count,
               expected_count);
  for (int i = 0; i < count; ++i)
    if (!found.count(i)) user_error("{}/{}: missing (shard {} of {})", dir, flat_shard_name(kind, i, count), i, count);

  // 2. every file's header and metadata, compared with shard 0's
  for (int i = 0; i < count; ++i) {
    const std::string path = dir + "/" + found[i];
    readers_.push_back(std::make_unique<SafetensorsReader>(path));
    const SafetensorsReader& r = *readers_.back();
    FlatShardInfo info{found[i], i, 0, 0, {}};
    std::string optimizer;
    if (kind == FlatKind::Optimizer) {
      optimizer = meta_str(r, "optimizer");
      if (optimizer.empty())
        user_error("{}: __metadata__ has no 'optimizer' (not an optimizer state file of dtrain?)", path);
    }
    int64_t total = 0;
    std::vector<std::string> names;  // the flat tensors
    if (kind == FlatKind::Optimizer) {
      for (const auto& n : r.names())
        if (n != "step") names.push_back(n);
    } else {
      if (!r.has("params")) user_error("{}: no tensor 'params' (not a model shard of dtrain?)", path);
      names = {"params"};
      if (i > 0)
        for (const auto& n : r.names())
          if (n != "params")
            user_error("{}: tensor '{}' beside the parameters (only shard 0 holds the buffers)", path, n);
    }
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
    } else if (kind == FlatKind::Optimizer) {
      // written before shards existed: one file with the full state
      if (count != 1) user_error("{}: __metadata__ has no 'shard_count' (expected in a set of {} shards)", path, count);
      if (names.empty()) user_error("{}: __metadata__ has no 'num_params' and no state tensor gives it", path);
      auto sh = r.shape(names.front());
      if (sh.size() != 1) user_error("{}: tensor '{}': expected F32 [n], got {} dims", path, names.front(), sh.size());
      total = info.end = sh[0];
      info.ranges = {{0, total}};
    } else {
      user_error("{}: __metadata__ has no 'shard_count' (not a model shard of dtrain?)", path);
    }
    const std::string layout = meta_str(r, "param_layout");
    if (i == 0) {
      kind_ = optimizer;
      num_params_ = total;
      layout_ = layout;
      names_ = names;
    } else {
      const std::string& first = shards_.front().file;
      if (optimizer != kind_) user_error("{}: optimizer '{}' but {} holds '{}'", path, optimizer, first, kind_);
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
    int64_t step = 0;
    if (kind == FlatKind::Optimizer) {
      if (!r.has("step") || r.dtype("step") != "I64" || !r.shape("step").empty())
        user_error("{}: tensor 'step': expected an I64 scalar", path);
      r.read("step", &step, 8);
      if (step < 0) user_error("{}: tensor 'step': expected >= 0, got {}", path, step);
    } else {
      step = meta_int(r, "step");
    }
    if (i == 0)
      step_ = step;
    else if (step != step_)
      user_error("{}: {} step {} but {} holds {}", path, what(kind), step, shards_.front().file, step_);
    shards_.push_back(info);
  }
  // 3. the ranges of all files tile [0, num_params)
  struct R { int64_t b, e; size_t file; };
  std::vector<R> all;
  for (size_t i = 0; i < shards_.size(); ++i)
    for (auto [b, e] : shards_[i].ranges)
      if (e > b) all.push_back({b, e, i});  // an empty range (a rank that owns nothing) is nowhere
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

std::vector<uint8_t> FlatShards::read(const std::string& name, int64_t b, int64_t e) const {
  std::vector<uint8_t> out(size_t(std::max<int64_t>(e - b, 0)) * 4);
  read_into(name, b, e, reinterpret_cast<float*>(out.data()));
  return out;
}

void FlatShards::read_into(const std::string& name, int64_t b, int64_t e, float* dst) const {
  DTRAIN_CHECK(0 <= b && b <= e && e <= num_params_, "{} range [{}, {}) of {}", what(what_), b, e, num_params_);
  DTRAIN_CHECK(std::find(names_.begin(), names_.end(), name) != names_.end(), "no {} state '{}'", what(what_), name);
  for (size_t i = 0; i < shards_.size(); ++i) {
    int64_t in_file = 0;  // elements of the file's earlier ranges
    for (auto [rb, re] : shards_[i].ranges) {
      const int64_t lo = std::max(b, rb), hi = std::min(e, re);
      if (lo < hi) readers_[i]->read_range(name, uint64_t(in_file + lo - rb) * 4, dst + (lo - b), size_t(hi - lo) * 4);
      in_file += re - rb;
    }
  }
}

std::string flat_shards_problem(const std::string& dir, FlatKind kind, int expected_count) {
  try {
    FlatShards s(dir, kind, expected_count);
  } catch (const Error& e) {
    std::string m = e.what();
    const std::string pre = dir + "/";
    if (m.rfind(pre, 0) == 0) m = m.substr(pre.size());
    return m;
  }
  return "";
}

}  // namespace dtrain

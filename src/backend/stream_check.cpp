#include "backend/stream_check.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/log.h"

namespace dtrain {

StreamCheckMode stream_check_mode() {
  const char* v = std::getenv("DTRAIN_STREAM_CHECK");
  if (!v || !*v || std::strcmp(v, "0") == 0) return StreamCheckMode::Off;
  if (std::strcmp(v, "1") == 0) return StreamCheckMode::Stop;
  if (std::strcmp(v, "report") == 0) return StreamCheckMode::Report;
  user_error("environment variable DTRAIN_STREAM_CHECK={}: expected 0, 1 or report", v);
}

StreamChecker::StreamChecker(bool report) : report_(report) {
  names_.push_back("host");
  clock_.push_back({0});
}

StreamChecker::StreamId StreamChecker::add_stream(const std::string& name) {
  std::lock_guard<std::mutex> g(mu_);
  // a new stream starts after what the host has issued and learned so far (cudaStreamCreate
  // happens in host order)
  std::vector<uint64_t> c = clock_[kHost];
  names_.push_back(name);
  c.resize(names_.size(), 0);
  clock_.push_back(std::move(c));
  return StreamId(names_.size() - 1);
}

const std::string& StreamChecker::stream_name(StreamId s) const {
  std::lock_guard<std::mutex> g(mu_);
  return names_.at(size_t(s));
}

uint64_t StreamChecker::issued() const {
  std::lock_guard<std::mutex> g(mu_);
  return issued_;
}

uint64_t StreamChecker::races() const {
  std::lock_guard<std::mutex> g(mu_);
  return races_;
}

namespace {

void merge(std::vector<uint64_t>& into, const std::vector<uint64_t>& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

}  // namespace

StreamChecker::Mark StreamChecker::record(StreamId s) const {
  std::lock_guard<std::mutex> g(mu_);
  return Mark{clock_.at(size_t(s))};
}

void StreamChecker::wait(StreamId waiter, const Mark& m) {
  std::lock_guard<std::mutex> g(mu_);
  merge(clock_.at(size_t(waiter)), m.clock);
}

bool StreamChecker::ordered(StreamId s, const Acc& a) const {
  if (a.stream < 0 || a.stream == s) return true;
  const auto& c = clock_[size_t(s)];
  return size_t(a.stream) < c.size() && c[size_t(a.stream)] >= a.seq;
}

void StreamChecker::split_at(uintptr_t at) {
  auto it = segs_.upper_bound(at);
  if (it == segs_.begin()) return;
  --it;
  if (it->first == at || it->second.end <= at) return;
  Seg right = it->second;
  it->second.end = at;
  segs_.emplace(at, std::move(right));
}

StreamChecker::Mark StreamChecker::issue(StreamId s, const std::string& op, const std::vector<MemAccess>& acc) {
  std::lock_guard<std::mutex> g(mu_);
  auto& c = clock_.at(size_t(s));
  if (s != kHost) merge(c, clock_[kHost]);  // the host issues it: what the host knows is done, is done
  if (c.size() <= size_t(s)) c.resize(size_t(s) + 1, 0);
  const uint64_t seq = ++c[size_t(s)];
  ++issued_;
  auto name = std::make_shared<const std::string>(op);
  const Acc me{s, seq, name};
  // reads first, then writes: an op that reads and writes the same bytes (in place) is one
  // write for the ordering
  for (int pass = 0; pass < 2; ++pass)
    for (const MemAccess& a : acc) {
      if (!a.ptr || a.bytes == 0 || a.write != (pass == 1)) continue;
      const uintptr_t lo = reinterpret_cast<uintptr_t>(a.ptr), hi = lo + a.bytes;
      split_at(lo);
      split_at(hi);
      // fill the gaps of [lo, hi) with fresh segments
      uintptr_t at = lo;
      auto it = segs_.lower_bound(lo);
      while (at < hi) {
        if (it == segs_.end() || it->first > at) {
          const uintptr_t end = it == segs_.end() ? hi : std::min(hi, it->first);
          it = segs_.emplace_hint(it, at, Seg{end, {}, {}});
        }
        at = it->second.end;
        ++it;
      }
      for (it = segs_.lower_bound(lo); it != segs_.end() && it->first < hi; ++it) {
        Seg& sg = it->second;
        if (!ordered(s, sg.write))
          race(a.write ? "writes" : "reads", "writing", s, seq, op, sg.write, it->first, sg.end);
        if (a.write) {
          for (const Acc& r : sg.reads)
            if (!ordered(s, r)) race("writes", "reading", s, seq, op, r, it->first, sg.end);
          sg.write = me;
          sg.reads.clear();
        } else {
          auto r = std::find_if(sg.reads.begin(), sg.reads.end(), [&](const Acc& x) { return x.stream == s; });
          if (r != sg.reads.end()) *r = me;
          else sg.reads.push_back(me);
        }
      }
      if (a.write) {  // one segment for the whole write (its history is now one access)
        auto first = segs_.find(lo);
        auto last = segs_.lower_bound(hi);
        first->second.end = hi;
        segs_.erase(std::next(first), last);
      }
    }
  return Mark{c};
}

void StreamChecker::name(const void* p, size_t n, const std::string& label) {
  std::lock_guard<std::mutex> g(mu_);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  auto [b, e] = labels_.equal_range(lo);
  for (auto it = b; it != e; ++it)
    if (it->second.end == lo + n) {
      it->second.label = label;
      return;
    }
  labels_.emplace(lo, Named{lo + n, label});
}

void StreamChecker::forget(const void* p, size_t n) {
  std::lock_guard<std::mutex> g(mu_);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p), hi = lo + n;
  split_at(lo);
  split_at(hi);
  segs_.erase(segs_.lower_bound(lo), segs_.lower_bound(hi));
  for (auto it = labels_.lower_bound(lo); it != labels_.end() && it->first < hi;)
    it = it->second.end <= hi ? labels_.erase(it) : std::next(it);
}

std::string StreamChecker::describe(uintptr_t lo, uintptr_t hi) const {
  // the smallest named range holding lo
  const Named* best = nullptr;
  uintptr_t best_lo = 0;
  for (auto it = labels_.begin(); it != labels_.end() && it->first <= lo; ++it)
    if (it->second.end > lo && (!best || it->second.end - it->first < best->end - best_lo)) {
      best = &it->second;
      best_lo = it->first;
    }
  const size_t n = size_t(hi - lo);
  if (!best) return fmt::format("{} bytes at 0x{:x} (unnamed)", n, lo);
  return fmt::format("{} (bytes {}-{} of it)", best->label, lo - best_lo, lo - best_lo + n);
}

void StreamChecker::race(const char* verb, const char* other_verb, StreamId s, uint64_t seq, const std::string& op,
                         const Acc& other, uintptr_t lo, uintptr_t hi) {
  const std::string where = describe(lo, hi);
  const std::string msg = fmt::format(
      "stream-order race on {}: {} (op {} on stream '{}') {} it while {} (op {} on stream '{}') may still be {} it: "
      "no event, wait or synchronisation orders the two (DTRAIN_STREAM_CHECK)",
      where, op, seq, names_[size_t(s)], verb, *other.op, other.seq, names_[size_t(other.stream)], other_verb);
  if (!report_) fault("{}", msg);
  ++races_;
  const std::string key = fmt::format("{}|{}|{}|{}|{}|{}", op, names_[size_t(s)], verb, *other.op,
                                      names_[size_t(other.stream)], where.substr(0, where.find(" (bytes")));
  if (reported_.insert(key).second) log::warn("{}", msg);
}

}  // namespace dtrain

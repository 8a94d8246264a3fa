// ktrace: a CUPTI injection library that times every GPU kernel, memcpy and memset between
// cudaProfilerStart() and cudaProfilerStop() and prints one table per range: kernels grouped
// by name (count, total, mean, share of the range) and how long the GPU sat idle in the range.
// Works on any CUDA program without rebuilding it; dtrain bench and the PyTorch twins under
// scripts/bench/ bracket their timed steps with the profiler range (after a synchronize).
//
//   CUDA_INJECTION64_PATH=build/libdtrain_ktrace.so dtrain bench configs/bench/gpt2_124m.toml
//   DTRAIN_KTRACE_OUT=file   append the tables there instead of stderr
//   DTRAIN_KTRACE_TOP=N      rows per table (default 40)
//
// It is a developer tool (like nsys, which the GPU machine lacks), not part of dtrain.
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Rec {
  uint64_t start, end;
  std::string name;
};

std::mutex g_mu;
std::vector<Rec> g_recs;
uint64_t g_range_start = 0;
bool g_in_range = false;
int g_range_index = 0;

#define KT_CHECK(call)                                                              \
  do {                                                                              \
    CUptiResult r_ = (call);                                                        \
    if (r_ != CUPTI_SUCCESS) {                                                      \
      const char* s_ = nullptr;                                                     \
      cuptiGetResultString(r_, &s_);                                                \
      std::fprintf(stderr, "ktrace: %s failed: %s\n", #call, s_ ? s_ : "?");        \
    }                                                                               \
  } while (0)

std::string short_name(const char* mangled) {
  if (!mangled) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = (status == 0 && d) ? d : mangled;
  std::free(d);
  // drop the argument list (the last top-level parenthesis), keep template arguments, cap the length
  for (size_t p; (p = s.find("(anonymous namespace)::")) != std::string::npos;) s.erase(p, 23);
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    else if (s[i] == '>') --depth;
    else if (s[i] == '(' && depth == 0 && i > 0) { s.resize(i); break; }
  }
  if (s.rfind("void ", 0) == 0) s.erase(0, 5);
  if (s.size() > 110) s = s.substr(0, 107) + "...";
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
  *size = 8 << 20;
  *buf = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lk(g_mu);
  while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
        g_recs.push_back({k->start, k->end, short_name(k->name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
        static const char* kinds[] = {"?", "HtoD", "DtoH", "HtoA", "AtoH", "AtoA", "AtoD", "DtoA", "DtoD", "HtoH", "PtoP"};
        const unsigned k = m->copyKind < 11 ? m->copyKind : 0;
        g_recs.push_back({m->start, m->end, std::string("[memcpy ") + kinds[k] + "]"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
        g_recs.push_back({m->start, m->end, "[memset]"});
        break;
      }
      default:
        break;
    }
  }
  std::free(buf);
}

void report(uint64_t t0, uint64_t t1) {
  std::vector<Rec> in;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    for (auto& r : g_recs)
      if (r.start >= t0 && r.start < t1) in.push_back(r);
    g_recs.clear();
  }
  struct Agg {
    int64_t count = 0;
    uint64_t total = 0;
  };
  std::map<std::string, Agg> by;
  uint64_t sum = 0;
  for (auto& r : in) {
    auto& a = by[r.name];
    a.count++;
    a.total += r.end - r.start;
    sum += r.end - r.start;
  }
  // busy time: union of the intervals (kernels may overlap on several streams)
  std::sort(in.begin(), in.end(), [](const Rec& a, const Rec& b) { return a.start < b.start; });
  uint64_t busy = 0, cur_s = 0, cur_e = 0;
  for (auto& r : in) {
    if (r.start > cur_e) {
      busy += cur_e - cur_s;
      cur_s = r.start;
      cur_e = r.end;
    } else {
      cur_e = std::max(cur_e, r.end);
    }
  }
  busy += cur_e - cur_s;
  // the longest idle gaps, with the activities on either side (where the host held the GPU up)
  struct Gap {
    uint64_t len;
    size_t after;
  };
  std::vector<Gap> gaps;
  uint64_t reach = in.empty() ? 0 : in[0].end;
  for (size_t i = 1; i < in.size(); ++i) {
    if (in[i].start > reach) gaps.push_back({in[i].start - reach, i});
    reach = std::max(reach, in[i].end);
  }
  std::sort(gaps.begin(), gaps.end(), [](const Gap& a, const Gap& b) { return a.len > b.len; });
  uint64_t gap_sum = 0;
  for (auto& g : gaps) gap_sum += g.len;
  std::vector<std::pair<std::string, Agg>> rows(by.begin(), by.end());
  std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second.total > b.second.total; });
  const char* top_env = std::getenv("DTRAIN_KTRACE_TOP");
  size_t top = top_env ? std::strtoul(top_env, nullptr, 10) : 40;
  const char* path = std::getenv("DTRAIN_KTRACE_OUT");
  FILE* f = path ? std::fopen(path, "a") : stderr;
  if (!f) f = stderr;
  const double range_ms = (t1 - t0) * 1e-6;
  std::fprintf(f, "ktrace range %d: %.3f ms wall, GPU busy %.3f ms (%.1f%%), idle %.3f ms, %zu activities, kernel time sum %.3f ms\n",
               g_range_index, range_ms, busy * 1e-6, range_ms > 0 ? 100.0 * busy * 1e-6 / range_ms : 0.0,
               range_ms - busy * 1e-6, in.size(), sum * 1e-6);
  std::fprintf(f, "%9s %7s %10s %6s  %s\n", "total_ms", "count", "mean_us", "share", "name");
  for (size_t i = 0; i < rows.size() && i < top; ++i) {
    const auto& [name, a] = rows[i];
    std::fprintf(f, "%9.3f %7lld %10.2f %5.1f%%  %s\n", a.total * 1e-6, static_cast<long long>(a.count),
                 a.total * 1e-3 / double(a.count), range_ms > 0 ? 100.0 * a.total * 1e-6 / range_ms : 0.0, name.c_str());
  }
  if (rows.size() > top) std::fprintf(f, "... %zu more kernel names\n", rows.size() - top);
  std::fprintf(f, "idle gaps between activities: %zu, %.3f ms in all; the longest:\n", gaps.size(), gap_sum * 1e-6);
  for (size_t i = 0; i < gaps.size() && i < 12; ++i)
    std::fprintf(f, "  %8.1f us  after %s  before %s\n", gaps[i].len * 1e-3, in[gaps[i].after - 1].name.c_str(),
                 in[gaps[i].after].name.c_str());
  // gaps by size class: many short ones mean launch-bound stretches, few long ones host waits
  uint64_t cls[4] = {0, 0, 0, 0};
  int64_t cnt[4] = {0, 0, 0, 0};
  for (auto& g : gaps) {
    const int c = g.len < 5000 ? 0 : g.len < 20000 ? 1 : g.len < 100000 ? 2 : 3;
    cls[c] += g.len;
    cnt[c]++;
  }
  std::fprintf(f, "  gaps <5us: %lld (%.3f ms) | 5-20us: %lld (%.3f ms) | 20-100us: %lld (%.3f ms) | >=100us: %lld (%.3f ms)\n",
               (long long)cnt[0], cls[0] * 1e-6, (long long)cnt[1], cls[1] * 1e-6, (long long)cnt[2], cls[2] * 1e-6,
               (long long)cnt[3], cls[3] * 1e-6);
  std::fflush(f);
  if (f != stderr) std::fclose(f);
}

void CUPTIAPI on_api(void*, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_RUNTIME_API) return;
  auto* info = static_cast<const CUpti_CallbackData*>(data);
  if (info->callbackSite != CUPTI_API_ENTER) return;
  uint64_t now = 0;
  cuptiGetTimestamp(&now);
  if (cbid == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000) {
    g_range_start = now;
    g_in_range = true;
  } else if (cbid == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000 && g_in_range) {
    g_in_range = false;
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    report(g_range_start, now);
    ++g_range_index;
  }
}

}  // namespace

extern "C" int InitializeInjection(void) {
  CUpti_SubscriberHandle sub;
  KT_CHECK(cuptiSubscribe(&sub, on_api, nullptr));
  KT_CHECK(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000));
  KT_CHECK(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000));
  KT_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  KT_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  KT_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
  KT_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
  return 1;
}

#include "obs/peak_flops.h"

#include <cctype>
#include <cmath>
#include <limits>

namespace dtrain {

namespace {

struct Row {
  const char* match;  // substring of the device name (lower case)
  double bf16, fp16, tf32, fp32;  // dense FLOP/s; 0 = not supported / unknown
};

// NVIDIA data sheets, dense tensor-core numbers (the sparse ones are 2x these).
// More specific names first.
constexpr Row kTable[] = {
    {"h100 pcie", 756e12, 756e12, 378e12, 51e12},
    {"h100 nvl", 835e12, 835e12, 418e12, 60e12},
    {"h200 nvl", 835e12, 835e12, 418e12, 60e12},
    {"gh200", 989e12, 989e12, 494e12, 67e12},
    {"h100", 989e12, 989e12, 494e12, 67e12},  // SXM ("NVIDIA H100 80GB HBM3")
    {"h200", 989e12, 989e12, 494e12, 67e12},  // SXM, same compute as H100 SXM
    {"h800", 989e12, 989e12, 494e12, 67e12},
    {"a100", 312e12, 312e12, 156e12, 19.5e12},
    {"a800", 312e12, 312e12, 156e12, 19.5e12},
    {"l40s", 362e12, 362e12, 183e12, 91.6e12},
    {"l40", 181e12, 181e12, 90.5e12, 90.5e12},
    {"l4", 121e12, 121e12, 60e12, 30.3e12},
    {"a10", 125e12, 125e12, 62.5e12, 31.2e12},
    {"rtx 4090", 165e12, 165e12, 82.6e12, 82.6e12},  // fp32 accumulate
    {"v100", 0, 125e12, 0, 15.7e12},
    {"t4", 0, 65e12, 0, 8.1e12},
};

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// `pat` occurs in `s` starting and ending at a word boundary.
bool contains_word(const std::string& s, const std::string& pat) {
  for (size_t pos = s.find(pat); pos != std::string::npos; pos = s.find(pat, pos + 1)) {
    bool left = pos == 0 || !std::isalnum(static_cast<unsigned char>(s[pos - 1]));
    size_t end = pos + pat.size();
    bool right = end == s.size() || !std::isalnum(static_cast<unsigned char>(s[end]));
    if (left && right) return true;
  }
  return false;
}

}  // namespace

double peak_flops(const std::string& device_name, const std::string& precision) {
  std::string name = lower(device_name), p = lower(precision);
  for (const Row& r : kTable) {
    if (!contains_word(name, r.match)) continue;
    if (p == "bf16") return r.bf16;
    if (p == "fp16") return r.fp16;
    if (p == "tf32") return r.tf32;
    if (p == "fp32") return r.fp32;
    return 0;
  }
  return 0;
}

double resolve_peak_flops(const std::string& device_name, const std::string& precision, double override_tflops) {
  if (override_tflops > 0) return override_tflops * 1e12;
  return peak_flops(device_name, precision);
}

double mfu_ratio(double achieved, double peak) {
  if (!(peak > 0) || !(achieved >= 0) || !std::isfinite(achieved)) return std::numeric_limits<double>::quiet_NaN();
  return achieved / peak;
}

}  // namespace dtrain

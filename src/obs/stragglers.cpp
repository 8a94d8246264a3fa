#include "obs/stragglers.h"

#include <cmath>

#include "obs/metrics.h"

namespace dtrain {

std::vector<Straggler> find_stragglers(const std::vector<double>& p50_s, double threshold) {
  std::vector<double> ok;
  for (double v : p50_s)
    if (std::isfinite(v) && v > 0) ok.push_back(v);
  std::vector<Straggler> out;
  if (ok.size() < 2) return out;
  const double med = quantile(ok, 0.5);
  for (size_t r = 0; r < p50_s.size(); ++r) {
    const double v = p50_s[r];
    if (std::isfinite(v) && v > 0 && v > med * (1 + threshold)) out.push_back({int(r), v, med, v / med - 1});
  }
  return out;
}

}  // namespace dtrain

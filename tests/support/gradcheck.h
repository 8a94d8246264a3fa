#pragma once
// Finite-difference gradient checker for layers and ops (Caffe's GradientChecker idea).
//
// Usage: put the input you differentiate in a host vector `x`; write `loss()` that uploads
// x, runs the forward pass and returns a scalar (usually sum(r * y) for a fixed random r,
// so that the analytic gradient is backward(dy = r)); compute `analytic` once at the
// unperturbed x; then
//
//   auto r = testing::check_gradient(loss, x, analytic);   // perturbs x in place, restores it
//   CHECK_MESSAGE(r.ok, r.summary());
//
// For each checked element i: numeric = (L(x+eps e_i) - L(x-eps e_i)) / (2 eps) (the actual
// step after rounding to T), compared with analytic[i]:
//   |analytic - numeric| <= threshold * max(1, |analytic|, |numeric|)       (Caffe's scale)
// plus an overall normalised error ||a - n|| / max(||a||, ||n||, 1e-12) over the checked
// elements (reported; also bounded by `threshold`).
//
// Non-smooth points (ReLU kinks, max-pool ties, ...) are skipped rather than failed:
//  * `skip(i)` lets the caller name them (e.g. |x_i| < eps before a ReLU);
//  * with detect_kinks, an element whose one-sided slopes (L(x+)-L(x))/eps and
//    (L(x)-L(x-))/eps differ by more than kink_threshold * max(1, |slopes|) is skipped.
// The result counts the skipped elements; tests should bound that count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace dtrain::testing {

struct GradCheckOptions {
  double eps = 1e-3;
  double threshold = 1e-2;
  bool detect_kinks = true;
  double kink_threshold = 1e-2;
  int64_t max_checks = 0;  // 0: every element; else this many, chosen with `seed`
  uint64_t seed = 1;
  std::function<bool(int64_t)> skip;  // caller-known non-smooth elements
};

struct GradCheckResult {
  bool ok = true;
  int64_t checked = 0, skipped = 0, failed = 0;
  double max_err = 0;   // max |a - n| / max(1, |a|, |n|)
  double norm_err = 0;  // ||a - n|| / max(||a||, ||n||)
  int64_t worst = -1;
  double worst_analytic = 0, worst_numeric = 0;
  std::string summary() const {
    return fmt::format(
        "gradcheck: {} checked, {} skipped, {} failed; max scaled err {:.3g} at {} (analytic "
        "{:.6g}, numeric {:.6g}); normalised err {:.3g}",
        checked, skipped, failed, max_err, worst, worst_analytic, worst_numeric, norm_err);
  }
};

template <typename T>
GradCheckResult check_gradient(const std::function<double()>& loss, std::vector<T>& x,
                               const std::vector<T>& analytic, const GradCheckOptions& o = {}) {
  GradCheckResult r;
  const int64_t n = int64_t(x.size());
  if (int64_t(analytic.size()) != n) {
    r.ok = false;
    r.failed = 1;
    return r;
  }
  std::vector<int64_t> idx(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = i;
  if (o.max_checks > 0 && o.max_checks < n) {
    std::mt19937_64 g(o.seed);
    std::shuffle(idx.begin(), idx.end(), g);
    idx.resize(size_t(o.max_checks));
    std::sort(idx.begin(), idx.end());
  }
  const double f0 = o.detect_kinks ? loss() : 0.0;
  double se = 0, sa = 0, sn = 0;
  for (int64_t i : idx) {
    if (o.skip && o.skip(i)) {
      r.skipped++;
      continue;
    }
    const T orig = x[size_t(i)];
    const T xp = T(double(orig) + o.eps), xm = T(double(orig) - o.eps);
    x[size_t(i)] = xp;
    const double fp = loss();
    x[size_t(i)] = xm;
    const double fm = loss();
    x[size_t(i)] = orig;
    const double hp = double(xp) - double(orig), hm = double(orig) - double(xm);
    const double numeric = (fp - fm) / (hp + hm);
    if (o.detect_kinks) {
      const double sp = (fp - f0) / hp, sm = (f0 - fm) / hm;
      if (std::abs(sp - sm) > o.kink_threshold * std::max({1.0, std::abs(sp), std::abs(sm)})) {
        r.skipped++;
        continue;
      }
    }
    const double a = double(analytic[size_t(i)]);
    const double err = std::abs(a - numeric) / std::max({1.0, std::abs(a), std::abs(numeric)});
    r.checked++;
    se += (a - numeric) * (a - numeric), sa += a * a, sn += numeric * numeric;
    if (!(err <= o.threshold)) r.failed++;
    if (r.worst < 0 || !(err <= r.max_err)) {  // new worst (NaN counts as worst)
      r.max_err = std::isnan(err) ? INFINITY : err;
      r.worst = i, r.worst_analytic = a, r.worst_numeric = numeric;
    }
  }
  r.norm_err = std::sqrt(se) / std::max({std::sqrt(sa), std::sqrt(sn), 1e-12});
  r.ok = r.failed == 0 && r.checked > 0 && r.norm_err <= o.threshold;
  return r;
}

// Uniform random values in [lo, hi), reproducible from `seed`.
inline std::vector<float> random_vec(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& e : v) e = d(g);
  return v;
}

}  // namespace dtrain::testing

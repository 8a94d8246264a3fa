#pragma once
// Straggler detection over the ranks of a data-parallel run: a rank is a straggler when its
// step-time p50 exceeds the median over ranks by more than `threshold` (0.2 = 20%).
#include <vector>

namespace dtrain {

struct Straggler {
  int rank = 0;
  double p50_s = 0, median_s = 0;
  double excess = 0;  // p50 / median - 1
};

// Ranks (in rank order) whose p50 > median * (1 + threshold). Non-finite or non-positive
// p50s are ignored (a rank that has not stepped yet); fewer than 2 ranks: none.
std::vector<Straggler> find_stragglers(const std::vector<double>& p50_s, double threshold = 0.2);

}  // namespace dtrain

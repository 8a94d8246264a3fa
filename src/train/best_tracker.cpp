#include "train/best_tracker.h"

#include <cmath>

namespace dtrain {

void BestTracker::restore(const CheckpointManager& cm) {
  if (!on_) return;
  const std::string text = cm.best_json();
  if (text.empty()) return;
  const auto j = nlohmann::json::parse(text);
  if (j.contains("value") && j["value"].is_number()) have_ = true, value_ = j["value"].get<double>();
  if (j.contains("step") && j["step"].is_number_integer()) step_ = j["step"].get<int64_t>();
}

bool BestTracker::improves(const BestMetric& m) const {
  return on_ && std::isfinite(m.value) && (!have_ || (m.higher ? m.value > value_ : m.value < value_));
}

bool BestTracker::exhausted(int64_t now) const {
  if (patience_ <= 0 || !have_ || step_ < 0 || every_ <= 0) return false;
  return now / every_ - step_ / every_ >= patience_;  // evaluations after the best one, up to now
}

void BestTracker::mark(int64_t at, const BestMetric& m, bool lead, const CheckpointManager& cm) {
  have_ = true;
  value_ = m.value;
  step_ = at;
  if (!lead) return;
  const std::string dir = cm.checkpoints_dir() + "/" + CheckpointManager::dir_name(at);
  cm.mark_best(dir, {{"step", at}, {"metric", m.name}, {"mode", m.higher ? "max" : "min"}, {"value", m.value}});
}

}  // namespace dtrain

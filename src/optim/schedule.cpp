#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dtrain {

LrKind parse_lr_kind(const std::string& s, const std::string& key) {
  if (s == "constant") return LrKind::Constant;
  if (s == "step") return LrKind::Step;
  if (s == "multistep") return LrKind::MultiStep;
  if (s == "cosine") return LrKind::Cosine;
  if (s == "linear") return LrKind::Linear;
  user_error("{}: expected one of constant, step, multistep, cosine, linear, got '{}'", key, s);
}

LrSchedule::LrSchedule(LrKind kind, double base_lr, int64_t total_steps, int64_t warmup_steps,
                       double warmup_start_factor, int64_t step_size, double gamma,
                       std::vector<int64_t> milestones, double min_lr)
    : kind_(kind), base_(base_lr), start_factor_(warmup_start_factor), gamma_(gamma),
      min_lr_(min_lr), total_(total_steps), warmup_(warmup_steps), step_size_(step_size),
      milestones_(std::move(milestones)) {
  if (!(base_lr > 0)) user_error("optim.lr: expected > 0, got {}", base_lr);
  if (warmup_steps < 0) user_error("schedule.warmup_steps: expected >= 0, got {}", warmup_steps);
  if (warmup_steps > 0 && !(warmup_start_factor >= 0 && warmup_start_factor <= 1))
    user_error("schedule.warmup_start_factor: expected a value in [0, 1], got {}", warmup_start_factor);
  if (kind == LrKind::Step && step_size < 1)
    user_error("schedule.step_size: expected a positive number of steps, got {}", step_size);
  if (kind == LrKind::Cosine || kind == LrKind::Linear) {
    if (total_steps <= warmup_steps)
      user_error("schedule.warmup_steps: the {} schedule needs warmup_steps ({}) < total steps ({})",
                 kind == LrKind::Cosine ? "cosine" : "linear", warmup_steps, total_steps);
    if (min_lr < 0 || min_lr > base_lr)
      user_error("schedule.min_lr: expected a value in [0, optim.lr = {}], got {}", base_lr, min_lr);
  }
  if (kind == LrKind::MultiStep) {
    for (size_t i = 0; i < milestones_.size(); ++i)
      if (milestones_[i] < 1 || (i && milestones_[i] <= milestones_[i - 1]))
        user_error("schedule.milestones: expected increasing positive step counts, got {} at position {}",
                   milestones_[i], i);
  }
}

double LrSchedule::lr(int64_t step) const {
  if (step < 0) step = 0;
  if (step < warmup_) {
    // LinearLR: factor goes from start_factor to 1 over warmup steps.
    return base_ * (start_factor_ + (1.0 - start_factor_) * double(step) / double(warmup_));
  }
  const int64_t t = step - warmup_;
  switch (kind_) {
    case LrKind::Constant: return base_;
    case LrKind::Step: return base_ * std::pow(gamma_, double(t / step_size_));
    case LrKind::MultiStep: {
      const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), t) - milestones_.begin();
      return base_ * std::pow(gamma_, double(passed));
    }
    case LrKind::Cosine: {
      const double tmax = double(total_ - warmup_);
      const double tc = std::min(double(t), tmax);
      return min_lr_ + (base_ - min_lr_) * 0.5 * (1.0 + std::cos(M_PI * tc / tmax));
    }
    case LrKind::Linear: {
      const double tmax = double(total_ - warmup_);
      return base_ + (min_lr_ - base_) * std::min(double(t), tmax) / tmax;
    }
  }
  return base_;
}

}  // namespace dtrain

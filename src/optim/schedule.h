#pragma once
// Learning-rate schedules as closed-form functions of the optimizer step (0-based: the
// lr used by the step about to run), equal to PyTorch's
//   SequentialLR([LinearLR(start_factor, 1.0, total_iters=warmup), main], milestones=[warmup])
// with main = ConstantLR(factor=1) | StepLR(step_size, gamma) | MultiStepLR(milestones, gamma)
//           | CosineAnnealingLR(T_max = total_steps - warmup_steps, eta_min = min_lr)
//           | LinearLR(1.0, min_lr / lr, total_iters = total_steps - warmup_steps) (Hugging
//             Face's get_linear_schedule_with_warmup when min_lr = 0).
// After the warmup, the main schedule counts steps from 0 (milestones and step_size are
// measured from the end of the warmup, as in SequentialLR). Past T_max the cosine stays
// at min_lr (PyTorch's would rise again); so does the linear decay.
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

enum class LrKind { Constant, Step, MultiStep, Cosine, Linear };

// "constant" | "step" | "multistep" | "cosine" | "linear"; UserError "<key>: expected one of ..." otherwise.
LrKind parse_lr_kind(const std::string& s, const std::string& key);

class LrSchedule {
 public:
  LrSchedule(LrKind kind, double base_lr, int64_t total_steps, int64_t warmup_steps = 0,
             double warmup_start_factor = 0.0, int64_t step_size = 1, double gamma = 0.1,
             std::vector<int64_t> milestones = {}, double min_lr = 0.0);
  double lr(int64_t step) const;
  LrKind kind() const { return kind_; }

 private:
  LrKind kind_;
  double base_, start_factor_, gamma_, min_lr_;
  int64_t total_, warmup_, step_size_;
  std::vector<int64_t> milestones_;
};

}  // namespace dtrain

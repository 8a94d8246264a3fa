#pragma once
// Segmentation metrics on the host: a confusion matrix from argmax predictions vs labels,
// then per-class IoU = TP/(TP+FP+FN) and Dice = 2TP/(2TP+FP+FN). A class absent from both
// predictions and labels (empty union) has NaN IoU/Dice and is left out of the means.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dtrain {

class SegConfusion {
 public:
  explicit SegConfusion(int num_classes);
  // logits [P, K] (row-major, NHWC flattened), labels [P] in [0, K); argmax takes the
  // first maximum. Labels outside [0, K) throw UserError.
  void add_logits(const float* logits, const int32_t* labels, int64_t pixels);
  void add_predictions(const int32_t* pred, const int32_t* labels, int64_t pixels);
  int64_t at(int label, int pred) const { return m_[size_t(label) * size_t(k_) + size_t(pred)]; }
  int num_classes() const { return k_; }
  void reset();

 private:
  int k_;
  std::vector<int64_t> m_;  // [label][pred]
};

struct SegScores {
  std::vector<double> iou, dice;  // per class (NaN when the class is absent everywhere)
  double mean_iou = 0, mean_dice = 0, pixel_accuracy = 0;
};
SegScores seg_scores(const SegConfusion& c);

}  // namespace dtrain

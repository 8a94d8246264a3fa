#include "nn/seg_metrics.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dtrain {

SegConfusion::SegConfusion(int num_classes) : k_(num_classes) {
  DTRAIN_CHECK(num_classes > 0, "SegConfusion: {} classes", num_classes);
  m_.assign(size_t(k_) * size_t(k_), 0);
}

void SegConfusion::reset() { std::fill(m_.begin(), m_.end(), 0); }

void SegConfusion::add_predictions(const int32_t* pred, const int32_t* labels, int64_t pixels) {
  for (int64_t i = 0; i < pixels; ++i) {
    if (labels[i] < 0 || labels[i] >= k_)
      user_error("segmentation metrics: label {} at pixel {} is outside [0, {})", labels[i], i, k_);
    DTRAIN_CHECK(pred[i] >= 0 && pred[i] < k_, "prediction {} outside [0, {})", pred[i], k_);
    m_[size_t(labels[i]) * size_t(k_) + size_t(pred[i])]++;
  }
}

void SegConfusion::add_logits(const float* logits, const int32_t* labels, int64_t pixels) {
  std::vector<int32_t> pred(static_cast<size_t>(pixels));
  for (int64_t i = 0; i < pixels; ++i) {
    const float* r = logits + i * k_;
    int best = 0;
    for (int k = 1; k < k_; ++k)
      if (r[k] > r[best]) best = k;
    pred[size_t(i)] = best;
  }
  add_predictions(pred.data(), labels, pixels);
}

SegScores seg_scores(const SegConfusion& c) {
  const int K = c.num_classes();
  SegScores s;
  s.iou.assign(size_t(K), NAN);
  s.dice.assign(size_t(K), NAN);
  int64_t total = 0, correct = 0;
  double si = 0, sd = 0;
  int present = 0;
  for (int k = 0; k < K; ++k) {
    int64_t tp = c.at(k, k), fp = 0, fn = 0;
    for (int j = 0; j < K; ++j) {
      if (j == k) continue;
      fp += c.at(j, k);
      fn += c.at(k, j);
    }
    for (int j = 0; j < K; ++j) total += c.at(k, j);
    correct += tp;
    if (tp + fp + fn == 0) continue;
    s.iou[size_t(k)] = double(tp) / double(tp + fp + fn);
    s.dice[size_t(k)] = 2.0 * double(tp) / double(2 * tp + fp + fn);
    si += s.iou[size_t(k)], sd += s.dice[size_t(k)], present++;
  }
  s.mean_iou = present ? si / present : NAN;
  s.mean_dice = present ? sd / present : NAN;
  s.pixel_accuracy = total ? double(correct) / double(total) : NAN;
  return s;
}

}  // namespace dtrain

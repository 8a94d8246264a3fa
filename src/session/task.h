#pragma once
// A Task is what a model family trains on: its data, its loss and its metrics.
//   ClassifyTask  (ResNet)  images -> logits [N,C] -> softmax cross-entropy; {loss, accuracy}
//   LmTask        (GPT)     token windows -> logits [B*T,V] -> next-token CE; {loss, perplexity}
//   SegmentTask   (U-Net)   images -> logits [N,H,W,K] -> CE + dice_weight * soft Dice;
//                           {loss, mean IoU, mean Dice, per-class IoU}
// make_session picks the task from model.kind; train_step and evaluate call it.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/image_loader.h"
#include "nn/module.h"

namespace dtrain {

using data::LoaderState;
struct Runtime;
struct GptSpec;
class Config;

// The phases of a training step (seconds); Task::stage_batch adds its wait for data.
struct StepTimes {
  double data_s = 0, forward_s = 0, backward_s = 0, optimizer_s = 0, total_s = 0;
};

// A training micro-batch staged on the device by Task::stage_batch.
struct StagedBatch {
  int64_t units = 0;  // samples (images) or tokens (GPT): what the loss is summed over
  // The device inputs (images or tokens, and labels or targets): a CUDA graph captured for
  // one staged batch replays only for inputs at the same addresses with the same shapes.
  Tensor x, y;
  // Fine-tuning examples (LmTask on data.kind = "sft"): the tokens' positions i32 [B,T] when
  // several documents share a row (GptModel::set_positions with documents), undefined otherwise;
  // and, when `weighted`, how the micro-batch's loss counts when only some tokens are targets:
  // its per-token losses are summed into the step's loss sum times loss_weight, and dlogits is
  // grad_scale times their gradient (times the fp16 loss scale), so that the step's loss and
  // gradient are the mean over the targets of the global batch. Not weighted: the task's mean.
  Tensor positions = Tensor();
  bool weighted = false;
  double loss_weight = 1;
  float grad_scale = 1;
};

struct EvalStats {
  double loss = 0, accuracy = 0;
  double accuracy_top5 = -1;  // classification with more than 5 classes; -1 otherwise
  int64_t samples = 0;
  // LM
  double perplexity = 0;
  int64_t tokens = 0;
  // segmentation
  double mean_iou = 0, mean_dice = 0, pixel_accuracy = 0;
  std::vector<double> class_iou;
};

enum class TaskKind { Classify, Lm, Segment };

// The metric checkpoint.keep_best ranks evaluations by.
struct BestMetric {
  std::string name;  // its metrics.jsonl field, e.g. "eval_accuracy"
  double value = 0;
  bool higher = true;  // higher is better
};

// How an evaluation is reported, in the task's own terms.
struct EvalReport {
  std::string line;      // console: "test loss 0.1824 | test accuracy 93.45% | 10000 samples"
  std::string summary;   // the final "done:" line: "test accuracy 93.45% | test loss 0.1824"
  nlohmann::json fields = nlohmann::json::object();      // metrics.jsonl eval row, beyond eval_loss/eval_samples
  nlohmann::json end_fields = nlohmann::json::object();  // the run_end event, beyond eval_loss
  std::vector<std::pair<std::string, double>> scalars;   // TensorBoard, beyond eval/loss
  std::string gauge;  // Prometheus dtrain_eval_metric{metric=gauge}
  double gauge_value = 0;
  BestMetric best;
  // The task's headline metric `key`: "eval_<key>" in the metrics.jsonl eval row and in
  // run_end, "eval/<key>" in TensorBoard, and the Prometheus gauge.
  void headline(const std::string& key, double value) {
    fields["eval_" + key] = value;
    end_fields["eval_" + key] = value;
    scalars.emplace_back("eval/" + key, value);
    gauge = key;
    gauge_value = value;
  }
};

class Task {
 public:
  virtual ~Task() = default;
  virtual TaskKind kind() const = 0;
  // What one loss unit is, for throughput: "img" | "tok".
  virtual std::string unit() const { return "img"; }
  // Loss units per sample: 1, or a GPT's block_size (tokens per sequence).
  virtual int64_t units_per_sample() const { return 1; }
  // The training data is a stream of token windows addressed by a position (checkpointed
  // with it), not epochs of batches.
  virtual bool token_stream() const { return false; }
  // The evaluation `ev` (samples > 0) as the console, metrics, TensorBoard and Prometheus
  // show it, and the metric keep_best ranks by.
  virtual EvalReport report(const EvalStats& ev) const = 0;
  // Declares the model's parameters into s.params and sets s.model (after the backend).
  virtual void build_model(Runtime& s) = 0;
  // Stages training micro-batch `stream` (= micro * world + rank; it names the synthetic
  // batch) on the device: reads the loader and uploads into buffers the task keeps (not
  // the arena), so the inputs' addresses stay fixed. Host work, never captured; its wait
  // for data goes to t.data_s.
  virtual StagedBatch stage_batch(Runtime& s, uint64_t stream, StepTimes& t) = 0;
  // Forward and loss of the batch staged last: device work only (no host reads, no
  // synchronisation), so a CUDA graph can capture it. Writes the micro-batch's loss summed
  // over its units to loss_sum (f64 [1] on the device) and returns dlogits for
  // model->backward, scaled so the step's gradient is the mean over all `accum`
  // micro-batches (times the fp16 loss scale).
  virtual Tensor forward_loss(Runtime& s, Ctx& ctx, int64_t accum, Tensor& loss_sum) = 0;
  virtual EvalStats evaluate(Runtime& s) = 0;
  virtual bool has_eval() const = 0;
  // Data position of the training stream (checkpointed). False: nothing to save.
  virtual bool data_state(LoaderState& st, uint64_t& position) const = 0;
  virtual void restore_data(const LoaderState& st, uint64_t position) = 0;
  // Batches per epoch of this rank's training data; 0 when the data has no epochs.
  virtual int64_t batches_per_epoch() const = 0;

  // What a logged training step adds to its metrics.jsonl row beyond the loss, for the steps since
  // the last call: a mixture of experts' routing (moe_tokens_per_expert, moe_dropped_tokens,
  // moe_aux_loss, moe_z_loss). Empty by default.
  virtual nlohmann::json step_fields() { return nlohmann::json::object(); }

  // The evaluated split (data.eval_split as the task resolved it), named in the eval lines.
  std::string eval_split = "val";
};


// model.preset / n_layer / n_head / n_embd / block_size / vocab_size -> a validated GptSpec.
GptSpec gpt_spec_from(const Config& cfg);

// The task for a validated config, with its data loaders (rank/world of this process for
// the training data); fills the runtime's geometry fields. UserError for bad combinations.
std::unique_ptr<Task> make_task(Runtime& s, bool with_train_data, bool with_eval_data, int rank, int world);
std::unique_ptr<Task> make_classify_task(Runtime& s, bool with_train_data, bool with_eval_data, int rank, int world);
std::unique_ptr<Task> make_lm_task(Runtime& s, bool with_train_data, bool with_eval_data, int rank, int world);
std::unique_ptr<Task> make_segment_task(Runtime& s, bool with_train_data, bool with_eval_data, int rank, int world);

}  // namespace dtrain

// make_task: the Task of a recipe's model.kind.
#include "train/task.h"

#include "train/runtime.h"

namespace dtrain {

std::unique_ptr<Task> make_task(Runtime& s, bool with_train_data, bool with_eval_data, int rank, int world) {
  const std::string kind = s.cfg.s("model.kind");
  if (kind == "resnet") return make_classify_task(s, with_train_data, with_eval_data, rank, world);
  if (kind == "gpt") return make_lm_task(s, with_train_data, with_eval_data, rank, world);
  if (kind == "unet") return make_segment_task(s, with_train_data, with_eval_data, rank, world);
  user_error("{}: model.kind = \"{}\" is not one of resnet, unet, gpt", s.cfg.source(), kind);
}

}  // namespace dtrain

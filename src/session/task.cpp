// make_task: the Task of a recipe's model.kind.
#include "session/task.h"

#include <filesystem>

#include "session/runtime.h"

namespace dtrain {

std::unique_ptr<Task> make_task(Runtime& s, bool with_train_data, bool with_eval_data, int rank, int world) {
  const std::string kind = s.cfg.model.kind;
  // a recipe that says how its data is made names that command when the data is missing
  const std::string path = s.cfg.data.path, prepare = s.cfg.data.prepare;
  std::error_code ec;
  if ((with_train_data || with_eval_data) && s.cfg.data.kind != "synthetic" && !prepare.empty() &&
      !path.empty() && !std::filesystem::exists(path, ec))
    user_error("{}: data.path = \"{}\" does not exist (prepare it with: {})", s.cfg.source(), path, prepare);
  if (kind == "resnet") return make_classify_task(s, with_train_data, with_eval_data, rank, world);
  if (kind == "gpt") return make_lm_task(s, with_train_data, with_eval_data, rank, world);
  if (kind == "unet") return make_segment_task(s, with_train_data, with_eval_data, rank, world);
  user_error("{}: model.kind = \"{}\" is not one of resnet, unet, gpt", s.cfg.source(), kind);
}

}  // namespace dtrain

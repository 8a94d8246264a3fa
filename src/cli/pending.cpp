// TEMPORARY: placeholders for subcommands whose implementations live on other branches.
// The lead deletes this file when the real cmd_* functions merge. train/eval/bench
// validate the recipe first (Config::load), so recipe errors are reported already.
#include "cli/commands.h"
#include "core/error.h"
#include "train/config.h"

namespace dtrain {

int cmd_train(const TrainArgs& a) {
  if (!a.config.empty()) Config::load(a.config, a.overrides);
  throw UserError("dtrain train: not implemented yet");
}
int cmd_eval(const EvalArgs& a) {
  Config::load(a.config, a.overrides);
  throw UserError("dtrain eval: not implemented yet");
}
int cmd_bench(const BenchArgs& a) {
  Config::load(a.config, a.overrides);
  throw UserError("dtrain bench: not implemented yet");
}
int cmd_inspect(const InspectArgs&) { throw UserError("dtrain inspect: not implemented yet"); }
int cmd_data_fashion_mnist(const DataFashionMnistArgs&) {
  throw UserError("dtrain data fashion-mnist: not implemented yet");
}
int cmd_data_images(const DataImagesArgs&) { throw UserError("dtrain data images: not implemented yet"); }

}  // namespace dtrain

#pragma once
// The run directory: runs/<run.name>/ with config.toml, train.log, metrics.jsonl,
// events.jsonl, TensorBoard event files and checkpoints/ (DESIGN.md).
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace dtrain {

class Config;
class JsonlWriter;
class TensorBoardWriter;

class RunDir {
 public:
  // create = true: the directory must not exist yet (nothing is overwritten silently);
  // create = false (resume): it must exist.
  RunDir(const std::string& path, bool create, bool tensorboard);
  ~RunDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  void event(const std::string& kind, nlohmann::json fields = {});
  void metrics(const nlohmann::json& row);
  void scalar(const std::string& tag, double value, int64_t step);
  // TensorBoard's HParams dashboard: every key of the resolved recipe (arrays as their TOML
  // text), grouped under `group` (the run name); session_end marks the run finished
  // (success) or diverged (failure). No-ops without TensorBoard.
  void hparams(const Config& cfg, const std::string& group);
  void session_end(bool success);
  // A resumed run writes its steps from `step` again: TensorBoard drops the earlier events at
  // steps >= step (TensorBoardWriter::restart_at). No-op without TensorBoard.
  void restart_at(int64_t step);
  void flush();

 private:
  std::string path_;
  std::unique_ptr<JsonlWriter> events_, metrics_;
  std::unique_ptr<TensorBoardWriter> tb_;
};

}  // namespace dtrain

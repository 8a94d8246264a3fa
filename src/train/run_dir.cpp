#include "train/run_dir.h"

#include <filesystem>

#include "core/error.h"
#include "core/log.h"
#include "obs/jsonl.h"
#include "obs/tensorboard.h"

namespace dtrain {

namespace stdfs = std::filesystem;

RunDir::RunDir(const std::string& path, bool create, bool tensorboard) : path_(path) {
  std::error_code ec;
  if (create) {
    if (stdfs::exists(path, ec))
      user_error("run directory {} already exists: resume it with `dtrain train --resume {}`, or pick another run.name (e.g. --set run.name=NEW)",
                 path, path);
    stdfs::create_directories(path + "/checkpoints", ec);
    if (ec) user_error("cannot create run directory {}: {}", path, ec.message());
  } else {
    if (!stdfs::is_directory(path, ec)) user_error("cannot resume: run directory {} does not exist", path);
    stdfs::create_directories(path + "/checkpoints", ec);
  }
  events_ = std::make_unique<JsonlWriter>(file("events.jsonl"));
  metrics_ = std::make_unique<JsonlWriter>(file("metrics.jsonl"));
  if (tensorboard) tb_ = std::make_unique<TensorBoardWriter>(path);
  log::set_file(file("train.log"));
}

RunDir::~RunDir() { log::set_file(""); }

void RunDir::event(const std::string& kind, nlohmann::json fields) {
  if (!fields.is_object()) fields = nlohmann::json::object();
  nlohmann::json row = {{"time", iso8601_now()}, {"event", kind}};
  row.update(fields);
  events_->write(row);
}

void RunDir::metrics(const nlohmann::json& row) {
  if (row.contains("time")) return metrics_->write(row);
  nlohmann::json r = {{"time", iso8601_now()}};  // wall clock first (MLflow / W&B importers)
  r.update(row);
  metrics_->write(r);
}

void RunDir::scalar(const std::string& tag, double value, int64_t step) {
  if (tb_) tb_->scalar(tag, float(value), step);
}

void RunDir::flush() {
  if (tb_) tb_->flush();
}

}  // namespace dtrain

#include "train/run_dir.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <filesystem>

#include "core/error.h"
#include "core/log.h"
#include "obs/jsonl.h"
#include "obs/tensorboard.h"
#include "config/config.h"

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

void RunDir::hparams(const Config& cfg, const std::string& group) {
  if (!tb_) return;
  HParams hp;
  for (const KeySpec& k : config_schema()) {
    const std::string key(k.key);
    switch (k.type) {
      case ValueType::Int: hp.emplace_back(key, double(cfg.i(key))); break;
      case ValueType::Float: hp.emplace_back(key, cfg.f(key)); break;
      case ValueType::Bool: hp.emplace_back(key, cfg.b(key)); break;
      case ValueType::String: hp.emplace_back(key, cfg.s(key)); break;
      case ValueType::IntArray: hp.emplace_back(key, fmt::format("[{}]", fmt::join(cfg.iv(key), ", "))); break;
      case ValueType::FloatArray: hp.emplace_back(key, fmt::format("[{}]", fmt::join(cfg.fv(key), ", "))); break;
    }
  }
  tb_->hparams(hp, group, double(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()));
}

void RunDir::session_end(bool success) {
  if (tb_) tb_->session_end(success);
}

void RunDir::restart_at(int64_t step) {
  if (tb_) tb_->restart_at(step);
}

void RunDir::flush() {
  if (tb_) tb_->flush();
}

}  // namespace dtrain

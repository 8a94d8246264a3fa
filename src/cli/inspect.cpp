// dtrain inspect: a checkpoint's tensors, shapes, dtypes, step and recipe; or the tensors of
// weights alone (a safetensors file, a Hugging Face model directory).
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/command.h"
#include "checkpoint/checkpoint.h"
#include "core/error.h"
#include "checkpoint/init_from.h"
#include "checkpoint/flat_shards.h"
#include "checkpoint/model_tensors.h"
#include "checkpoint/safetensors.h"

namespace dtrain::cli {

namespace {

// One safetensors file: its tensors, dtypes and shapes (and an optimizer shard's range).
void print_tensors(const std::string& path, const std::string& label) {
  SafetensorsReader r(path);
  int64_t total = 0;
  const auto& meta = r.metadata();
  std::string about;
  if (meta.count("shard_count") && meta.count("range_begin") && meta.count("range_end") && meta.count("num_params"))
    about = fmt::format(" {} shard {} of {}, elements [{}, {}) of {}", meta.count("optimizer") ? meta.at("optimizer") : "model",
                        meta.at("shard_index"), meta.at("shard_count"), meta.at("range_begin"), meta.at("range_end"),
                        meta.at("num_params"));
  fmt::print("\n{}:{}\n", label, about);
  for (const auto& n : r.names()) {
    auto shape = r.shape(n);
    int64_t numel = 1;
    for (auto d : shape) numel *= d;
    total += numel;
    fmt::print("  {:<48} {:<5} [{}]\n", n, r.dtype(n), fmt::join(shape, ", "));
  }
  fmt::print("  {} tensors, {} values\n", r.names().size(), total);
}

int cmd_inspect(const std::string& path) {
  // weights alone: a safetensors file, or a model directory without SHA256SUMS (Hugging Face's)
  if (const std::string file = weights_only_file(path); !file.empty()) {
    fmt::print("weights {} (not a dtrain checkpoint: no SHA256SUMS or state.json)\n", file);
    print_tensors(file, std::filesystem::path(file).filename().string());
    return 0;
  }
  std::string ck = resolve_checkpoint_dir(path);
  std::ifstream sf(ck + "/state.json");
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(sf);
  } catch (const std::exception& e) {
    user_error("{}/state.json: not valid JSON: {}", ck, e.what());
  }
  fmt::print("checkpoint {}\n", ck);
  fmt::print("step {} | world size {} | dtrain {} | config hash {}\n", state.value("step", int64_t(-1)),
             state.value("world_size", 1), state.value("dtrain_version", std::string("?")),
             state.value("config_hash", std::string("?")));
  if (state.contains("loss_scale") && state["loss_scale"].is_object()) {
    const auto& ls = state["loss_scale"];
    fmt::print("fp16 loss scale {} | {} clean steps since its last change | {} steps skipped (overflow)\n",
               ls.value("scale", 0.0), ls.value("good_steps", int64_t(0)), ls.value("skipped_steps", int64_t(0)));
  }
  // the model: model.safetensors, or (ZeRO-3) its tensors as the model shards put together give
  // them, then those shard files and every optimizer shard file, in shard order
  std::vector<std::string> files;
  const ModelTensors model(ck);
  if (model.sharded()) {
    fmt::print("\nmodel ({} shards {}, put together):\n", model.shards()->count(), model.origin());
    int64_t total = 0;
    for (const std::string& n : model.names()) {
      const auto shape = model.shape(n);
      int64_t numel = 1;
      for (auto d : shape) numel *= d;
      total += numel;
      fmt::print("  {:<48} {:<5} [{}]\n", n, model.dtype(n), fmt::join(shape, ", "));
    }
    fmt::print("  {} tensors, {} values\n", model.names().size(), total);
    for (const FlatShardInfo& f : model.shards()->shards()) files.push_back(f.file);
  } else {
    files.push_back("model.safetensors");
  }
  std::vector<std::string> shards;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(ck, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int index = 0, count = 0;
    if (parse_flat_shard_name(FlatKind::Optimizer, name, &index, &count)) shards.push_back(name);
  }
  std::sort(shards.begin(), shards.end());
  files.insert(files.end(), shards.begin(), shards.end());
  for (const std::string& file : files)
    if (std::ifstream(ck + "/" + file).good()) print_tensors(ck + "/" + file, file);
  std::ifstream cf(ck + "/config.toml");
  if (cf) {
    std::stringstream ss;
    ss << cf.rdbuf();
    fmt::print("\nrecipe:\n{}", ss.str());
  }
  return 0;
}

}  // namespace

void add_inspect(CLI::App& app, Run& run) {
  auto path = std::make_shared<std::string>();
  auto* c = app.add_subcommand("inspect", "describe a checkpoint or run directory");
  c->add_option("path", *path, "checkpoint or run directory, a safetensors file, or a Hugging Face model directory")
      ->type_name("PATH")
      ->required();
  set_examples(c, {"dtrain inspect runs/resnet20_fmnist                 (its newest valid checkpoint)",
                   "dtrain inspect runs/gpt_fortunes/checkpoints/step_00000800",
                   "dtrain inspect model.safetensors                    (any safetensors file)"});
  c->callback([path, &run] { run = [path] { return cmd_inspect(*path); }; });
}

}  // namespace dtrain::cli

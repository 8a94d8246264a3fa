// dtrain inspect: a checkpoint's tensors, shapes, dtypes, step and recipe.
#include <fmt/ranges.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "train/safetensors.h"

namespace dtrain {

std::string resolve_checkpoint_dir(const std::string& path);  // eval_cmd.cpp

int cmd_inspect(const InspectArgs& a) {
  std::string ck = resolve_checkpoint_dir(a.path);
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
  for (const char* file : {"model.safetensors", "optim-00000-of-00001.safetensors"}) {
    std::string path = ck + "/" + file;
    if (!std::ifstream(path).good()) continue;
    SafetensorsReader r(path);
    int64_t total = 0;
    fmt::print("\n{}:\n", file);
    for (const auto& n : r.names()) {
      auto shape = r.shape(n);
      int64_t numel = 1;
      for (auto d : shape) numel *= d;
      total += numel;
      fmt::print("  {:<48} {:<5} [{}]\n", n, r.dtype(n), fmt::join(shape, ", "));
    }
    fmt::print("  {} tensors, {} values\n", r.names().size(), total);
  }
  std::ifstream cf(ck + "/config.toml");
  if (cf) {
    std::stringstream ss;
    ss << cf.rdbuf();
    fmt::print("\nrecipe:\n{}", ss.str());
  }
  return 0;
}

}  // namespace dtrain

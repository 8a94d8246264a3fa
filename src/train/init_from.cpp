#include "train/init_from.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "core/dtype.h"
#include "core/error.h"
#include <fmt/format.h>
#include "train/safetensors.h"

namespace dtrain {

std::string resolve_checkpoint_dir(const std::string& path);  // eval_cmd.cpp

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

InitReport init_model_from(Session& s, const std::string& path, bool strict) {
  namespace stdfs = std::filesystem;
  InitReport r;
  if (!stdfs::exists(path)) user_error("model.init_from: {} does not exist", path);
  r.file = stdfs::is_directory(path) ? resolve_checkpoint_dir(path) + "/model.safetensors" : path;
  SafetensorsReader reader(r.file);
  const std::string hint = " (model.init_strict = false keeps this model's own initialisation for such tensors)";
  std::map<std::string, std::vector<uint8_t>> loaded;  // alive until import_state returns
  std::set<std::string> wanted;
  for (const StateEntry& w : s.params.state_entries()) wanted.insert(w.name);
  // what the file offers for entry w: its bytes as w's dtype, or nothing (kept when not strict)
  std::map<std::string, StateEntry> entries;
  for (const StateEntry& w : s.params.state_entries()) entries[w.name] = w;
  TensorLookup lookup = [&](const std::string& name) -> std::optional<ImportTensor> {
    const StateEntry& w = entries.at(name);
    auto refuse = [&](const std::string& why) -> std::optional<ImportTensor> {
      if (strict) user_error("{}: tensor '{}' {}{}", r.file, name, why, hint);
      r.kept.push_back(name);
      return std::nullopt;
    };
    if (!reader.has(name)) return refuse(fmt::format("is missing (this model has {} {})", w.dtype, shape_text(w.shape)));
    const std::string& dt = reader.dtype(name);
    const std::vector<int64_t> shape = reader.shape(name);
    const bool widen = w.dtype == "F32" && (dt == "BF16" || dt == "F16");
    if ((dt != w.dtype && !widen) || shape != w.shape)
      return refuse(fmt::format("is {} {}, this model's is {} {}", dt, shape_text(shape), w.dtype, shape_text(w.shape)));
    std::vector<uint8_t> raw(reader.nbytes(name));
    reader.read(name, raw.data(), raw.size());
    auto& bytes = loaded[name];
    if (widen) {
      const size_t n = raw.size() / 2;
      bytes.resize(n * 4);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = uint16_t(raw[2 * i] | (raw[2 * i + 1] << 8));
        const float f = dt == "BF16" ? bf16_to_f32(h) : f16_to_f32(h);
        std::memcpy(bytes.data() + 4 * i, &f, 4);
      }
    } else {
      bytes = std::move(raw);
    }
    ++r.loaded;
    return ImportTensor{w.dtype, w.shape, bytes.data(), bytes.size()};
  };
  for (const auto& n : reader.names()) {
    if (wanted.count(n)) continue;
    if (strict) user_error("{}: tensor '{}' does not exist in this model{}", r.file, n, hint);
    r.ignored.push_back(n);
  }
  s.params.import_state(lookup, r.file, /*keep_missing=*/!strict);
  if (r.loaded == 0) user_error("model.init_from: no tensor of {} fits this model (a different model?)", r.file);
  return r;
}

}  // namespace dtrain

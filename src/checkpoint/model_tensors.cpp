#include "checkpoint/model_tensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fsutil.h"
#include "session/session.h"
#include "session/runtime.h"

namespace dtrain {

namespace stdfs = std::filesystem;

ModelTensors::~ModelTensors() = default;

ModelTensors::ModelTensors(const std::string& path) {
  std::error_code ec;
  const bool dir = stdfs::is_directory(path, ec);
  const std::string file = dir ? path + "/model.safetensors" : path;
  if (!dir || stdfs::exists(file, ec)) {
    file_ = std::make_unique<SafetensorsReader>(file);
    origin_ = file;
    names_ = file_->names();
    return;
  }
  if (const std::string index = path + "/model.safetensors.index.json"; stdfs::exists(index, ec)) {
    origin_ = index;
    std::map<std::string, std::string> weight_map;
    try {
      const nlohmann::json j = nlohmann::json::parse(fs::read_file(index));
      weight_map = j.at("weight_map").get<std::map<std::string, std::string>>();
    } catch (const nlohmann::json::exception& e) {
      user_error("{}: {}", index, e.what());
    }
    if (weight_map.empty()) user_error("{}: weight_map is empty", index);
    std::map<std::string, const SafetensorsReader*> by_file;
    for (const auto& [name, f] : weight_map) {
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        user_error("{}: weight_map[\"{}\"] = \"{}\": expected a file name in the directory", index, name, f);
      if (!by_file.count(f)) {
        hf_files_.push_back(std::make_unique<SafetensorsReader>(path + "/" + f));
        by_file[f] = hf_files_.back().get();
      }
      if (!by_file[f]->has(name)) user_error("{}/{}: tensor '{}' is missing (the index places it there)", path, f, name);
      hf_of_[name] = by_file[f];
    }
    for (const auto& r : hf_files_)  // the files' order, each file's own order
      for (const std::string& n : r->names()) {
        auto it = hf_of_.find(n);
        if (it == hf_of_.end() || it->second != r.get())
          user_error("{}: tensor '{}' is not in {}'s weight_map (or placed in another file)", r->path(), n, index);
        names_.push_back(n);
      }
    return;
  }
  shards_ = std::make_unique<FlatShards>(path, FlatKind::Model);
  if (shards_->count() == 0)
    user_error("{}: no model.safetensors and no model shards (model-<index>-of-<count>.safetensors)", path);
  origin_ = shards_->origin();
  // the layout the shards' flat ranges are in: the model of the checkpoint's own recipe
  const std::string recipe = path + "/config.toml";
  if (!stdfs::exists(recipe, ec))
    user_error("{}: missing (the model shards' layout comes from the checkpoint's recipe)", recipe);
  layout_ = declare_model(Config::load(recipe));
  const ParamStore& ps = layout_->params;
  if (ps.num_params() != shards_->num_params() || ps.layout_hash() != shards_->layout())
    user_error("{}: parameter layout {} ({} values) but the model of {} has {} ({} values): files of different runs?",
               origin_, shards_->layout().substr(0, 12), shards_->num_params(), recipe, ps.layout_hash().substr(0, 12),
               ps.num_params());
  for (const StateEntry& e : ps.state_entries()) {
    names_.push_back(e.name);
    const int id = ps.find_param(e.name);
    if (id >= 0) params_[e.name] = Param{&ps.params()[size_t(id)], e};
  }
  // shard 0's other tensors are the buffers and counters: exactly the model's
  const SafetensorsReader& first = shards_->first();
  for (const std::string& n : first.names())
    if (n != "params" && (params_.count(n) || std::find(names_.begin(), names_.end(), n) == names_.end()))
      user_error("{}: tensor '{}' is not a buffer of the model of {}", first.path(), n, recipe);
  for (const std::string& n : names_)
    if (!params_.count(n) && !first.has(n))
      user_error("{}: tensor '{}' is missing (shard 0 holds the model's buffers)", first.path(), n);
}

const SafetensorsReader* ModelTensors::hf_file(const std::string& name) const {
  if (hf_files_.empty()) return nullptr;
  auto it = hf_of_.find(name);
  if (it == hf_of_.end()) user_error("{}: no tensor '{}'", origin_, name);
  return it->second;
}

const ModelTensors::Param* ModelTensors::param(const std::string& name) const {
  auto it = params_.find(name);
  return it == params_.end() ? nullptr : &it->second;
}

const SafetensorsReader& ModelTensors::buffers(const std::string& name) const {
  if (name == "params") user_error("{}: no tensor '{}'", origin_, name);  // the flat parameters are no model tensor
  return shards_->first();
}

bool ModelTensors::has(const std::string& name) const {
  if (file_) return file_->has(name);
  if (!hf_files_.empty()) return hf_of_.count(name) > 0;
  return param(name) || (name != "params" && shards_->first().has(name));
}

const std::string& ModelTensors::dtype(const std::string& name) const {
  if (file_) return file_->dtype(name);
  if (const SafetensorsReader* h = hf_file(name)) return h->dtype(name);
  if (const Param* p = param(name)) return p->entry.dtype;
  return buffers(name).dtype(name);
}

std::vector<int64_t> ModelTensors::shape(const std::string& name) const {
  if (file_) return file_->shape(name);
  if (const SafetensorsReader* h = hf_file(name)) return h->shape(name);
  if (const Param* p = param(name)) return p->entry.shape;
  return buffers(name).shape(name);
}

size_t ModelTensors::nbytes(const std::string& name) const {
  if (file_) return file_->nbytes(name);
  if (const SafetensorsReader* h = hf_file(name)) return h->nbytes(name);
  if (const Param* p = param(name)) {
    size_t n = 4;
    for (int64_t d : p->entry.shape) n *= size_t(d);
    return n;
  }
  return buffers(name).nbytes(name);
}

void ModelTensors::read(const std::string& name, void* dst, size_t n) const {
  if (file_) return file_->read(name, dst, n);
  if (const SafetensorsReader* h = hf_file(name)) return h->read(name, dst, n);
  const Param* p = param(name);
  if (!p) return buffers(name).read(name, dst, n);
  if (n != nbytes(name)) user_error("{}: tensor '{}' is {} bytes, not {}", origin_, name, nbytes(name), n);
  const ParamDesc& d = *p->desc;
  std::vector<float> flat(size_t(d.shape.numel()));
  shards_->read_into("params", d.offset, d.offset + d.shape.numel(), flat.data());
  const ParamStore::Exported x = layout_->params.export_param(d, flat.data());
  std::memcpy(dst, x.bytes.data(), n);
}

TensorLookup ModelTensors::lookup() {
  return [this](const std::string& name) -> std::optional<ImportTensor> {
    if (!has(name)) return std::nullopt;
    auto [it, fresh] = held_.try_emplace(name);
    if (fresh) {
      it->second.resize(nbytes(name));
      read(name, it->second.data(), it->second.size());
    }
    return ImportTensor{dtype(name), shape(name), it->second.data(), it->second.size()};
  };
}

}  // namespace dtrain

#include "checkpoint/lora_files.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/checkpoint.h"
#include "checkpoint/flat_shards.h"
#include "checkpoint/init_from.h"
#include "checkpoint/model_tensors.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "nn/lora.h"

namespace dtrain {

namespace stdfs = std::filesystem;

std::string lora_adapter_config(const Config& cfg) {
  const std::string& init = cfg.model.init_from;
  std::error_code ec;
  const stdfs::path abs = init.empty() ? stdfs::path() : stdfs::absolute(init, ec);
  nlohmann::ordered_json j = {
      {"alpha_pattern", nlohmann::json::object()},
      {"auto_mapping", nullptr},
      {"base_model_name_or_path", abs.lexically_normal().string()},
      {"bias", "none"},
      {"fan_in_fan_out", cfg.model.arch == "gpt2"},  // GPT-2's Conv1D keeps [in, out] weights
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"lora_alpha", cfg.lora.alpha},
      {"lora_dropout", cfg.lora.dropout},
      {"modules_to_save", nullptr},
      {"peft_type", "LORA"},
      {"r", cfg.lora.rank},
      {"rank_pattern", nlohmann::json::object()},
      {"revision", nullptr},
      {"target_modules", lora_targets(cfg.lora.target_modules)},
      {"task_type", "CAUSAL_LM"},
      {"use_dora", false},
      {"use_rslora", false},
  };
  return j.dump(2) + "\n";
}

uint64_t write_lora_adapter(const Config& cfg, const std::vector<ParamStore::Exported>& adapters,
                            const std::string& dir) {
  uint64_t bytes = write_exported(dir + "/" + kAdapterModelFile, adapters, {{"format", "pt"}});
  const std::string conf = lora_adapter_config(cfg);
  fs::write_file(dir + "/" + kAdapterConfigFile, conf);
  return bytes + conf.size();
}

namespace {

// The directory holding the adapter: a PEFT adapter directory as it is, else a verified
// checkpoint (a run directory's newest valid one).
std::string adapter_dir_of(const std::string& path) {
  std::error_code ec;
  if (stdfs::is_directory(path, ec) && stdfs::exists(path + "/" + kAdapterConfigFile, ec) &&
      !stdfs::exists(path + "/SHA256SUMS", ec))
    return path;
  const std::string ck = resolve_checkpoint_dir(path);
  if (!stdfs::exists(ck + "/" + kAdapterConfigFile, ec))
    user_error("{}: no {} (not a LoRA checkpoint: a run with lora.enabled = true writes one)", ck, kAdapterConfigFile);
  return ck;
}

// The base model's directory (config.json, tokenizer files) for its weights' source.
std::string base_dir_of(const std::string& base, const std::string& weights) {
  if (!weights.empty()) return stdfs::is_directory(weights) ? weights : stdfs::path(weights).parent_path().string();
  return base;
}

}  // namespace

MergedLora merge_lora(const std::string& adapter, const std::string& base_arg, const std::string& out) {
  MergedLora r;
  r.adapter_dir = adapter_dir_of(adapter);
  r.out = out;
  nlohmann::json conf;
  const std::string conf_path = r.adapter_dir + "/" + kAdapterConfigFile;
  try {
    conf = nlohmann::json::parse(fs::read_file(conf_path));
  } catch (const nlohmann::json::exception& e) {
    user_error("{}: {}", conf_path, e.what());
  }
  if (conf.value("peft_type", "") != "LORA") user_error("{}: peft_type is not \"LORA\"", conf_path);
  const int rank = conf.value("r", 0);
  const double alpha = conf.value("lora_alpha", 0.0);
  if (rank <= 0) user_error("{}: r must be a positive integer", conf_path);
  if (conf.value("use_dora", false) || conf.value("use_rslora", false))
    user_error("{}: use_dora / use_rslora adapters are not merged by dtrain", conf_path);
  const bool fan_in_fan_out = conf.value("fan_in_fan_out", false);
  const float scaling = float(alpha / double(rank));
  std::string base = base_arg;
  if (base.empty()) {
    const auto it = conf.find("base_model_name_or_path");
    if (it == conf.end() || !it->is_string() || it->get<std::string>().empty())
      user_error("{}: no base_model_name_or_path (give the base model with --base)", conf_path);
    base = it->get<std::string>();
  }
  if (!stdfs::exists(base)) user_error("merge-lora: the base model {} does not exist (give it with --base)", base);
  if (stdfs::exists(out) && !(stdfs::is_directory(out) && stdfs::is_empty(out)))
    user_error("merge-lora: {} exists and is not an empty directory", out);

  const std::string weights = weights_only_file(base);
  const std::string base_ck = weights.empty() ? resolve_checkpoint_dir(base) : "";
  ModelTensors model(weights.empty() ? base_ck : weights);
  r.base = model.origin();
  SafetensorsReader ad(r.adapter_dir + "/" + kAdapterModelFile);

  // every adapter pair onto its base weight: name -> delta in the base tensor's layout
  std::map<std::string, std::vector<float>> delta;
  const std::string prefix = kLoraPrefix, a_suffix = ".lora_A.weight", b_suffix = ".lora_B.weight";
  std::set<std::string> used;
  for (const std::string& n : ad.names()) {
    if (n.size() <= prefix.size() + a_suffix.size() || n.rfind(prefix, 0) != 0 ||
        n.compare(n.size() - a_suffix.size(), a_suffix.size(), a_suffix) != 0)
      continue;
    const std::string module = n.substr(prefix.size(), n.size() - prefix.size() - a_suffix.size());
    const std::string bn = prefix + module + b_suffix;
    if (!ad.has(bn)) user_error("{}: {} without {}", ad.origin(), n, bn);
    used.insert(n);
    used.insert(bn);
    std::string target = module + ".weight";
    // Hugging Face GPT-2 files name GPT2Model's tensors without "transformer." (the hub's gpt2)
    if (!model.has(target) && target.rfind("transformer.", 0) == 0 && model.has(target.substr(12)))
      target = target.substr(12);
    if (!model.has(target)) user_error("{}: {} has no base weight {} in {}", ad.origin(), n, target, r.base);
    const std::vector<int64_t> as = ad.shape(n), bs = ad.shape(bn), ws = model.shape(target);
    if (as.size() != 2 || bs.size() != 2 || as[0] != rank || bs[1] != rank || ws.size() != 2)
      user_error("{}: {} [{}x{}] and {} [{}x{}] are not rank-{} factors", ad.origin(), n, as.size() == 2 ? as[0] : 0,
                 as.size() == 2 ? as[1] : 0, bn, bs.size() == 2 ? bs[0] : 0, bs.size() == 2 ? bs[1] : 0, rank);
    const int64_t in = as[1], outf = bs[0];
    const bool fits = fan_in_fan_out ? (ws[0] == in && ws[1] == outf) : (ws[0] == outf && ws[1] == in);
    if (!fits)
      user_error("{}: {} is [{}x{}], the adapter's update is [{}x{}]{}", r.base, target, ws[0], ws[1], outf, in,
                 fan_in_fan_out ? " (fan_in_fan_out: transposed)" : "");
    const std::vector<float> A = read_f32(ad, n), B = read_f32(ad, bn);
    std::vector<float> d(size_t(in * outf), 0.f);
    // d[o, i] = scaling * sum_k B[o, k] A[k, i] (double sums); fan_in_fan_out stores d^T
    for (int64_t o = 0; o < outf; ++o)
      for (int64_t i = 0; i < in; ++i) {
        double acc = 0;
        for (int64_t k = 0; k < rank; ++k) acc += double(B[size_t(o * rank + k)]) * double(A[size_t(k * in + i)]);
        d[size_t(fan_in_fan_out ? i * outf + o : o * in + i)] = float(double(scaling) * acc);
      }
    delta[target] = std::move(d);
  }
  for (const std::string& n : ad.names())
    if (!used.count(n)) user_error("{}: tensor {} is not a LoRA factor (lora_A / lora_B)", ad.origin(), n);
  if (delta.empty()) user_error("{}: no adapters", ad.origin());

  // the merged model: every base tensor (floats as f32), the adapted ones with their update
  std::vector<ParamStore::Exported> ex;
  for (const std::string& n : model.names()) {
    ParamStore::Exported e;
    e.name = n;
    e.shape = model.shape(n);
    const std::string& dt = model.dtype(n);
    if (dt == "F32" || dt == "BF16" || dt == "F16") {
      std::vector<float> v = read_f32(model, n);
      if (const auto it = delta.find(n); it != delta.end()) {
        for (size_t k = 0; k < v.size(); ++k) v[k] += it->second[k];
        ++r.merged;
      }
      e.dtype = "F32";
      e.bytes.resize(v.size() * 4);
      std::memcpy(e.bytes.data(), v.data(), e.bytes.size());
    } else {
      e.dtype = dt;
      e.bytes.resize(model.nbytes(n));
      model.read(n, e.bytes.data(), e.bytes.size());
    }
    ex.push_back(std::move(e));
  }
  DTRAIN_CHECK(r.merged == int(delta.size()), "merge-lora: {} of {} adapted weights merged", r.merged, delta.size());
  r.tensors = int64_t(ex.size());

  // written into a temporary sibling, then renamed into place
  const std::string tmp = out + ".tmp-merge";
  fs::remove_tree(tmp);
  fs::mkdirs(tmp);
  write_exported(tmp + "/model.safetensors", ex, {{"format", "pt"}, {"producer", "dtrain merge-lora"}});
  const std::string bdir = base_ck.empty() ? base_dir_of(base, weights) : base_ck;
  std::error_code ec;
  if (!stdfs::exists(bdir + "/config.json", ec))
    user_error("merge-lora: {} has no config.json to describe the merged model", bdir);
  for (const char* f : {"config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.json",
                        "tokenizer_config.json", "special_tokens_map.json"})
    if (stdfs::exists(bdir + "/" + f, ec)) fs::write_file(tmp + "/" + f, fs::read_file(bdir + "/" + f));
  if (stdfs::exists(out, ec)) fs::remove_tree(out);
  fs::rename_path(tmp, out);
  return r;
}

}  // namespace dtrain

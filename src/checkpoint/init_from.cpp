#include "checkpoint/init_from.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "core/error.h"
#include "checkpoint/hf_config.h"
#include "session/pipeline.h"
#include "session/task.h"
#include "models/gpt.h"
#include "checkpoint/model_tensors.h"

namespace dtrain {

std::string resolve_checkpoint_dir(const std::string& path);  // eval_cmd.cpp

InitReport init_model_from(Session& s, const std::string& path, bool strict) {
  namespace stdfs = std::filesystem;
  InitReport r;
  if (!stdfs::exists(path)) user_error("model.init_from: {} does not exist", path);
  // weights alone, else a (verified) checkpoint or run directory
  const std::string weights = weights_only_file(path);
  ModelTensors reader(weights.empty() ? resolve_checkpoint_dir(path) : weights);  // ZeRO-3 shards put together
  r.file = reader.origin();

  const std::string hint = " (model.init_strict = false keeps this model's own initialisation for such tensors)";
  std::map<std::string, std::vector<uint8_t>> loaded;  // alive until import_state returns
  std::map<std::string, StateEntry> wanted;  // the model's tensors by name
  // (LoRA: the frozen model's store, not the adapters')
  for (const StateEntry& w : s.model_params().state_entries()) wanted[w.name] = w;
  // Hugging Face GPT-2 files name GPT2Model's tensors without "transformer." (the hub's gpt2)
  auto file_name = [&](const std::string& name) {
    const std::string prefix = "transformer.";
    if (!reader.has(name) && name.rfind(prefix, 0) == 0 && reader.has(name.substr(prefix.size())))
      return name.substr(prefix.size());
    return name;
  };
  std::set<std::string> used;  // the file's names the model's tensors map to
  for (const auto& w : wanted) used.insert(file_name(w.first));
  // a pipeline stage: the other stages' tensors are the full model's, not extra ones
  std::map<std::string, StateEntry> full_names;
  if (s.pipe)
    for (const StateEntry& w : s.pipe->full_layout().state_entries()) {
      used.insert(file_name(w.name));
      full_names[w.name] = w;
    }
  // what the file offers for the model's tensor: its bytes in the model's dtype, or nothing
  // (the model's own value is kept when not strict)
  TensorLookup lookup = [&](const std::string& model_name) -> std::optional<ImportTensor> {
    const StateEntry& w = wanted.at(model_name);
    const std::string name = file_name(model_name);
    auto refuse = [&](const std::string& why) -> std::optional<ImportTensor> {
      if (strict) user_error("{}: tensor '{}' {}{}", r.file, name, why, hint);
      r.kept.push_back(model_name);
      return std::nullopt;
    };
    if (!reader.has(name)) return refuse(fmt::format("is missing (this model has {} {})", w.dtype, fmt::format("[{}]", fmt::join(w.shape, ", "))));
    const std::string& dt = reader.dtype(name);
    const std::vector<int64_t> shape = reader.shape(name);
    const bool widen = w.dtype == "F32" && (dt == "BF16" || dt == "F16");
    if ((dt != w.dtype && !widen) || shape != w.shape)
      return refuse(fmt::format("is {} {}, this model's is {} {}", dt, fmt::format("[{}]", fmt::join(shape, ", ")), w.dtype, fmt::format("[{}]", fmt::join(w.shape, ", "))));
    auto& bytes = loaded[name];
    if (widen) {
      const std::vector<float> f = read_f32(reader, name);
      bytes.resize(f.size() * 4);
      std::memcpy(bytes.data(), f.data(), bytes.size());
    } else {
      bytes.resize(reader.nbytes(name));
      reader.read(name, bytes.data(), bytes.size());
    }
    ++r.loaded;
    return ImportTensor{w.dtype, w.shape, bytes.data(), bytes.size()};
  };
  // What the file holds beyond the model. Not weights: GPT-2's causal-mask buffers, and the
  // LM head when the model ties it to the token embedding (GPT-2's wte, a tied Llama's
  // embed_tokens).
  const auto& all_names = s.pipe ? full_names : wanted;
  const bool gpt2 = all_names.count("transformer.wte.weight") > 0;
  const bool llama = all_names.count("model.embed_tokens.weight") > 0;
  const auto not_weights = [&](const std::string& n) {
    if (gpt2) return (is_gpt2_mask_buffer(n) || n == "lm_head.weight") && !all_names.count(n);
    return llama && n == "lm_head.weight" && !all_names.count(n);
  };
  // A Hugging Face Llama / Qwen2 directory: its config.json must describe this model (the
  // weights do not show the rotary base, its scaling or the norm epsilon)
  if (llama && !weights.empty()) {
    const std::string dir =
        stdfs::is_directory(weights) ? weights : stdfs::path(weights).parent_path().string();
    MoeConfig hmoe;
    if (const auto hc = read_hf_llama_config(dir.empty() ? "." : dir, &hmoe)) {
      const GptSpec spec = gpt_spec_from(s.cfg);
      const LlamaConfig& m = spec.llama;
      const std::string where = (dir.empty() ? "." : dir) + "/config.json";
      const ModelSection& k = s.cfg.model;
      auto same = [&](const char* field, const auto& file_value, const auto& model_value, std::string_view key) {
        if (!(file_value == model_value))
          user_error("{}: {} {} but this model has {} ({})", where, field, file_value, model_value, key);
      };
      same("model_type", hc->model_type, m.model_type, s.cfg.key_of(k.arch));
      same("vocab_size", hc->vocab_size, m.vocab_size, s.cfg.key_of(k.vocab_size));
      same("hidden_size", hc->hidden_size, m.hidden_size, s.cfg.key_of(k.n_embd));
      same("intermediate_size", hc->intermediate_size, m.intermediate_size, s.cfg.key_of(k.intermediate_size));
      same("num_hidden_layers", hc->num_hidden_layers, m.num_hidden_layers, s.cfg.key_of(k.n_layer));
      same("num_attention_heads", hc->num_attention_heads, m.num_attention_heads, s.cfg.key_of(k.n_head));
      same("num_key_value_heads", hc->kv_heads(), m.kv_heads(), s.cfg.key_of(k.n_kv_head));
      same("head_dim", hc->head_size(), m.head_size(), s.cfg.key_of(k.head_dim));
      same("rms_norm_eps", hc->rms_norm_eps, m.rms_norm_eps, s.cfg.key_of(k.rms_norm_eps));
      same("rope_theta", hc->rope_theta, m.rope_theta, s.cfg.key_of(k.rope_theta));
      same("rope_scaling.rope_type", hc->rope_scaling.rope_type, m.rope_scaling.rope_type, s.cfg.key_of(k.rope_scaling));
      if (m.rope_scaling.rope_type == "llama3") {
        same("rope_scaling.factor", hc->rope_scaling.factor, m.rope_scaling.factor, s.cfg.key_of(k.rope_factor));
        same("rope_scaling.low_freq_factor", hc->rope_scaling.low_freq_factor, m.rope_scaling.low_freq_factor,
             s.cfg.key_of(k.rope_low_freq_factor));
        same("rope_scaling.high_freq_factor", hc->rope_scaling.high_freq_factor, m.rope_scaling.high_freq_factor,
             s.cfg.key_of(k.rope_high_freq_factor));
        same("rope_scaling.original_max_position_embeddings", hc->rope_scaling.original_max_position_embeddings,
             m.rope_scaling.original_max_position_embeddings, s.cfg.key_of(k.rope_original_max_positions));
      }
      same("tie_word_embeddings", hc->tie_word_embeddings, m.tie_word_embeddings, s.cfg.key_of(k.tie_word_embeddings));
      same("attention_bias", hc->attention_bias, m.attention_bias, s.cfg.key_of(k.attention_bias));
      same("mlp_bias", hc->mlp_bias, m.mlp_bias, s.cfg.key_of(k.mlp_bias));
      // the experts (the weights show their number and widths, not the routing)
      same("num_local_experts", hmoe.num_experts, spec.moe.num_experts, s.cfg.key_of(k.num_local_experts));
      if (hmoe.enabled()) {
        same("num_experts_per_tok", hmoe.top_k, spec.moe.top_k, s.cfg.key_of(k.num_experts_per_tok));
        same("norm_topk_prob", hmoe.norm_topk, spec.moe.norm_topk, s.cfg.key_of(k.norm_topk_prob));
        same("decoder_sparse_step", hmoe.every, spec.moe.every, s.cfg.key_of(k.moe_every));
      }
      if (m.max_position_embeddings > hc->max_position_embeddings)
        user_error("{}: max_position_embeddings {} but this model's {} is {}", where, hc->max_position_embeddings,
                   s.cfg.key_of(k.block_size), m.max_position_embeddings);
    }
  }
  // A Hugging Face GPT-2 directory: its config.json must describe the model dtrain builds (the
  // weights alone do not show an untied head, another activation or another attention scaling).
  if (gpt2 && !weights.empty())
    read_hf_gpt2_config(stdfs::path(weights).parent_path().string());
  // a separate LM head must be the tied copy of wte / embed_tokens, or the file is another model
  if (const std::string wte = file_name(gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight");
      not_weights("lm_head.weight") && reader.has("lm_head.weight") && reader.has(wte) &&
      read_f32(reader, "lm_head.weight") != read_f32(reader, wte))
    user_error("{}: lm_head.weight differs from {} (this model ties the LM head to it)", r.file, wte);
  for (const auto& n : reader.names()) {
    if (used.count(n) || not_weights(n)) continue;
    if (strict) user_error("{}: tensor '{}' does not exist in this model{}", r.file, n, hint);
    r.ignored.push_back(n);
  }
  s.model_params().import_state(lookup, r.file, /*keep_missing=*/!strict);
  if (r.loaded == 0) user_error("model.init_from: no tensor of {} fits this model (a different model?)", r.file);
  return r;
}

std::string weights_only_file(const std::string& path) {
  namespace stdfs = std::filesystem;
  std::error_code ec;
  if (stdfs::is_regular_file(path, ec)) return path;
  const std::string model = path + "/model.safetensors";
  if (stdfs::is_directory(path, ec) && stdfs::exists(model, ec) && !stdfs::exists(path + "/SHA256SUMS", ec))
    return model;
  // Hugging Face's sharded weights (save_pretrained's max_shard_size): the directory itself
  if (stdfs::is_directory(path, ec) && stdfs::exists(path + "/model.safetensors.index.json", ec) &&
      !stdfs::exists(path + "/SHA256SUMS", ec))
    return path;
  return "";
}

}  // namespace dtrain

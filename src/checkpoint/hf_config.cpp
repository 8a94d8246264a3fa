#include "checkpoint/hf_config.h"

#include <cmath>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fsutil.h"
#include "models/gpt.h"

namespace dtrain {

std::optional<HfGpt2Config> read_hf_gpt2_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return std::nullopt;
  try {
    const nlohmann::json j = nlohmann::json::parse(fs::read_file(path));
    const std::string type = j.value("model_type", "gpt2");
    if (type != "gpt2") user_error("{}: model_type \"{}\": expected \"gpt2\"", path, type);
    const std::string act = j.value("activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      user_error("{}: activation_function \"{}\": dtrain's GPT-2 uses the tanh GELU (gelu_new)", path, act);
    const double eps = j.value("layer_norm_epsilon", 1e-5);
    if (std::abs(eps - 1e-5) > 1e-12) user_error("{}: layer_norm_epsilon {}: dtrain's GPT-2 uses 1e-5", path, eps);
    if (!j.value("tie_word_embeddings", true))
      user_error("{}: tie_word_embeddings false: dtrain's GPT-2 ties the LM head to wte", path);
    if (!j.value("scale_attn_weights", true))
      user_error("{}: scale_attn_weights false: dtrain's GPT-2 scales the attention scores by 1/sqrt(head size)", path);
    if (j.value("scale_attn_by_inverse_layer_idx", false))
      user_error("{}: scale_attn_by_inverse_layer_idx true: dtrain's GPT-2 does not scale the scores by layer", path);
    HfGpt2Config c;
    c.n_head = j.at("n_head").get<int64_t>();
    c.n_layer = j.value("n_layer", int64_t(0));
    c.n_embd = j.value("n_embd", int64_t(0));
    c.n_positions = j.value("n_positions", j.value("n_ctx", int64_t(0)));
    c.vocab_size = j.value("vocab_size", int64_t(0));
    if (c.n_head < 1) user_error("{}: n_head {}: expected a positive integer", path, c.n_head);
    return c;
  } catch (const nlohmann::json::exception& e) {
    user_error("{}: {}", path, e.what());
  }
}

bool is_gpt2_mask_buffer(const std::string& name) {
  auto ends = [&](const std::string& suf) {
    return name.size() >= suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  return ends(".attn.bias") || ends(".attn.masked_bias");
}

bool is_hf_llama_type(const std::string& t) {
  return t == "llama" || t == "qwen2" || t == "mixtral" || t == "qwen2_moe";
}

std::string hf_llama_config(const GptSpec& g) {
  const LlamaConfig& c = g.llama;
  const bool qwen2 = c.model_type == "qwen2";
  const MoeConfig& m = g.moe;
  if (m.enabled()) {  // MixtralConfig / Qwen2MoeConfig (the recipe rules keep a llama MoE Mixtral's)
    nlohmann::ordered_json j = {
        {"architectures", {qwen2 ? "Qwen2MoeForCausalLM" : "MixtralForCausalLM"}},
        {"model_type", qwen2 ? "qwen2_moe" : "mixtral"},
        {"vocab_size", c.vocab_size},
        {"hidden_size", c.hidden_size},
        {"intermediate_size", c.intermediate_size},
        {"num_hidden_layers", c.num_hidden_layers},
        {"num_attention_heads", c.num_attention_heads},
        {"num_key_value_heads", c.kv_heads()},
        {"hidden_act", "silu"},
        {"max_position_embeddings", c.max_position_embeddings},
        {"initializer_range", c.initializer_range},
        {"rms_norm_eps", c.rms_norm_eps},
        {"use_cache", true},
        {"tie_word_embeddings", c.tie_word_embeddings},
        {"rope_theta", c.rope_theta},
        {"attention_dropout", 0.0},
        {"sliding_window", nullptr},
        {qwen2 ? "num_experts" : "num_local_experts", m.num_experts},
        {"num_experts_per_tok", m.top_k},
        {"output_router_logits", m.aux_loss_coef > 0},
        {"router_aux_loss_coef", m.aux_loss_coef},
    };
    if (qwen2) {
      j["use_sliding_window"] = false;
      j["max_window_layers"] = c.num_hidden_layers;
      j["rope_scaling"] = nullptr;
      j["decoder_sparse_step"] = m.every;
      j["moe_intermediate_size"] = m.expert_intermediate > 0 ? m.expert_intermediate : c.intermediate_size;
      j["shared_expert_intermediate_size"] = m.shared_intermediate;
      j["norm_topk_prob"] = m.norm_topk;
      j["mlp_only_layers"] = nlohmann::ordered_json::array();
    } else {
      j["router_jitter_noise"] = 0.0;
    }
    j["torch_dtype"] = "float32";
    return j.dump(2) + "\n";
  }
  nlohmann::ordered_json j = {
      {"architectures", {qwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", c.model_type},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.kv_heads()},
  };
  if (!qwen2) j["head_dim"] = c.head_size();  // Qwen2Config has none: hidden_size / heads
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["initializer_range"] = c.initializer_range;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["use_cache"] = true;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.rope_type == "llama3")
    j["rope_scaling"] = nlohmann::ordered_json{
        {"rope_type", "llama3"},
        {"factor", c.rope_scaling.factor},
        {"low_freq_factor", c.rope_scaling.low_freq_factor},
        {"high_freq_factor", c.rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  else
    j["rope_scaling"] = nullptr;
  j["attention_dropout"] = 0.0;
  if (qwen2) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_hidden_layers;
  } else {
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = c.mlp_bias;
    j["pretraining_tp"] = 1;
  }
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}


namespace {

// config.json's fields that do not change what the model computes: read by nothing (naming,
// generation defaults, the dtype the file was saved in: the tensors' own dtypes are read) or
// checked below to be harmless. Any other field is refused, naming it.
const std::set<std::string>& llama_ignored_fields() {
  static const std::set<std::string> f = {
      "_name_or_path", "architectures", "transformers_version", "torch_dtype", "bos_token_id", "eos_token_id",
      "pad_token_id", "use_cache", "initializer_range", "pretraining_tp", "max_window_layers", "sliding_window",
      "use_sliding_window", "tokenizer_class", "return_dict", "output_attentions", "output_hidden_states"};
  return f;
}

}  // namespace

std::optional<LlamaConfig> read_hf_llama_config(const std::string& dir, MoeConfig* moe) {
  const std::string path = dir + "/config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return std::nullopt;
  try {
    const nlohmann::json j = nlohmann::json::parse(fs::read_file(path));
    if (!j.is_object()) user_error("{}: expected a JSON object", path);
    LlamaConfig c;
    const std::string hf_type = j.value("model_type", std::string());
    if (!is_hf_llama_type(hf_type))
      user_error("{}: model_type \"{}\": expected \"llama\", \"qwen2\", \"mixtral\" or \"qwen2_moe\"", path, hf_type);
    const bool mixtral = hf_type == "mixtral", qwen2_moe = hf_type == "qwen2_moe";
    const std::string type = mixtral ? "llama" : qwen2_moe ? "qwen2" : hf_type;  // the family's switches
    c.model_type = type;
    auto integer = [&](const char* key) -> int {
      if (!j.contains(key)) user_error("{}: {} is missing", path, key);
      const int64_t v = j.at(key).get<int64_t>();
      if (v < 1 || v > (int64_t(1) << 31) - 1) user_error("{}: {} {}: expected a positive integer", path, key, v);
      return int(v);
    };
    auto number = [&](const char* key, double def) {
      return j.contains(key) && !j.at(key).is_null() ? j.at(key).get<double>() : def;
    };
    auto flag = [&](const char* key) { return j.contains(key) && !j.at(key).is_null() && j.at(key).get<bool>(); };
    std::set<std::string> read = {"model_type"};
    auto mark = [&](std::initializer_list<const char*> keys) {
      for (const char* k : keys) read.insert(k);
    };
    c.vocab_size = integer("vocab_size");
    c.hidden_size = integer("hidden_size");
    c.intermediate_size = integer("intermediate_size");
    c.num_hidden_layers = integer("num_hidden_layers");
    c.num_attention_heads = integer("num_attention_heads");
    c.max_position_embeddings = integer("max_position_embeddings");
    c.num_key_value_heads = j.contains("num_key_value_heads") && !j.at("num_key_value_heads").is_null()
                                ? integer("num_key_value_heads")
                                : c.num_attention_heads;
    mark({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "max_position_embeddings", "num_key_value_heads"});
    if (hf_type == "llama" && j.contains("head_dim") && !j.at("head_dim").is_null()) c.head_dim = integer("head_dim");
    if (hf_type == "llama") mark({"head_dim"});  // qwen2: hidden_size / num_attention_heads (Qwen2Config has none)
    if (mixtral || qwen2_moe) {  // the experts (nn/moe.h)
      if (!moe) user_error("{}: model_type \"{}\": a mixture of experts is not read here", path, hf_type);
      MoeConfig m;
      m.num_experts = integer(mixtral ? "num_local_experts" : "num_experts");
      m.top_k = integer("num_experts_per_tok");
      m.aux_loss_coef = number("router_aux_loss_coef", 0.001);
      mark({mixtral ? "num_local_experts" : "num_experts", "num_experts_per_tok", "router_aux_loss_coef",
            "output_router_logits"});
      if (mixtral) {
        if (const double jn = number("router_jitter_noise", 0.0); jn != 0.0)
          user_error("{}: router_jitter_noise {}: dtrain's router has no jitter", path, jn);
        mark({"router_jitter_noise"});
      } else {
        m.every = j.contains("decoder_sparse_step") ? integer("decoder_sparse_step") : 1;
        m.expert_intermediate = integer("moe_intermediate_size");
        m.shared_intermediate = j.value("shared_expert_intermediate_size", 0);
        m.norm_topk = flag("norm_topk_prob");
        if (j.contains("mlp_only_layers") && !j.at("mlp_only_layers").is_null() && !j.at("mlp_only_layers").empty())
          user_error("{}: mlp_only_layers {}: dtrain places the experts by decoder_sparse_step alone", path,
                     j.at("mlp_only_layers").dump());
        mark({"decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
              "mlp_only_layers"});
      }
      *moe = m;
    } else if (moe) {
      *moe = MoeConfig{};
    }
    c.rms_norm_eps = number("rms_norm_eps", 1e-6);
    c.rope_theta = number("rope_theta", 10000.0);
    c.tie_word_embeddings = flag("tie_word_embeddings");
    mark({"rms_norm_eps", "rope_theta", "tie_word_embeddings"});
    if (type == "llama") {
      c.attention_bias = flag("attention_bias");
      c.mlp_bias = flag("mlp_bias");
      mark({"attention_bias", "mlp_bias"});
    }
    c.initializer_range = number("initializer_range", 0.02);
    if (const std::string act = j.value("hidden_act", std::string("silu")); act != "silu")
      user_error("{}: hidden_act \"{}\": dtrain's Llama family uses silu (SwiGLU)", path, act);
    if (const double p = number("attention_dropout", 0.0); p != 0.0)
      user_error("{}: attention_dropout {}: dtrain trains without dropout", path, p);
    mark({"hidden_act", "attention_dropout"});
    if (mixtral && j.contains("sliding_window") && !j.at("sliding_window").is_null())
      user_error("{}: sliding_window {}: dtrain's attention is causal over the whole context (no sliding_window)", path,
                 j.at("sliding_window").dump());
    if (type == "qwen2" && flag("use_sliding_window"))
      user_error("{}: use_sliding_window true: dtrain's attention is causal over the whole context (no sliding_window)",
                 path);
    if (j.contains("pretraining_tp") && !j.at("pretraining_tp").is_null() && j.at("pretraining_tp").get<int64_t>() < 1)
      user_error("{}: pretraining_tp {}: expected a positive integer", path, j.at("pretraining_tp").dump());
    if (j.contains("rope_scaling") && !j.at("rope_scaling").is_null()) {
      const nlohmann::json& r = j.at("rope_scaling");
      if (!r.is_object()) user_error("{}: rope_scaling: expected an object or null", path);
      const std::string rt = r.value("rope_type", r.value("type", std::string("default")));
      if (rt == "llama3") {
        c.rope_scaling.rope_type = "llama3";
        for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
          if (!r.contains(k)) user_error("{}: rope_scaling.{} is missing (rope_type llama3)", path, k);
        c.rope_scaling.factor = r.at("factor").get<double>();
        c.rope_scaling.low_freq_factor = r.at("low_freq_factor").get<double>();
        c.rope_scaling.high_freq_factor = r.at("high_freq_factor").get<double>();
        c.rope_scaling.original_max_position_embeddings = r.at("original_max_position_embeddings").get<int>();
        for (const auto& [k, v] : r.items())
          if (k != "rope_type" && k != "type" && k != "factor" && k != "low_freq_factor" && k != "high_freq_factor" &&
              k != "original_max_position_embeddings")
            user_error("{}: rope_scaling.{}: not a field of llama3's rope scaling that dtrain computes", path, k);
      } else if (rt != "default") {
        user_error("{}: rope_scaling.rope_type \"{}\": dtrain computes \"default\" and \"llama3\" only", path, rt);
      }
    }
    mark({"rope_scaling"});
    for (const auto& [k, v] : j.items())
      if (!read.count(k) && !llama_ignored_fields().count(k))
        user_error("{}: {}: a field dtrain does not build (its Llama family reads {}; it ignores {})", path, k,
                   fmt::format("{}", fmt::join(read, ", ")), fmt::format("{}", fmt::join(llama_ignored_fields(), ", ")));
    return c;
  } catch (const nlohmann::json::exception& e) {
    user_error("{}: {}", path, e.what());
  }
}

std::string hf_model_type(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return "";
  try {
    const nlohmann::json j = nlohmann::json::parse(fs::read_file(path));
    return j.is_object() ? j.value("model_type", std::string("gpt2")) : std::string("gpt2");
  } catch (const nlohmann::json::exception& e) {
    user_error("{}: {}", path, e.what());
  }
}

std::string hf_llama_model_toml(const LlamaConfig& c, const MoeConfig& m) {
  auto real = [](double v) {  // a TOML float, never an integer literal
    std::string s = fmt::format("{}", v);
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
    return s;
  };
  std::string t = fmt::format(
      "[model]\nkind = \"gpt\"\narch = \"{}\"\nn_layer = {}\nn_head = {}\nn_embd = {}\nblock_size = {}\nvocab_size = {}\n"
      "n_kv_head = {}\nintermediate_size = {}\nrms_norm_eps = {}\nrope_theta = {}\ntie_word_embeddings = {}\n",
      c.model_type, c.num_hidden_layers, c.num_attention_heads, c.hidden_size, c.max_position_embeddings,
      c.vocab_size, c.kv_heads(), c.intermediate_size, real(c.rms_norm_eps), real(c.rope_theta),
      c.tie_word_embeddings);
  if (c.model_type == "llama") {
    if (c.head_dim > 0 && int64_t(c.head_dim) * c.num_attention_heads != c.hidden_size)
      t += fmt::format("head_dim = {}\n", c.head_dim);
    t += fmt::format("attention_bias = {}\nmlp_bias = {}\n", c.attention_bias, c.mlp_bias);
  }
  if (c.rope_scaling.rope_type == "llama3")
    t += fmt::format(
        "rope_scaling = \"llama3\"\nrope_factor = {}\nrope_low_freq_factor = {}\nrope_high_freq_factor = {}\n"
        "rope_original_max_positions = {}\n",
        real(c.rope_scaling.factor), real(c.rope_scaling.low_freq_factor), real(c.rope_scaling.high_freq_factor),
        c.rope_scaling.original_max_position_embeddings);
  if (m.enabled()) {
    t += fmt::format("num_local_experts = {}\nnum_experts_per_tok = {}\nrouter_aux_loss_coef = {}\n", m.num_experts,
                     m.top_k, real(m.aux_loss_coef));
    if (c.model_type == "qwen2")
      t += fmt::format("moe_every = {}\nmoe_intermediate_size = {}\nshared_expert_intermediate_size = {}\n"
                       "norm_topk_prob = {}\n",
                       m.every, m.expert_intermediate, m.shared_intermediate, m.norm_topk);
  }
  return t;
}

}  // namespace dtrain

#include "checkpoint/hf_config.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fsutil.h"

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

}  // namespace dtrain

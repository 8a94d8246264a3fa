#pragma once
// Shared by the Llama-family tests: config.json <-> LlamaConfig (the keys the tests use, Hugging
// Face's names) and one training step of a model (forward, mean next-token cross-entropy,
// backward) with its logits and loss read back.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/buffer.h"
#include "core/rng.h"
#include "models/llama.h"
#include "nn/loss.h"

namespace dtrain::testing {

inline nlohmann::json llama_config_json(const LlamaConfig& c) {
  nlohmann::json j = {{"model_type", c.model_type},
                      {"vocab_size", c.vocab_size},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.kv_heads()},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"rope_theta", c.rope_theta},
                      {"tie_word_embeddings", c.tie_word_embeddings},
                      {"initializer_range", c.initializer_range}};
  if (c.model_type == "llama") {
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = c.mlp_bias;
    j["head_dim"] = c.head_size();
  }
  if (c.rope_scaling.rope_type != "default")
    j["rope_scaling"] = {{"rope_type", c.rope_scaling.rope_type},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  return j;
}

inline LlamaConfig llama_config_from_json(const nlohmann::json& j) {
  LlamaConfig c;
  c.model_type = j.at("model_type").get<std::string>();
  c.vocab_size = j.at("vocab_size");
  c.hidden_size = j.at("hidden_size");
  c.intermediate_size = j.at("intermediate_size");
  c.num_hidden_layers = j.at("num_hidden_layers");
  c.num_attention_heads = j.at("num_attention_heads");
  c.num_key_value_heads = j.value("num_key_value_heads", 0);
  c.head_dim = j.value("head_dim", 0);
  c.max_position_embeddings = j.at("max_position_embeddings");
  c.rms_norm_eps = j.value("rms_norm_eps", 1e-6);
  c.rope_theta = j.value("rope_theta", 10000.0);
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.attention_bias = j.value("attention_bias", false);
  c.mlp_bias = j.value("mlp_bias", false);
  c.initializer_range = j.value("initializer_range", 0.02);
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const auto& r = j["rope_scaling"];
    c.rope_scaling.rope_type = r.at("rope_type").get<std::string>();
    c.rope_scaling.factor = r.at("factor");
    c.rope_scaling.low_freq_factor = r.at("low_freq_factor");
    c.rope_scaling.high_freq_factor = r.at("high_freq_factor");
    c.rope_scaling.original_max_position_embeddings = r.at("original_max_position_embeddings");
  }
  return c;
}

struct LlamaStep {
  std::vector<float> logits;  // [B*T, vocab_size] (the padded columns dropped)
  double loss = 0;            // mean over the B*T tokens
};

// One forward + mean cross-entropy + backward (gradients accumulate into ps's grads).
// positions: empty for 0..T-1.
inline LlamaStep llama_step(Backend& be, Arena& arena, GptModel& model, const std::vector<int32_t>& ids,
                            const std::vector<int32_t>& targets, int64_t B, int64_t T,
                            const std::vector<int32_t>& positions = {}) {
  Ctx ctx{be, arena, true, {}, {}};
  Tensor tid = arena.alloc(DType::I32, Shape{B, T}), ttg = arena.alloc(DType::I32, Shape{B * T});
  be.copy_from_host(tid.data, ids.data(), ids.size() * 4);
  be.copy_from_host(ttg.data, targets.data(), targets.size() * 4);
  if (auto* l = dynamic_cast<LlamaModel*>(&model)) {
    Tensor pos;
    if (!positions.empty()) {
      pos = arena.alloc(DType::I32, Shape{B, T});
      be.copy_from_host(pos.data, positions.data(), positions.size() * 4);
    }
    l->set_positions(pos);
  }
  Tensor logits = model.forward(ctx, tid);
  GptLoss loss;
  Tensor losses = loss.forward(ctx, logits, ttg, model.spec().vocab_size);
  LlamaStep out;
  out.loss = mean_loss(be, losses);
  model.backward(ctx, loss.backward());
  std::vector<float> lg;
  copy_to_host_f32(be, arena, logits, lg);
  const int64_t Vp = logits.dim(1), V = model.spec().vocab_size;
  for (int64_t i = 0; i < B * T; ++i) out.logits.insert(out.logits.end(), lg.begin() + i * Vp, lg.begin() + i * Vp + V);
  return out;
}

// B sequences of T random token ids and as many random targets in [0, vocab), from `seed`.
struct RandomBatch {
  int64_t B = 2, T = 12;
  std::vector<int32_t> ids, tgt;
  RandomBatch(int vocab, int64_t t, uint64_t seed = 9) : T(t) {
    Rng r(seed);
    for (int64_t i = 0; i < B * T; ++i) ids.push_back(int32_t(r.below(uint64_t(vocab))));
    for (int64_t i = 0; i < B * T; ++i) tgt.push_back(int32_t(r.below(uint64_t(vocab))));
  }
};

}  // namespace dtrain::testing

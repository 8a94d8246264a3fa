// The recipe's rules over more than one key (config_cross_check) and the key reference
// (config_reference, docs/config.md); the keys themselves are schema.cpp's table.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "core/log.h"
#include "config/config.h"
#include "config/toml_values.h"

namespace dtrain {

namespace {

// lora.* (read only with lora.enabled): the targets must be the family's modules; what is not
// built yet is refused naming its key.
CrossCheckFailure lora_check(const Config& c) {
  if (!c.b("lora.enabled")) return {};
  if (c.s("model.kind") != "gpt")
    return {"lora.enabled", fmt::format("LoRA adapts a GPT-2 or Llama-family model; model.kind = \"{}\"", c.s("model.kind"))};
  if (c.s("model.init_from").empty())
    return {"lora.enabled", "needs model.init_from (the frozen model the adapters are trained on: a dtrain checkpoint "
                            "or a Hugging Face model directory)"};
  const std::string& arch = c.s("model.arch");
  const std::vector<std::string>& known = lora_family_modules(arch);
  const std::vector<std::string> targets = lora_targets(c.s("lora.target_modules"));
  if (targets.empty())
    return {"lora.target_modules", fmt::format("required with lora.enabled: comma-separated module names of {} ({})",
                                               arch, fmt::join(known, ", "))};
  for (const std::string& t : targets)
    if (std::find(known.begin(), known.end(), t) == known.end())
      return {"lora.target_modules", fmt::format("\"{}\" is not a module of model.arch = \"{}\" (expected some of {})", t,
                                                 arch, fmt::join(known, ", "))};
  if (c.f("lora.dropout") != 0.0)
    return {"lora.dropout", fmt::format("{} is not implemented yet (only 0)", c.f("lora.dropout"))};
  if (c.b("parallel.sequence") && c.i("parallel.tensor") > 1)
    return {"parallel.sequence", "true does not work with lora.enabled yet (tensor parallelism without it does)"};
  if (c.i("parallel.pipeline") > 1)
    return {"parallel.pipeline", fmt::format("{} does not work with lora.enabled yet (use data, ZeRO or tensor "
                                             "parallelism)", c.i("parallel.pipeline"))};
  return {};
}

}  // namespace

// Rules that involve more than one key. The first failure wins.
CrossCheckFailure config_cross_check(const Config& c) {
  // run.name is one directory under run.out_dir: "a/../b" or ".." would reach another run's
  if (const std::string& name = c.s("run.name");
      name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      log::printable(name) != name)
    return {"run.name", fmt::format("expected a directory name (one line of UTF-8, no '/', not '.' or '..'), got '{}'",
                                    log::printable(name))};
  const std::string& dk = c.s("data.kind");
  if (dk != "synthetic" && c.s("data.path").empty())
    return {"data.path", fmt::format("required when data.kind = \"{}\" (the dataset directory)", dk)};
  if (dk == "sft" && c.s("model.kind") != "gpt")
    return {"data.kind", fmt::format("\"sft\" (fine-tuning shards) trains a GPT-family model; model.kind = \"{}\"",
                                     c.s("model.kind"))};
  for (const char* k : {"data.packing", "data.overflow"})
    if (dk != "sft" && c.is_set(k) && (k == std::string_view("data.packing") ? c.b(k) : c.s(k) != "refuse"))
      return {k, fmt::format("applies to data.kind = \"sft\" (fine-tuning examples); data.kind = \"{}\"", dk)};
  if (c.i("train.max_steps") == 0 && c.f("train.epochs") == 0.0)
    return {c.is_set("train.epochs") ? "train.epochs" : "train.max_steps",
            "train.max_steps and train.epochs are both 0; set one of them"};
  auto ms = c.iv("schedule.milestones");
  for (size_t i = 1; i < ms.size(); ++i)
    if (ms[i] <= ms[i - 1])
      return {"schedule.milestones",
              fmt::format("expected strictly increasing steps, got {} after {}", ms[i], ms[i - 1])};
  if (c.s("schedule.kind") == "multistep" && ms.empty())
    return {"schedule.milestones", "required (non-empty) when schedule.kind = \"multistep\""};
  auto mean = c.fv("data.mean"), sd = c.fv("data.std");
  if (mean.size() != sd.size())
    return {c.is_set("data.std") ? "data.std" : "data.mean",
            fmt::format("data.mean has {} values but data.std has {}; give both, per channel",
                        mean.size(), sd.size())};
  if (!mean.empty() && mean.size() != 1 && int64_t(mean.size()) != c.i("model.in_channels"))
    return {"data.mean", fmt::format("expected 1 or model.in_channels = {} values, got {}",
                                     c.i("model.in_channels"), mean.size())};
  if (const std::string& em = c.s("expect.metric"); !em.empty()) {
    const std::string& kind = c.s("model.kind");
    const bool fits = em == "eval_loss" || (kind == "resnet" && (em == "eval_accuracy" || em == "eval_accuracy_top5")) ||
                      (kind == "unet" && (em == "eval_miou" || em == "eval_dice" || em == "eval_pixel_accuracy"));
    if (!fits)
      return {"expect.metric", fmt::format("\"{}\" is not evaluated for model.kind = \"{}\" (it reports {})", em, kind,
                                           kind == "resnet" ? "eval_accuracy, eval_accuracy_top5, eval_loss"
                                           : kind == "unet" ? "eval_miou, eval_dice, eval_pixel_accuracy, eval_loss"
                                                            : "eval_loss")};
    if (!c.is_set("expect.target")) return {"expect.target", "required when expect.metric is set"};
  }
  // model.arch: the llama / qwen2 keys mean nothing to GPT-2 (which always ties its head) or to
  // another model kind; a recipe that sets one for them is wrong, not ignored
  const std::string& arch = c.s("model.arch");
  if (arch != "gpt2" && c.s("model.kind") != "gpt")
    return {"model.arch", fmt::format("\"{}\" is a GPT architecture; model.kind = \"{}\"", arch, c.s("model.kind"))};
  // set to something else than its default (a resolved config.toml writes every key, at its
  // default when the recipe did not give it)
  auto changed = [&](std::string_view k) {
    if (!c.is_set(k)) return false;
    const KeySpec& ks = config_schema()[size_t(config_schema_index(k))];
    const std::string d(ks.def);
    switch (ks.type) {
      case ValueType::Int: return c.i(k) != std::stoll(d);
      case ValueType::Float: return c.f(k) != std::stod(d);
      case ValueType::Bool: return c.b(k) != (d == "true");
      case ValueType::String: return c.s(k) != d.substr(1, d.size() - 2);
      default: return true;
    }
  };
  static const char* const llama_keys[] = {
      "model.n_kv_head", "model.head_dim", "model.intermediate_size", "model.rms_norm_eps", "model.rope_theta",
      "model.rope_scaling", "model.rope_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
      "model.rope_original_max_positions", "model.tie_word_embeddings", "model.attention_bias", "model.mlp_bias"};
  if (arch == "gpt2")
    for (const char* k : llama_keys)
      if (changed(k))
        return {k, fmt::format("a llama / qwen2 key: set model.arch = \"llama\" or \"qwen2\" (model.arch = \"gpt2\"{})",
                               std::string_view(k) == "model.tie_word_embeddings" ? " always ties its LM head" : "")};
  if (c.s("model.rope_scaling") != "llama3")
    for (const char* k : {"model.rope_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
                          "model.rope_original_max_positions"})
      if (changed(k)) return {k, "only with model.rope_scaling = \"llama3\""};
  if (arch == "qwen2")
    for (const char* k : {"model.attention_bias", "model.mlp_bias"})
      if (changed(k))
        return {k, "a llama key: qwen2 always has q_proj, k_proj and v_proj biases and no other (set neither)"};
  int64_t nh = c.i("model.n_head"), ne = c.i("model.n_embd"), kv = c.i("model.n_kv_head"), hd = c.i("model.head_dim");
  if (nh > 0 && kv > 0 && nh % kv != 0)
    return {"model.n_kv_head", fmt::format("expected a divisor of model.n_head = {}, got {}", nh, kv)};
  if (hd % 2 != 0) return {"model.head_dim", fmt::format("expected an even size (rotary positions), got {}", hd)};
  if (arch == "qwen2" && hd > 0 && !(nh > 0 && ne > 0 && ne == nh * hd))
    return {"model.head_dim", "qwen2's head size is model.n_embd / model.n_head (Qwen2Config has no head_dim): "
                              "leave it 0 and set model.n_embd and model.n_head"};
  if (c.s("model.rope_scaling") == "llama3" && !(c.f("model.rope_high_freq_factor") > c.f("model.rope_low_freq_factor")))
    return {"model.rope_high_freq_factor", fmt::format("expected more than model.rope_low_freq_factor = {}, got {}",
                                                       c.f("model.rope_low_freq_factor"), c.f("model.rope_high_freq_factor"))};
  if (nh > 0 && ne > 0 && ne % nh != 0 && !(arch == "llama" && hd > 0))
    return {"model.n_embd",
            fmt::format("expected a multiple of model.n_head = {}, got {}", nh, ne)};
  // mixture of experts: the MoE keys need experts; a model's own constraints
  const int64_t experts = c.i("model.num_local_experts");
  if (experts == 0) {
    for (const char* k : {"model.num_experts_per_tok", "model.moe_intermediate_size", "model.moe_every",
                          "model.router_aux_loss_coef", "model.router_z_loss_coef", "model.capacity_factor",
                          "model.norm_topk_prob", "model.shared_expert_intermediate_size"})
      if (changed(k)) return {k, "a mixture-of-experts key: set model.num_local_experts > 0 too"};
  } else {
    if (experts > 0 && c.s("model.kind") != "gpt")
      return {"model.num_local_experts", fmt::format("experts replace a GPT's MLP; model.kind = \"{}\"", c.s("model.kind"))};
    if (const int64_t k = c.i("model.num_experts_per_tok"); k > experts)
      return {"model.num_experts_per_tok",
              fmt::format("expected at most model.num_local_experts = {}, got {}", experts, k)};
    if (arch == "gpt2")
      for (const char* k : {"model.moe_intermediate_size", "model.shared_expert_intermediate_size"})
        if (changed(k))
          return {k, "a llama / qwen2 mixture-of-experts key: GPT-2's experts are its own MLP (4 x model.n_embd)"};
    if (arch == "llama") {  // MixtralForCausalLM: what its config cannot say is refused
      for (const char* k : {"model.shared_expert_intermediate_size", "model.moe_intermediate_size", "model.moe_every",
                            "model.norm_topk_prob", "model.attention_bias", "model.head_dim", "model.rope_scaling"})
        if (changed(k) && !(std::string_view(k) == "model.head_dim" && c.i(k) * c.i("model.n_head") == c.i("model.n_embd")))
          return {k, "not a switch of Mixtral (model.arch = \"llama\" with model.num_local_experts: every layer's "
                     "experts of model.intermediate_size, gate values renormalised, no biases, no head_dim or rope "
                     "scaling; Qwen2-MoE's switches are model.arch = \"qwen2\"'s)"};
    }
    if (c.b("model.mlp_bias"))
      return {"model.mlp_bias", "true with model.num_local_experts: Mixtral's and Qwen2-MoE's experts have no biases"};
    if (arch == "qwen2" && c.i("model.shared_expert_intermediate_size") == 0)
      return {"model.num_local_experts",
              "Qwen2-MoE (model.arch = \"qwen2\") always has a shared expert: set model.shared_expert_intermediate_size"};
    if (c.b("train.cuda_graph"))
      return {"train.cuda_graph", "true does not work with model.num_local_experts > 0 (the experts' row counts are "
                                  "read on the host every step); set one of them off"};
  }
  if (c.s("optim.name") == "sgd" && c.b("optim.nesterov") && !(c.f("optim.momentum") > 0 && c.f("optim.dampening") == 0))
    return {"optim.nesterov", "true needs optim.momentum > 0 and optim.dampening = 0"};
  if (const int64_t patience = c.i("train.early_stop_patience");
      patience > 0 && (!c.b("checkpoint.keep_best") || c.i("eval.every_steps") == 0))
    return {"train.early_stop_patience",
            fmt::format("{} needs checkpoint.keep_best = true and eval.every_steps > 0 (it ranks the evaluations as "
                        "keep_best does)", patience)};
  // replaying a captured forward/backward is right only where nothing in it changes per step
  if (c.b("train.cuda_graph")) {
    if (const std::string& off = c.s("parallel.offload"); off != "none")
      return {"train.cuda_graph",
              fmt::format("true does not work with parallel.offload = \"{}\" (the host update cannot be captured); "
                          "set one of them off", off)};
    if (const std::string& rc = c.s("train.recompute"); rc != "none")
      return {"train.cuda_graph", fmt::format("true does not work with train.recompute = \"{}\" yet; set one of them off", rc)};
    if (c.s("precision.dtype") == "fp16")
      return {"train.cuda_graph", "true does not work with precision.dtype = \"fp16\" (the loss scale changes from "
                                  "step to step); use bf16 or fp32"};
    if (c.s("data.kind") == "sft")
      return {"train.cuda_graph", "true does not work with data.kind = \"sft\" (the loss is averaged over each "
                                  "step's target tokens, a number that changes from step to step); set it off"};
  }
  // [lora]: adapters on a frozen model (docs/finetune.md)
  if (const CrossCheckFailure f = lora_check(c); !f.key.empty()) return f;
  return {};
}

std::vector<std::string> lora_targets(const std::string& list) {
  std::vector<std::string> out;
  size_t b = 0;
  while (b <= list.size()) {
    size_t e = list.find(',', b);
    if (e == std::string::npos) e = list.size();
    std::string t = list.substr(b, e - b);
    t.erase(0, t.find_first_not_of(" \t"));
    t.erase(t.find_last_not_of(" \t") + 1);
    if (!t.empty() && std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
    b = e + 1;
  }
  return out;
}

const std::vector<std::string>& lora_family_modules(const std::string& arch) {
  static const std::vector<std::string> gpt2 = {"c_attn", "c_proj", "c_fc"};
  static const std::vector<std::string> llama = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return arch == "gpt2" ? gpt2 : llama;
}

namespace {

using config_detail::kI32;
using config_detail::kI64;
using config_detail::kInf;

bool unbounded_hi(double hi) { return hi == kInf || hi == kI32 || hi == kI64; }
bool unbounded_lo(double lo) { return lo == -kInf || lo == -kI32 - 1; }

std::string allowed_text(const KeySpec& k) {
  if (!k.choices.empty()) {
    std::vector<std::string> c;
    for (auto x : k.choices) c.push_back(x.empty() ? "\"\"" : std::string(x));
    return fmt::format("{}", fmt::join(c, ", "));
  }
  const Range& r = k.range;
  bool lo = !unbounded_lo(r.lo), hi = !unbounded_hi(r.hi);
  if (lo && hi)
    return fmt::format("{}{}, {}{}", r.lo_open ? "(" : "[", r.lo, r.hi, r.hi_open ? ")" : "]");
  if (lo) return fmt::format("{} {}", r.lo_open ? ">" : ">=", r.lo);
  if (hi) return fmt::format("{} {}", r.hi_open ? "<" : "<=", r.hi);
  return "";
}

std::string default_text(const KeySpec& k) {
  if (k.required) return "(required)";
  if (k.key == "run.name") return "(file stem)";
  return std::string(k.def);
}

}  // namespace

std::string config_reference() {
  const auto& schema = config_schema();
  // Column widths over the whole table so every section lines up.
  size_t wk = 3, wt = 4, wd = 7, wa = 7;
  for (const auto& k : schema) {
    wk = std::max(wk, k.key.size());
    wt = std::max(wt, std::string_view(value_type_name(k.type)).size());
    wd = std::max(wd, default_text(k).size());
    wa = std::max(wa, allowed_text(k).size());
  }
  auto row = [&](std::string_view a, std::string_view b, std::string_view c, std::string_view d,
                 std::string_view e) {
    return fmt::format("| {:<{}} | {:<{}} | {:<{}} | {:<{}} | {} |\n", a, wk, b, wt, c, wd, d, wa, e);
  };
  std::string out =
      "dtrain recipe reference: every key, its type, default and allowed values.\n"
      "Keys are set in the recipe under [section] or with --set section.key=value.\n";
  std::string_view sec;
  for (const auto& k : schema) {
    std::string_view s = k.key.substr(0, k.key.find('.'));
    if (s != sec) {
      sec = s;
      out += fmt::format("\n## [{}]\n\n", s);
      out += row("key", "type", "default", "allowed", "description");
      out += row(std::string(wk, '-'), std::string(wt, '-'), std::string(wd, '-'), std::string(wa, '-'),
                 "-----------");
    }
    out += row(k.key, value_type_name(k.type), default_text(k), allowed_text(k),
               k.help);
  }
  return out;
}

}  // namespace dtrain

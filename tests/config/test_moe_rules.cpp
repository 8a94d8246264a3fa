// The mixture-of-experts keys (config/schema.cpp, config/rules.cpp; docs/moe.md): each refusal is
// one user error (exit 2) naming file:line:col of the key or the --set that gave it.
#include <doctest/doctest.h>

#include "config/config.h"
#include "core/error.h"
#include "recipe_fixture.h"

using namespace dtrain;
using namespace recipe_fixture;

namespace {
// kGpt with model.arch and the MoE keys appended to its [model] table
std::string moe(const std::string& arch, const std::string& keys) {
  std::string r = kGpt;
  const std::string at = "vocab_size = 64\n";
  r.insert(r.find(at) + at.size(), "arch = \"" + arch + "\"\n" + keys);
  return r;
}
}  // namespace

TEST_SUITE("unit") {

TEST_CASE("moe rules: the keys read into the recipe and the model's rules name their key") {
  const Config c = Config::parse(moe("qwen2", "num_local_experts = 8\nnum_experts_per_tok = 2\nmoe_every = 2\n"
                                              "moe_intermediate_size = 24\nshared_expert_intermediate_size = 48\n"
                                              "norm_topk_prob = false\nrouter_aux_loss_coef = 0.01\n"
                                              "router_z_loss_coef = 0.001\ncapacity_factor = 1.25\n"),
                                 "m.toml");
  CHECK(c.model.num_local_experts == 8);
  CHECK(c.model.num_experts_per_tok == 2);
  CHECK(c.model.moe_every == 2);
  CHECK(c.model.shared_expert_intermediate_size == 48);
  CHECK(!c.model.norm_topk_prob);
  CHECK(c.model.capacity_factor == 1.25);
  CHECK_NOTHROW(Config::parse(moe("llama", "num_local_experts = 4\n"), "m.toml"));
  CHECK_NOTHROW(Config::parse(moe("gpt2", "num_local_experts = 4\nmoe_every = 2\nnum_experts_per_tok = 1\n"), "m.toml"));

  struct Case {
    std::string recipe, where, message;
  };
  const std::vector<Case> cases = {
      {moe("llama", "num_experts_per_tok = 3\n"), "m.toml:11:",
       "model.num_experts_per_tok: a mixture-of-experts key: set model.num_local_experts > 0 too"},
      {moe("llama", "num_local_experts = 4\nnum_experts_per_tok = 5\n"), "m.toml:12:",
       "model.num_experts_per_tok: expected at most model.num_local_experts = 4, got 5"},
      {moe("gpt2", "num_local_experts = 4\nmoe_intermediate_size = 8\n"), "m.toml:12:",
       "model.moe_intermediate_size: a llama / qwen2 mixture-of-experts key"},
      {moe("llama", "num_local_experts = 4\nmoe_every = 2\n"), "m.toml:12:", "model.moe_every: not a switch of Mixtral"},
      {moe("llama", "num_local_experts = 4\nshared_expert_intermediate_size = 8\n"), "m.toml:12:",
       "model.shared_expert_intermediate_size: not a switch of Mixtral"},
      {moe("qwen2", "num_local_experts = 4\n"), "m.toml:11:", "model.num_local_experts: Qwen2-MoE"},
      {moe("llama", "num_local_experts = 4\nmlp_bias = true\n"), "m.toml:12:",
       "model.mlp_bias: true with model.num_local_experts"},
      {moe("llama", "num_local_experts = 4\ncapacity_factor = -1.0\n"), "m.toml:12:", "model.capacity_factor"},
  };
  for (const Case& cs : cases) {
    CAPTURE(cs.recipe);
    const std::string m = user_error_of([&] { Config::parse(cs.recipe, "m.toml"); });
    CHECK_MESSAGE(has(m, cs.where), m);
    CHECK_MESSAGE(has(m, cs.message), m);
  }
  // from an override, and what a captured step cannot hold
  std::string m = user_error_of(
      [&] { Config::parse(moe("llama", "num_local_experts = 4\n"), "m.toml", {"train.cuda_graph=true"}); });
  CHECK_MESSAGE(has(m, "train.cuda_graph: true does not work with model.num_local_experts > 0"), m);
  m = user_error_of([&] { Config::parse(kGpt, "m.toml", {"model.router_z_loss_coef=0.1"}); });
  CHECK_MESSAGE(has(m, "--set model.router_z_loss_coef=0.1: model.router_z_loss_coef: a mixture-of-experts key"), m);
}

}  // TEST_SUITE("unit")

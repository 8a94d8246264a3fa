// The [lora] table's rules (config/rules.cpp, docs/finetune.md): each bad recipe is a one-line
// UserError (exit 2) naming file:line:col of the key.
#include <doctest/doctest.h>

#include "core/error.h"
#include "config/config.h"
#include "recipe_fixture.h"

using namespace dtrain;
using recipe_fixture::has;
using recipe_fixture::user_error_of;

namespace {

const std::string kBase =
    "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 16\nvocab_size = 64\n"
    "init_from = \"base\"\n[data]\nkind = \"synthetic\"\n[train]\nbatch_size = 2\nmax_steps = 2\n";

std::string error_of(const std::string& text, const std::vector<std::string>& ov = {}) {
  return user_error_of([&] { Config::parse(text, "x.toml", ov); });
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("lora config: targets by family - rank - dropout - init_from and the layouts not built yet are refused naming file:line:col") {
  const std::string ok = kBase + "[lora]\nenabled = true\nrank = 4\nalpha = 8.0\ntarget_modules = \"c_attn, c_fc\"\n";
  const Config c = Config::parse(ok, "x.toml", {});
  CHECK(c.lora.enabled);
  CHECK(lora_targets(c.lora.target_modules) == std::vector<std::string>{"c_attn", "c_fc"});
  CHECK(lora_targets(" q_proj,,v_proj , q_proj") == std::vector<std::string>{"q_proj", "v_proj"});
  // llama names on GPT-2 (line 16 of the recipe: target_modules)
  std::string m = error_of(kBase + "[lora]\nenabled = true\ntarget_modules = \"q_proj\"\n");
  CHECK_MESSAGE(has(m, "x.toml:16:"), m);
  CHECK_MESSAGE(has(m, "lora.target_modules"), m);
  CHECK_MESSAGE(has(m, "\"q_proj\" is not a module of model.arch = \"gpt2\""), m);
  m = error_of(kBase, {"model.arch=\"llama\"", "lora.enabled=true", "lora.target_modules=\"c_attn\""});
  CHECK_MESSAGE(has(m, "is not a module of model.arch = \"llama\""), m);
  m = error_of(kBase + "[lora]\nenabled = true\n");
  CHECK_MESSAGE(has(m, "lora.target_modules"), m);
  CHECK_MESSAGE(has(m, "required"), m);
  m = error_of(kBase + "[lora]\nenabled = true\nrank = 0\ntarget_modules = \"c_attn\"\n");
  CHECK_MESSAGE(has(m, "x.toml:16:"), m);
  CHECK_MESSAGE(has(m, "lora.rank"), m);
  m = error_of(kBase + "[lora]\nenabled = true\nrank = -3\ntarget_modules = \"c_attn\"\n");
  CHECK_MESSAGE(has(m, "lora.rank"), m);
  m = error_of(kBase + "[lora]\nenabled = true\ndropout = 0.1\ntarget_modules = \"c_attn\"\n");
  CHECK_MESSAGE(has(m, "lora.dropout"), m);
  CHECK_MESSAGE(has(m, "not implemented"), m);
  m = error_of(kBase + "[lora]\nenabled = true\nalpha = 0.0\ntarget_modules = \"c_attn\"\n");
  CHECK_MESSAGE(has(m, "lora.alpha"), m);
  // without model.init_from (the frozen model must be read again on resume)
  m = error_of(kBase + "[lora]\nenabled = true\ntarget_modules = \"c_attn\"\n", {"model.init_from=\"\""});
  CHECK_MESSAGE(has(m, "lora.enabled"), m);
  CHECK_MESSAGE(has(m, "model.init_from"), m);
  CHECK(Config::parse(ok, "x.toml", {"parallel.zero=3"}).parallel.zero == 3);  // the adapters sharded
  for (const char* ov : {"parallel.pipeline=2"}) {
    m = error_of(ok, {ov});
    CHECK_MESSAGE(has(m, std::string(ov).substr(0, std::string(ov).find('='))), m);
    CHECK_MESSAGE(has(m, "lora.enabled"), m);
  }
  m = error_of(ok, {"parallel.tensor=2", "parallel.sequence=true"});
  CHECK_MESSAGE(has(m, "parallel.sequence"), m);
  // a resnet has no modules LoRA knows
  m = error_of("[model]\nkind = \"resnet\"\ninit_from = \"x\"\n[data]\npath = \"d\"\n[lora]\nenabled = true\n"
               "target_modules = \"fc\"\n");
  CHECK_MESSAGE(has(m, "model.kind"), m);
}
}

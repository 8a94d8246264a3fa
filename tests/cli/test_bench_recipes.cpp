// The GPU benchmark recipes (configs/bench/*.toml) load and run one `dtrain bench` step on
// the CPU with tiny-size overrides (fp32, few layers/small images), so their keys stay
// valid; and synthetic data feeds every model family (GPT tokens, U-Net images and masks).
#include <doctest/doctest.h>

#include <filesystem>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <fstream>
#include <sstream>

#include "run_cmd.h"

namespace {

const std::string kBin = dtrain_bin();
const std::string kSrc = DTRAIN_SOURCE_DIR;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string read(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Overrides that shrink a recipe of this model kind to a CPU-sized smoke step.
std::string tiny_overrides(const std::string& recipe_text) {
  std::string o = " --device cpu --set precision.dtype=fp32 --set run.threads=2";
  if (has(recipe_text, "kind = \"gpt\""))
    return o + " --set model.n_layer=1 --set model.block_size=32 --set model.vocab_size=512 --set train.batch_size=2";
  if (has(recipe_text, "kind = \"unet\""))
    return o + " --set model.base_channels=4 --set data.synthetic_height=32 --set data.synthetic_width=32"
               " --set train.batch_size=1";
  return o + " --set data.synthetic_height=32 --set data.synthetic_width=32 --set train.batch_size=2";
}

}  // namespace

TEST_SUITE("integration") {
TEST_CASE("bench recipes: every configs/bench recipe runs one CPU step with tiny overrides") {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(kSrc + "/configs/bench")) {
    if (e.path().extension() != ".toml") continue;
    const std::string path = e.path().string();
    CAPTURE(path);
    const std::string text = read(path);
    CmdResult r = run_cmd(kBin + " bench " + shell_quote(path) + tiny_overrides(text) + " --warmup 0 --steps 1");
    CHECK_MESSAGE(r.code == 0, r.all());
    CHECK_MESSAGE(has(r.out, "throughput: "), r.all());
    ++n;
  }
  CHECK(n >= 4);  // resnet20 (CPU), resnet50 fp32/bf16, gpt2_124m, unet_bf16
}

TEST_CASE("bench recipes: synthetic data for GPT (tokens/s) and U-Net (images/s)") {
  const std::string gpt = kSrc + "/configs/bench/gpt2_124m.toml";
  const std::string json = std::string(DTRAIN_BUILD_DIR) + "/bench_gpt.json";
  std::filesystem::remove(json);
  CmdResult g = run_cmd(kBin + " bench " + shell_quote(gpt) + tiny_overrides(read(gpt)) + " --warmup 1 --steps 2 --json " +
                        json);
  REQUIRE_MESSAGE(g.code == 0, g.all());
  CHECK(has(g.out, " tokens/s "));
  CHECK(has(g.out, "model FLOPs: "));
  // --json: the same numbers, machine-readable
  const auto j = nlohmann::json::parse(read(json));
  CHECK(j["unit"] == "tokens");
  CHECK(j["params"] == 7507200);
  CHECK(j["timed_steps"] == 2);
  CHECK(has(g.out, fmt::format("throughput: {:.1f} tokens/s", j["tokens_per_s"].get<double>())));
  CHECK(j["flops_per_token"].get<double>() > 0);
  CHECK(j["mfu"].is_null());  // no peak known for a CPU
  // 1 layer, 768 wide, block 32, vocab 512 (a multiple of 128: no padding):
  // wte 512*768 + wpe 32*768 + block 12*768^2 + 13*768 + ln_f 2*768
  CHECK(has(g.out, "| 7507200 params |"));
  const std::string unet = kSrc + "/configs/bench/unet_bf16.toml";
  CmdResult u = run_cmd(kBin + " bench " + shell_quote(unet) + tiny_overrides(read(unet)) + " --warmup 1 --steps 2");
  REQUIRE_MESSAGE(u.code == 0, u.all());
  CHECK(has(u.out, " images/s "));
  // height and width must be divisible by 2^depth: a user error naming the input
  CmdResult bad = run_cmd(kBin + " bench " + shell_quote(unet) + tiny_overrides(read(unet)) +
                          " --set data.synthetic_height=36 --steps 1 --warmup 0");
  CHECK(bad.code == 2);
  CHECK_MESSAGE(has(bad.err, "divisible by 2^depth"), bad.err);
}

TEST_CASE("bench recipes: a GPT vocab_size override is padded anew and not kept at the preset padding") {
  const std::string gpt = kSrc + "/configs/bench/gpt2_124m.toml";
  // vocab 1000 pads to 1024 rows (the preset's 50304 would give 45M parameters)
  CmdResult g = run_cmd(kBin + " bench " + shell_quote(gpt) + tiny_overrides(read(gpt)) +
                        " --set model.vocab_size=1000 --warmup 0 --steps 1");
  REQUIRE_MESSAGE(g.code == 0, g.all());
  // 1024*768 + 32*768 + 12*768^2 + 13*768 + 2*768
  CHECK_MESSAGE(has(g.out, "| 7900416 params |"), g.out);
}
}

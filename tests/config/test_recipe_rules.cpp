// Where a recipe is validated (docs/design.md): the rules over several keys in config/
// (config_cross_check), naming the key where the recipe gave it; the CLI's --device as the
// last override; and the rules that need the world size in the parallel layout, which also
// carries what it resolved (the pipeline's stages, the reduce dtype, the compression) to the
// places that used to work it out again.
#include <doctest/doctest.h>

#include "config/config.h"
#include "core/error.h"
#include "recipe_fixture.h"
#include "session/layout.h"

using namespace dtrain;

using namespace recipe_fixture;

TEST_SUITE("unit") {

TEST_CASE("recipe rules: rules over several keys name the key where the recipe gave it") {
  // in the file: its line and column
  const std::string sgd = kGpt + "[optim]\nname = \"sgd\"\nmomentum = 0.0\nnesterov = true\n";
  std::string m = user_error_of([&] { Config::parse(sgd, "r.toml"); });
  CHECK_MESSAGE(has(m, "r.toml:18:"), m);
  CHECK_MESSAGE(has(m, ": optim.nesterov: true needs optim.momentum > 0 and optim.dampening = 0"), m);
  CHECK_NOTHROW(Config::parse(sgd, "r.toml", {"optim.momentum=0.9"}));
  CHECK_NOTHROW(Config::parse(sgd, "r.toml", {"optim.name=adamw"}));  // AdamW has no Nesterov: not checked
  // from an override: the override
  m = user_error_of([&] { Config::parse(kGpt, "r.toml", {"train.early_stop_patience=2"}); });
  CHECK_MESSAGE(has(m, "--set train.early_stop_patience=2: train.early_stop_patience: 2 needs checkpoint.keep_best = true"),
                m);
  CHECK_NOTHROW(Config::parse(kGpt, "r.toml",
                              {"train.early_stop_patience=2", "checkpoint.keep_best=true", "eval.every_steps=5"}));
  // what a captured step cannot hold, each named
  for (const auto& [ov, what] : std::vector<std::pair<std::string, std::string>>{
           {"parallel.offload=optimizer", "parallel.offload = \"optimizer\""},
           {"train.recompute=block", "train.recompute = \"block\""},
           {"precision.dtype=fp16", "precision.dtype = \"fp16\""}}) {
    CAPTURE(ov);
    m = user_error_of([&] { Config::parse(kGpt, "r.toml", {"train.cuda_graph=true", ov}); });
    CHECK_MESSAGE(has(m, "train.cuda_graph: true does not work with " + what), m);
  }
  CHECK_NOTHROW(Config::parse(kGpt, "r.toml", {"train.cuda_graph=true", "precision.dtype=bf16"}));
}

TEST_CASE("recipe: --device is the last override and names itself") {
  Config c = Config::parse(kGpt, "r.toml", {"run.device=cpu"}, "cuda");
  CHECK(c.run.device == "cuda");
  CHECK(c.origin_of(c.run.device) == "--device");
  Config plain = Config::parse(kGpt, "r.toml", {"run.device=cpu"});
  CHECK(plain.run.device == "cpu");
  const std::string m = user_error_of([&] { Config::parse(kGpt, "r.toml", {}, "tpu"); });
  CHECK_MESSAGE(has(m, "--device: run.device:"), m);
}

TEST_CASE("layout: CUDA graphs with data parallelism exit 2 naming train.cuda_graph") {
  Config c = Config::parse(kGpt, "g.toml", {"train.cuda_graph=true"});
  CHECK_NOTHROW(resolve_layout(c, 1));
  const std::string m = user_error_of([&] { resolve_layout(c, 2); });
  CHECK_MESSAGE(has(m, "g.toml: train.cuda_graph = true does not work with data parallelism yet (2 data ranks"), m);
}

TEST_CASE("layout: what it resolved reaches the session and the communicators: stages - reduce dtype - compression") {
  Config pp = Config::parse(kGpt, "g.toml", {"parallel.pipeline=2", "train.grad_accum=2"});
  const ParallelLayout l = resolve_layout(pp, 4);
  CHECK(l.pipe.stages == 2);
  REQUIRE(l.pipe.layers.size() == 2);
  const SessionOptions so = l.session_options(3);
  CHECK(so.pp_rank == 1);
  CHECK(so.pp_size == 2);
  CHECK(so.pipe.stages == 2);
  CHECK(so.pipe.layers == l.pipe.layers);
  Config z3 = Config::parse(kGpt, "g.toml", {"parallel.zero=3", "parallel.reduce_dtype=bf16"});
  CHECK(resolve_layout(z3, 2).reduce_dtype == DType::BF16);
  Config ps = Config::parse(kGpt, "g.toml", {"parallel.grad_compression=powersgd", "parallel.powersgd_rank=3"});
  const ParallelLayout lp = resolve_layout(ps, 2);
  CHECK(lp.compression.kind == parallel::GradCompression::PowerSGD);
  CHECK(lp.compression.powersgd_rank == 3);
  CHECK(resolve_layout(pp, 2).compression.kind == parallel::GradCompression::None);
}

}  // TEST_SUITE

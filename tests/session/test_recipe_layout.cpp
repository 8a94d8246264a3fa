// The typed recipe (config/recipe.h) and the parallel layout (session/layout.h): the fields
// agree with the schema and with the string accessors; the layout derives the accumulation
// from a global batch, names every broken rule in one error, and maps ranks to coordinates.
#include <doctest/doctest.h>

#include "config/config.h"
#include "config/recipe_table.h"
#include "core/error.h"
#include "recipe_fixture.h"
#include "session/layout.h"

using namespace dtrain;

using namespace recipe_fixture;

TEST_SUITE("unit") {

TEST_CASE("recipe: every schema key has one typed field of its type and the fields hold what the accessors read") {
  const auto& index = schema_field_index();  // faults on any disagreement
  REQUIRE(index.size() == config_schema().size());
  Config c = Config::parse(kGpt, "g.toml",
                           {"optim.lr=0.25", "data.mean=[0.5, 0.25, 0.125]", "data.std=[0.25, 0.5, 1.0]", "schedule.milestones=[3, 7]",
                            "parallel.offload=optimizer", "train.cuda_graph=false", "run.threads=2"});
  Recipe& r = c;
  for (size_t k = 0; k < config_schema().size(); ++k) {
    const KeySpec& s = config_schema()[k];
    const FieldRef f = recipe_fields()[index[k]].ref(r);
    CAPTURE(s.key);
    switch (s.type) {
      case ValueType::Int: CHECK(*std::get<int64_t*>(f) == c.i(s.key)); break;
      case ValueType::Float: CHECK(*std::get<double*>(f) == c.f(s.key)); break;
      case ValueType::Bool: CHECK(*std::get<bool*>(f) == c.b(s.key)); break;
      case ValueType::String: CHECK(*std::get<std::string*>(f) == c.s(s.key)); break;
      case ValueType::IntArray: CHECK(*std::get<std::vector<int64_t>*>(f) == c.iv(s.key)); break;
      case ValueType::FloatArray: CHECK(*std::get<std::vector<double>*>(f) == c.fv(s.key)); break;
    }
    std::visit([&](auto* p) { CHECK(c.key_of(*p) == s.key); }, f);
  }
  CHECK(c.optim.lr == 0.25);
  CHECK(c.data.mean == std::vector<double>{0.5, 0.25, 0.125});
  CHECK(c.schedule.milestones == std::vector<int64_t>{3, 7});
  CHECK(c.parallel.offload == "optimizer");
  CHECK(c.model.n_head == 4);
  CHECK(c.data.eval_split == "val");  // resolved from model.kind
}

TEST_CASE("recipe: key_of names a field and given and origin_of say where its value came from") {
  Config c = Config::parse(kGpt, "g.toml", {"optim.lr=0.5"});
  CHECK(c.key_of(c.train.batch_size) == "train.batch_size");
  CHECK(c.key_of(c.data.std) == "data.std");
  CHECK(c.given(c.train.batch_size));
  CHECK(c.origin_of(c.train.batch_size) == "g.toml:13:1");
  CHECK(c.given(c.optim.lr));
  CHECK(c.origin_of(c.optim.lr) == "--set optim.lr=0.5");
  CHECK_FALSE(c.given(c.train.grad_accum));
  int64_t elsewhere = 0;
  CHECK_THROWS_AS(c.key_of(elsewhere), RuntimeFault);  // not a field of this recipe
}

TEST_CASE("recipe: assign validates like an override and the saved recipe and hash follow it") {
  Config c = Config::parse(kGpt, "g.toml");
  const std::string before = c.hash();
  c.assign(c.train.grad_accum, 4);
  CHECK(c.train.grad_accum == 4);
  CHECK(c.i("train.grad_accum") == 4);
  CHECK(has(c.to_toml(), "grad_accum = 4\n"));
  CHECK(c.hash() != before);
  CHECK(c.given(c.train.grad_accum));
  c.assign(c.run.name, "a \"quoted\" name");  // a string goes through TOML quoting intact
  CHECK(c.run.name == "a \"quoted\" name");
  CHECK(Config::parse(c.to_toml(), "again.toml").run.name == "a \"quoted\" name");
  const std::string d = user_error_of([&] { c.assign(c.run.device, "tpu"); });
  CHECK_MESSAGE(has(d, "run.device: expected one of auto, cpu, cuda, got 'tpu'"), d);
  const std::string m = user_error_of([&] { c.assign(c.train.batch_size, 0); });
  CHECK_MESSAGE(has(m, "train.batch_size: expected a value >= 1, got 0"), m);
  CHECK(c.train.batch_size == 2);  // a refused assignment changes nothing
  const std::string e = user_error_of([&] { c.assign(c.optim.name, "lion"); });
  CHECK_MESSAGE(has(e, "optim.name: expected one of"), e);
}

TEST_CASE("layout: ranks are tensor-innermost and pipeline-outermost and coordinates round-trip") {
  Config c = Config::parse(kGpt, "g.toml", {"parallel.tensor=2", "parallel.pipeline=2", "train.grad_accum=2"});
  const ParallelLayout l = resolve_layout(c, 8);
  CHECK(l.data == 2);
  CHECK(l.tensor == 2);
  CHECK(l.pipeline == 2);
  CHECK(l.pipe.stages == 2);
  for (int r = 0; r < 8; ++r) {
    const ParallelLayout::Coord k = l.coord(r);
    CHECK(r == k.pipe * 4 + k.data * 2 + k.tensor);
    CHECK(l.rank_of(k) == r);
    const SessionOptions so = l.session_options(r);
    CHECK(so.rank == k.data);
    CHECK(so.world_size == 2);
    CHECK(so.tp_rank == k.tensor);
    CHECK(so.pp_rank == k.pipe);
  }
  CHECK(l.global_batch() == 2 * 2 * 2);
  CHECK(l.batch_note.empty());
  CHECK(has(l.describe(), "8 ranks: 2 stages x 2 data x 2 tensor"));
}

TEST_CASE("layout: train.global_batch derives the accumulation for the world the run gets") {
  Config c = Config::parse(kGpt, "g.toml", {"train.global_batch=16"});
  ParallelLayout l = resolve_layout(c, 2);
  CHECK(l.grad_accum == 4);
  CHECK(c.train.grad_accum == 4);
  CHECK(l.global_batch() == 16);
  CHECK_MESSAGE(has(l.batch_note, "train.grad_accum = 4 (was 1): train.global_batch = 16 over 2 data ranks"), l.batch_note);
  Config one = Config::parse(kGpt, "g.toml", {"train.global_batch=16"});
  CHECK(resolve_layout(one, 1).grad_accum == 8);
  Config exact = Config::parse(kGpt, "g.toml", {"train.global_batch=4"});
  ParallelLayout e = resolve_layout(exact, 2);
  CHECK(e.grad_accum == 1);
  CHECK(e.batch_note.empty());  // nothing changed: nothing said
  Config odd = Config::parse(kGpt, "g.toml", {"train.global_batch=6"});
  std::string m = user_error_of([&] { resolve_layout(odd, 4); });
  CHECK_MESSAGE(has(m, "g.toml: train.global_batch = 6: 2 x 4 data ranks cannot make a global batch of 6"), m);
  CHECK_MESSAGE(has(m, "set train.batch_size (or train.global_batch) so that it divides 6"), m);
  Config both = Config::parse(kGpt, "g.toml", {"train.global_batch=16", "train.grad_accum=2"});
  m = user_error_of([&] { resolve_layout(both, 2); });
  CHECK_MESSAGE(has(m, "train.global_batch = 16 and train.grad_accum = 2 disagree: 2 x 2 x 2 data ranks = 8"), m);
}

TEST_CASE("layout: a resume on another number of data ranks keeps the checkpoint's global batch") {
  Config c = Config::parse(kGpt, "g.toml");
  // written by 4 data ranks with accumulation 1 (global 8), resumed on 2
  ParallelLayout l = resolve_layout(c, 2, 8, 4);
  CHECK(l.grad_accum == 2);
  CHECK(l.global_batch() == 8);
  CHECK_MESSAGE(has(l.batch_note, "the checkpoint's global batch of 8 (written by 4 data ranks)"), l.batch_note);
  // the same number of data ranks: the recipe decides (a deliberate change of train.grad_accum)
  Config same = Config::parse(kGpt, "g.toml", {"train.grad_accum=3"});
  CHECK(resolve_layout(same, 2, 8, 2).grad_accum == 3);
  // no whole accumulation gives it: exit 2 naming the keys
  Config three = Config::parse(kGpt, "g.toml");
  const std::string m = user_error_of([&] { resolve_layout(three, 3, 8, 4); });
  CHECK_MESSAGE(has(m, "the checkpoint's global batch of 8 (written by 4 data ranks): 2 x 3 data ranks cannot make"),
                m);
  CHECK_MESSAGE(has(m, "train.batch_size"), m);
  CHECK_MESSAGE(has(m, "train.global_batch"), m);
}

TEST_CASE("layout: every broken rule of a layout is named in one error") {
  Config c = Config::parse(kGpt, "g.toml",
                           {"parallel.tensor=3", "parallel.grad_compression=powersgd", "parallel.reduce_dtype=bf16"});
  const std::string m = user_error_of([&] { resolve_layout(c, 4); });
  CHECK_MESSAGE(has(m, "g.toml: 3 problems with the layout on 4 ranks: "), m);
  CHECK_MESSAGE(has(m, "parallel.tensor = 3 must divide the world size 4"), m);
  CHECK_MESSAGE(has(m, "; and parallel.grad_compression = \"powersgd\" does not work with parallel.tensor = 3"), m);
  CHECK_MESSAGE(has(m, "parallel.reduce_dtype = \"bf16\" needs parallel.zero = 3"), m);
  // one problem: its own message, as before
  Config one = Config::parse(kGpt, "g.toml", {"parallel.shard_group_size=3", "parallel.zero=3"});
  const std::string s = user_error_of([&] { resolve_layout(one, 4); });
  CHECK_MESSAGE(has(s, "g.toml: parallel.shard_group_size = 3 must divide the world size 4"), s);
}

}  // TEST_SUITE

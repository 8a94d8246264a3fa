// Optimizer shard files (checkpoint/flat_shards.h): names, writing every ZeRO shard of a real
// optimizer, reassembling any range for another world size, and the checks that make a
// checkpoint with a missing or inconsistent shard invalid (CheckpointManager::verify).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "parallel/zero.h"
#include "nn/params.h"
#include "optim/optimizer.h"
#include "test_util.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/flat_shards.h"
#include "checkpoint/safetensors.h"

using namespace dtrain;
using test_util::TmpDir;

namespace {

constexpr int64_t kTotal = 23;  // not a multiple of 2, 3, 4 or 5: shards of unequal size

// 23 parameters; `range` of them owned by the optimizer, stepped 3 times with fixed grads.
struct Model {
  std::unique_ptr<Backend> be = make_backend("cpu");
  ParamStore ps;
  std::unique_ptr<Optimizer> opt;
  Model(bool adamw, FlatRange range) {
    ps.declare({"w", Shape{3, 5}, Init::Zeros, 0, true});
    ps.declare({"b", Shape{5}, Init::Zeros, 0, false});
    ps.declare({"w2", Shape{3}, Init::Zeros, 0, true});
    ps.finalize(*be);
    std::vector<float> p(kTotal);
    for (int i = 0; i < kTotal; ++i) p[size_t(i)] = float(0.5 * std::sin(1.1 * i + 0.3));
    be->copy_from_host(ps.flat_params().data, p.data(), p.size() * 4);
    if (adamw)
      opt = std::make_unique<AdamW>(ps, AdamWConfig{}, range);
    else
      opt = std::make_unique<Sgd>(ps, SgdConfig{}, range);
    for (int s = 0; s < 3; ++s) {
      std::vector<float> g(kTotal);
      for (int i = 0; i < kTotal; ++i) g[size_t(i)] = float(std::cos(0.7 * i + 1.3 * s));
      be->copy_from_host(ps.flat_grads().data, g.data(), g.size() * 4);
      opt->step(0.1f, 1.f);
    }
  }
};

// `tensor` of a full-range optimizer's export, bytes [b, e) in elements
std::vector<uint8_t> slice(const Optimizer& full, const std::string& tensor, int64_t b, int64_t e) {
  for (auto& x : full.export_state())
    if (x.name == tensor) return std::vector<uint8_t>(x.bytes.begin() + b * 4, x.bytes.begin() + e * 4);
  FAIL("no tensor " << tensor);
  return {};
}

// Every shard of a `count`-way ZeRO split written into dir, as ranks would.
void write_shards(const std::string& dir, bool adamw, int count) {
  for (int r = 0; r < count; ++r) {
    Model m(adamw, parallel::shard_range(kTotal, r, count));
    write_optim_shard(*m.opt, m.ps, 3, dir, r, count);
  }
}

// A hand-made shard file (for the inconsistent cases): momentum F32 [e - b] (or [n]) and step.
void fake_shard(const std::string& dir, int index, int count, int64_t b, int64_t e, int64_t total,
                const std::string& kind = "sgd", int64_t step = 3, int64_t n = -1) {
  if (n < 0) n = e - b;
  std::vector<float> m(size_t(n), 1.f);
  write_safetensors(dir + "/" + flat_shard_name(FlatKind::Optimizer, index, count),
                    {{"momentum", "F32", {n}, m.data(), m.size() * 4}, {"step", "I64", {}, &step, 8}},
                    {{"optimizer", kind},
                     {"shard_index", std::to_string(index)},
                     {"shard_count", std::to_string(count)},
                     {"range_begin", std::to_string(b)},
                     {"range_end", std::to_string(e)},
                     {"num_params", std::to_string(total)},
                     {"param_layout", "abc"}});
}

std::string problem(const std::string& dir, int expected = -1) { return flat_shards_problem(dir, FlatKind::Optimizer, expected); }

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("optim shards: names") {
  CHECK(flat_shard_name(FlatKind::Optimizer, 0, 1) == "optim-00000-of-00001.safetensors");
  CHECK(flat_shard_name(FlatKind::Optimizer, 3, 4) == "optim-00003-of-00004.safetensors");
  int i = -1, n = -1;
  CHECK(parse_flat_shard_name(FlatKind::Optimizer, "optim-00002-of-00004.safetensors", &i, &n));
  CHECK(i == 2);
  CHECK(n == 4);
  CHECK(parse_flat_shard_name(FlatKind::Optimizer, "optim-123456-of-200000.safetensors", &i, &n));
  CHECK(i == 123456);
  CHECK_FALSE(parse_flat_shard_name(FlatKind::Optimizer, "optim-00004-of-00004.safetensors", &i, &n));  // index past the count
  CHECK_FALSE(parse_flat_shard_name(FlatKind::Optimizer, "optim-0-of-1.safetensors", &i, &n));
  CHECK_FALSE(parse_flat_shard_name(FlatKind::Optimizer, "optim-00000-of-00000.safetensors", &i, &n));
  CHECK_FALSE(parse_flat_shard_name(FlatKind::Optimizer, "optim-00000-of-00001.safetensors.tmp", &i, &n));
  CHECK_FALSE(parse_flat_shard_name(FlatKind::Optimizer, "model.safetensors", &i, &n));
}

TEST_CASE("optim shards: the shards of N ranks give any other rank's range bit for bit") {
  for (bool adamw : {false, true}) {
    Model full(adamw, FlatRange{});
    const std::vector<std::string> tensors =
        adamw ? std::vector<std::string>{"exp_avg", "exp_avg_sq"} : std::vector<std::string>{"momentum"};
    for (int n : {1, 2, 4}) {
      TmpDir t;
      write_shards(t.path, adamw, n);
      FlatShards s(t.path, FlatKind::Optimizer, n);
      INFO((adamw ? "adamw" : "sgd") << " written by " << n << " ranks");
      CHECK(s.count() == n);
      CHECK(s.kind() == (adamw ? "adamw" : "sgd"));
      CHECK(s.num_params() == kTotal);
      CHECK(s.step() == 3);
      CHECK(s.layout() == full.ps.layout_hash());
      CHECK(s.state_names() == tensors);
      for (int m : {1, 2, 3, 4, 5})
        for (int r = 0; r < m; ++r) {
          const FlatRange fr = parallel::shard_range(kTotal, r, m);
          for (const auto& name : tensors) CHECK(s.read(name, fr.begin, fr.end) == slice(*full.opt, name, fr.begin, fr.end));
        }
      CHECK(problem(t.path, n) == "");
    }
  }
}

TEST_CASE("optim shards: a missing or inconsistent shard is named") {
  SUBCASE("missing file") {
    TmpDir t;
    write_shards(t.path, false, 4);
    std::filesystem::remove(t.path + "/optim-00002-of-00004.safetensors");
    CHECK(problem(t.path) == "optim-00002-of-00004.safetensors: missing (shard 2 of 4)");
    CHECK_THROWS_WITH_AS(FlatShards(t.path, FlatKind::Optimizer, 4), doctest::Contains((t.path + "/optim-00002-of-00004.safetensors: missing").c_str()),
                         UserError);
  }
  SUBCASE("none of the files that state.json announces") {
    TmpDir t;
    CHECK(problem(t.path, -1) == "");  // a checkpoint without an optimizer
    CHECK(FlatShards(t.path, FlatKind::Optimizer).count() == 0);
    CHECK(problem(t.path, 4) == "optim-00000-of-00004.safetensors: missing (shard 0 of 4)");
  }
  SUBCASE("another count than state.json announces") {
    TmpDir t;
    write_shards(t.path, false, 2);
    CHECK(problem(t.path, 4) == "optim-00000-of-00002.safetensors: belongs to a set of 2 shards but state.json announces 4");
  }
  SUBCASE("files of two sets") {
    TmpDir t;
    write_shards(t.path, false, 2);
    write_shards(t.path, false, 4);
    CHECK(problem(t.path).find("belongs to a set of") != std::string::npos);
  }
  SUBCASE("a name that is not a shard name") {
    TmpDir t;
    write_shards(t.path, false, 1);
    fs::write_file(t.path + "/optim-1-of-2.safetensors", "x");
    CHECK(problem(t.path) == "optim-1-of-2.safetensors: not an optimizer shard name (expected "
                             "optim-<index>-of-<count>.safetensors)");
  }
  SUBCASE("overlapping and gapped ranges") {
    TmpDir t;
    fake_shard(t.path, 0, 2, 0, 12, kTotal);
    fake_shard(t.path, 1, 2, 11, kTotal, kTotal);
    CHECK(problem(t.path) == "optim-00001-of-00002.safetensors: range [11, 23) does not continue "
                             "optim-00000-of-00002.safetensors's [0, 12) (overlap)");
    fake_shard(t.path, 1, 2, 13, kTotal, kTotal);
    CHECK(problem(t.path).find("(gap)") != std::string::npos);
  }
  SUBCASE("ranges that stop short of num_params or start past 0") {
    TmpDir t;
    fake_shard(t.path, 0, 2, 0, 12, kTotal);
    fake_shard(t.path, 1, 2, 12, 20, kTotal);
    CHECK(problem(t.path) == "optim-00001-of-00002.safetensors: range ends at 20 but num_params is 23 (the shards do "
                             "not cover the state)");
    fake_shard(t.path, 0, 2, 1, 12, kTotal);
    CHECK(problem(t.path) == "optim-00000-of-00002.safetensors: range [1, 12) does not start at 0");
  }
  SUBCASE("metadata that disagrees with the name or the other shards") {
    TmpDir t;
    fake_shard(t.path, 0, 2, 0, 12, kTotal);
    fake_shard(t.path, 1, 2, 12, kTotal, kTotal, "adamw");
    CHECK(problem(t.path) == "optim-00001-of-00002.safetensors: optimizer 'adamw' but "
                             "optim-00000-of-00002.safetensors holds 'sgd'");
    fake_shard(t.path, 1, 2, 12, kTotal, kTotal, "sgd", 4);
    CHECK(problem(t.path) == "optim-00001-of-00002.safetensors: optimizer step 4 but "
                             "optim-00000-of-00002.safetensors holds 3");
    fake_shard(t.path, 1, 2, 12, 30, 30);
    CHECK(problem(t.path) == "optim-00001-of-00002.safetensors: num_params 30 but "
                             "optim-00000-of-00002.safetensors says 23");
    // file 1 claims to be shard 0
    std::filesystem::rename(t.path + "/optim-00000-of-00002.safetensors", t.path + "/x");
    fake_shard(t.path, 1, 2, 12, kTotal, kTotal);
    std::filesystem::copy_file(t.path + "/x", t.path + "/optim-00001-of-00002.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    std::filesystem::rename(t.path + "/x", t.path + "/optim-00000-of-00002.safetensors");
    CHECK(problem(t.path) == "optim-00001-of-00002.safetensors: __metadata__ says shard 0 of 2, the file name "
                             "says 1 of 2");
  }
  SUBCASE("a tensor of the wrong size") {
    TmpDir t;
    fake_shard(t.path, 0, 1, 0, kTotal, kTotal, "sgd", 3, 5);
    CHECK(problem(t.path) == "optim-00000-of-00001.safetensors: tensor 'momentum': expected F32 [23] for range "
                             "[0, 23), got F32 with 1 dims");
  }
}

TEST_CASE("optim shards: a file without shard metadata is read as the full state") {
  TmpDir t;
  std::vector<float> m(kTotal);
  for (int i = 0; i < kTotal; ++i) m[size_t(i)] = float(i);
  int64_t step = 7;
  write_safetensors(t.path + "/optim-00000-of-00001.safetensors",
                    {{"momentum", "F32", {kTotal}, m.data(), m.size() * 4}, {"step", "I64", {}, &step, 8}},
                    {{"optimizer", "sgd"}});
  FlatShards s(t.path, FlatKind::Optimizer);
  CHECK(s.count() == 1);
  CHECK(s.num_params() == kTotal);
  CHECK(s.step() == 7);
  CHECK(s.layout() == "");
  auto part = s.read("momentum", 5, 9);
  float got[4];
  std::memcpy(got, part.data(), 16);
  CHECK(got[0] == 5.f);
  CHECK(got[3] == 8.f);
}

TEST_CASE("checkpoint: a checkpoint missing an optimizer shard is invalid and latest_valid falls back naming it") {
  TmpDir t;
  CheckpointManager cm(t.path);
  // `skip`: a shard the "rank" never wrote (SHA256SUMS then covers the files that exist)
  auto writer = [](int64_t step, int skip) {
    return [step, skip](const std::string& dir) {
      for (int r = 0; r < 4; ++r)
        if (r != skip) {
          Model m(true, parallel::shard_range(kTotal, r, 4));
          write_optim_shard(*m.opt, m.ps, step, dir, r, 4);
        }
      fs::write_file(dir + "/state.json",
                     nlohmann::json{{"step", step}, {"optimizer", {{"kind", "adamw"}, {"shards", 4}}}}.dump());
    };
  };
  const std::string d100 = cm.save(100, writer(100, -1), 0);
  const std::string d200 = cm.save(200, writer(200, 3), 0);
  CHECK(CheckpointManager::verify(d100) == "");
  CHECK(CheckpointManager::verify(d200) == "optim-00003-of-00004.safetensors: missing (shard 3 of 4)");
  std::vector<std::string> notes;
  CHECK(cm.latest_valid(&notes) == d100);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0] ==
        "checkpoints/step_00000200: optim-00003-of-00004.safetensors: missing (shard 3 of 4); falling back to "
        "step_00000100");
  // state.json must announce a usable count
  const std::string d300 = cm.save(
      300, [](const std::string& dir) { fs::write_file(dir + "/state.json", R"({"step": 300, "optimizer": {"shards": 0}})"); },
      0);
  CHECK(CheckpointManager::verify(d300) == "state.json: optimizer.shards is not a positive integer");
}

}  // TEST_SUITE

namespace {

// 23 parameters in a root unit ("a"), a unit "u" (w, b) and a root unit ("c"); `world`
// ZeRO-3 ranks (rank `rank`) or, with world = 0, one unsharded store. AdamW stepped 3 times
// with grads cos(0.7 i + 1.3 s) of the flat index i.
struct UnitModel {
  std::unique_ptr<Backend> be = make_backend("cpu");
  ParamStore ps;
  std::unique_ptr<Optimizer> opt;
  UnitModel(int rank, int world) {
    ps.declare({"a", Shape{4}, Init::Zeros, 0, false});
    ps.begin_unit("u");
    ps.declare({"w", Shape{3, 5}, Init::Zeros, 0, true});
    ps.declare({"b", Shape{3}, Init::Zeros, 0, false});
    ps.end_unit();
    ps.declare({"c", Shape{1}, Init::Zeros, 0, true});
    if (world > 0) ps.set_sharding(rank, world);
    ps.finalize(*be);
    ps.initialize(1);
    opt = std::make_unique<AdamW>(ps, AdamWConfig{}, FlatRange{});
    for (int s = 0; s < 3; ++s) {
      std::vector<float> g(kTotal);
      for (int i = 0; i < kTotal; ++i) g[size_t(i)] = float(std::cos(0.7 * i + 1.3 * s));
      if (world == 0) {
        be->copy_from_host(ps.flat_grads().data, g.data(), g.size() * 4);
      } else {
        for (const FlatPiece& p : ps.shard_pieces())
          be->copy_from_host(static_cast<float*>(ps.shard_grads().data) + p.local, g.data() + p.global,
                             size_t(p.count) * 4);
      }
      opt->step(0.1f, 1.f);
    }
  }
};

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("optim shards: ZeRO-3 files hold one range per unit and give any range bit for bit") {
  UnitModel full(0, 0);
  REQUIRE(full.ps.units().size() == 3);
  CHECK(full.ps.units()[1].name == "u");
  CHECK(full.ps.units()[0].root);
  for (int world : {2, 3, 5}) {
    TmpDir t;
    for (int r = 0; r < world; ++r) {
      UnitModel m(r, world);
      write_optim_shard(*m.opt, m.ps, 3, t.path, r, world);
    }
    // rank 0 of 2 owns a piece of each unit: [0, 2) of "a", [4, 13) of "u", [22, 23) of "c"
    if (world == 2) {
      SafetensorsReader r0(t.path + "/" + flat_shard_name(FlatKind::Optimizer, 0, 2));
      CHECK(r0.metadata().at("ranges") == "0:2,4:13,22:23");
      CHECK(r0.shape("exp_avg") == std::vector<int64_t>{12});
    }
    CHECK(problem(t.path) == "");
    FlatShards sh(t.path, FlatKind::Optimizer);
    for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, kTotal}, {3, 17}, {22, 23}, {5, 5}})
      for (const char* name : {"exp_avg", "exp_avg_sq"}) {
        INFO(world << " ranks, " << name << " [" << b << ", " << e << ")");
        CHECK(sh.read(name, b, e) == slice(*full.opt, name, b, e));
      }
  }
}

TEST_CASE("optim shards: a bad ranges entry in the metadata is an error naming the file") {
  TmpDir t;
  std::vector<float> m(4, 1.f);
  int64_t step = 3;
  write_safetensors(t.path + "/" + flat_shard_name(FlatKind::Optimizer, 0, 1),
                    {{"momentum", "F32", {4}, m.data(), m.size() * 4}, {"step", "I64", {}, &step, 8}},
                    {{"optimizer", "sgd"}, {"shard_index", "0"}, {"shard_count", "1"}, {"range_begin", "0"},
                     {"range_end", "4"}, {"num_params", "4"}, {"ranges", "0:2,x:4"}});
  CHECK(problem(t.path) == "optim-00000-of-00001.safetensors: __metadata__ 'ranges': 'x:4' is not begin:end");
}

}  // TEST_SUITE

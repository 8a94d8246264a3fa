// ZeRO-3 model shard files (checkpoint/flat_shards.h) read through checkpoint/model_tensors.h: every rank
// of a ZeRO-3 store writes its pieces of the parameters, and the set gives every tensor of the
// unsharded model in PyTorch's layout bit for bit (conv weights OIHW, GPT's padded vocabulary
// cut to its real rows, BatchNorm buffers and counters), a store of another shard geometry
// reads its own pieces back, and a missing, misplaced or foreign file is an error naming it.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "nn/params.h"
#include "test_util.h"
#include "config/config.h"
#include "checkpoint/flat_shards.h"
#include "plan/memory_probe.h"
#include "session/session.h"
#include "checkpoint/model_tensors.h"
#include "session/runtime.h"
#include "checkpoint/safetensors.h"

using namespace dtrain;
using test_util::TmpDir;

namespace {

// A ResNet (OHWI convolutions, BatchNorm buffers and counters, stages as units) or a GPT
// (blocks as units, the vocabulary of 200 padded in the flat layout).
std::string recipe(const std::string& kind, int width = 4) {
  if (kind == "resnet")
    return "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = " + std::to_string(width) +
           "\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
           "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n";
  return "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 16\nblock_size = 8\nvocab_size = 200\n"
         "[data]\nkind = \"synthetic\"\n";
}

// The recipe's model on the CPU, sharded as rank `rank` of `world` (world 0: not sharded),
// initialised from `seed`, its buffers and counters set to values of their own.
std::unique_ptr<Runtime> model(const Config& cfg, Backend& be, int rank, int world, uint64_t seed) {
  std::unique_ptr<Runtime> rt = declare_model(cfg);
  ParamStore& ps = rt->params;
  if (world > 0) ps.set_sharding(rank, world);
  ps.finalize(be);
  ps.initialize(seed);
  std::vector<float> b(size_t(ps.num_buffer_elements()));
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(std::cos(0.37 * double(i) + double(seed)));
  if (!b.empty()) be.copy_from_host(ps.flat_buffers().data, b.data(), b.size() * 4);
  for (size_t i = 0; i < ps.counter_values().size(); ++i) ps.counter(int(i)) = int64_t(seed * 10 + i);
  return rt;
}

// Writes every rank's model shard of a `world`-way ZeRO-3 split of `cfg`'s model (seed 9) and
// the recipe into dir.
void write_shards(const Config& cfg, Backend& be, const std::string& dir, int world) {
  fs::write_file(dir + "/config.toml", cfg.to_toml());
  for (int r = 0; r < world; ++r) write_model_shard(model(cfg, be, r, world, 9)->params, 5, dir, r, world);
}

std::string bytes_of(const ModelTensors& m, const std::string& name) {
  std::string b(m.nbytes(name), '\0');
  m.read(name, b.data(), b.size());
  return b;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("model shards: a ZeRO-3 model's shards give every tensor of the unsharded model bit for bit") {
  auto be = make_backend("cpu");
  for (const std::string kind : {"resnet", "gpt"})
    for (int world : {2, 3}) {
      INFO(kind << " on " << world << " ranks");
      TmpDir t;
      const Config cfg = Config::parse(recipe(kind), kind + ".toml");
      write_shards(cfg, *be, t.path, world);
      const auto one = model(cfg, *be, 0, 0, 9);
      const std::vector<ParamStore::Exported> ref = one->params.export_state();

      ModelTensors mt(t.path);
      REQUIRE(mt.sharded());
      CHECK(mt.shards()->count() == world);
      CHECK(mt.shards()->step() == 5);
      CHECK(mt.origin() == t.path + "/model-*-of-0000" + std::to_string(world) + ".safetensors");
      REQUIRE(mt.names().size() == ref.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        const ParamStore::Exported& x = ref[i];
        INFO(x.name);
        CHECK(mt.names()[i] == x.name);
        CHECK(mt.dtype(x.name) == x.dtype);
        CHECK(mt.shape(x.name) == x.shape);
        CHECK(bytes_of(mt, x.name) == std::string(x.bytes.begin(), x.bytes.end()));
      }
      CHECK_FALSE(mt.has("params"));  // the flat tensor is not a tensor of the model
      if (kind == "gpt") CHECK(mt.shape("transformer.wte.weight") == std::vector<int64_t>{200, 16});
      if (kind == "resnet") CHECK(mt.shape("conv1.weight") == std::vector<int64_t>{4, 1, 3, 3});

      // an unsharded store reads every tensor back by name
      const auto back = model(cfg, *be, 0, 0, 1);
      back->params.import_state(mt.lookup(), mt.origin());
      const auto again = back->params.export_state();
      for (size_t i = 0; i < ref.size(); ++i) CHECK(again[i].bytes == ref[i].bytes);

      // a store sharded another way (2 <-> 3 ranks) reads its own pieces and no more
      std::vector<float> flat(size_t(one->params.num_params()));
      be->copy_to_host(flat.data(), one->params.flat_params().data, flat.size() * 4);
      const int other = world == 2 ? 3 : 2;
      for (int r = 0; r < other; ++r) {
        const auto s = model(cfg, *be, r, other, 1);
        int64_t asked = 0;
        s->params.import_shard(
            [&](int64_t b, int64_t e, float* dst) {
              mt.shards()->read_into("params", b, e, dst);
              asked += e - b;
            },
            mt.lookup(), mt.origin());
        std::vector<float> want;
        for (const FlatPiece& p : s->params.shard_pieces())
          want.insert(want.end(), flat.begin() + p.global, flat.begin() + p.global + p.count);
        CHECK(s->params.shard_values() == want);
        CHECK(asked == int64_t(want.size()));
        CHECK(s->params.export_buffers().size() == one->params.export_buffers().size());
        for (size_t i = 0; i < s->params.export_buffers().size(); ++i)
          CHECK(s->params.export_buffers()[i].bytes == one->params.export_buffers()[i].bytes);
      }
    }
}

TEST_CASE("model shards: a missing or misplaced or foreign shard file is an error naming it") {
  auto be = make_backend("cpu");
  const Config cfg = Config::parse(recipe("resnet"), "resnet.toml");
  auto fails = [](const std::string& dir, const std::string& what) {
    CHECK_THROWS_WITH_AS(ModelTensors{dir}, doctest::Contains(what.c_str()), UserError);
  };
  SUBCASE("a missing shard") {
    TmpDir t;
    write_shards(cfg, *be, t.path, 3);
    std::filesystem::remove(t.path + "/model-00001-of-00003.safetensors");
    fails(t.path, t.path + "/model-00001-of-00003.safetensors: missing (shard 1 of 3)");
    CHECK(flat_shards_problem(t.path, FlatKind::Model, 3) == "model-00001-of-00003.safetensors: missing (shard 1 of 3)");
  }
  SUBCASE("shards of another count than state.json announces") {
    TmpDir t;
    write_shards(cfg, *be, t.path, 2);
    CHECK(flat_shards_problem(t.path, FlatKind::Model, 4) ==
          "model-00000-of-00002.safetensors: belongs to a set of 2 shards but state.json announces 4");
    CHECK(flat_shards_problem(t.path, FlatKind::Model, 2) == "");
    CHECK(flat_shards_problem(t.path, FlatKind::Optimizer, -1) == "");  // model files are not optimizer files
  }
  SUBCASE("a buffer in a shard other than 0") {
    TmpDir t;
    write_shards(cfg, *be, t.path, 2);
    const std::string f = t.path + "/model-00001-of-00002.safetensors";
    SafetensorsReader r(f);
    std::vector<uint8_t> p(r.nbytes("params"));
    r.read("params", p.data(), p.size());
    const float extra = 1.f;
    std::map<std::string, std::string> meta = r.metadata();
    write_safetensors(f + ".new", {{"params", "F32", r.shape("params"), p.data(), p.size()},
                                   {"bn1.running_mean", "F32", {1}, &extra, 4}}, meta);
    std::filesystem::rename(f + ".new", f);
    fails(t.path, f + ": tensor 'bn1.running_mean' beside the parameters (only shard 0 holds the buffers)");
  }
  SUBCASE("the recipe of another model, or none") {
    TmpDir t;
    write_shards(cfg, *be, t.path, 2);
    fs::write_file(t.path + "/config.toml", Config::parse(recipe("resnet", 8), "wide.toml").to_toml());
    fails(t.path, ": files of different runs?");
    std::filesystem::remove(t.path + "/config.toml");
    fails(t.path, t.path + "/config.toml: missing (the model shards' layout comes from the checkpoint's recipe)");
  }
  SUBCASE("a truncated shard") {
    TmpDir t;
    write_shards(cfg, *be, t.path, 2);
    std::filesystem::resize_file(t.path + "/model-00000-of-00002.safetensors", 40);
    fails(t.path, t.path + "/model-00000-of-00002.safetensors");
  }
  SUBCASE("no model at all") {
    TmpDir t;
    fails(t.path, t.path + ": no model.safetensors and no model shards");
  }
}

}  // TEST_SUITE

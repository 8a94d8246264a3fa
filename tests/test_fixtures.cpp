// Stored PyTorch references (tests/fixtures/, written by scripts/make_fixtures.py): fixed
// weights and inputs, and PyTorch's outputs, loss and every gradient (float64 math, stored
// as f32). dtrain loads the weights with ParamStore::import_state (the checkpoint path) and
// must reproduce all of them within 1e-4 relative, without Python at test time.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"
#include "models/gpt.h"
#include "op_harness.h"
#include "train/safetensors.h"

using namespace dtrain;
using testing::HostVec;
namespace fs = std::filesystem;

namespace {

// Every tensor of the shards tests/fixtures/<prefix>.<k>.safetensors, by name.
class Fixture {
 public:
  explicit Fixture(const std::string& prefix) {
    const fs::path dir = fs::path(DTRAIN_SOURCE_DIR) / "tests" / "fixtures";
    for (int k = 0;; ++k) {
      const fs::path p = dir / (prefix + "." + std::to_string(k) + ".safetensors");
      if (!fs::exists(p)) break;
      readers_.push_back(std::make_unique<SafetensorsReader>(p.string()));
      for (const auto& n : readers_.back()->names()) where_[n] = readers_.back().get();
    }
    REQUIRE_MESSAGE(!readers_.empty(), "no fixture " << prefix << ".0.safetensors in " << dir);
  }
  bool has(const std::string& n) const { return where_.count(n) != 0; }
  std::vector<int64_t> shape(const std::string& n) const { return at(n).shape(n); }
  HostVec f32(const std::string& n) const {
    const SafetensorsReader& r = at(n);
    REQUIRE(r.dtype(n) == "F32");
    HostVec v(r.nbytes(n) / 4);
    r.read(n, v.data(), v.size() * 4);
    return v;
  }
  std::vector<int32_t> ids(const std::string& n) const {
    std::vector<int32_t> out;
    for (float f : f32(n)) out.push_back(int32_t(f));
    return out;
  }
  const std::map<std::string, const SafetensorsReader*>& names() const { return where_; }
  // import_state source over the weight shards (kept alive in `hold`).
  TensorLookup lookup() {
    return [this](const std::string& name) -> std::optional<ImportTensor> {
      if (!has(name)) return std::nullopt;
      HostVec& v = hold_[name] = f32(name);
      ImportTensor t;
      t.dtype = "F32";
      t.shape = shape(name);
      t.data = reinterpret_cast<const uint8_t*>(v.data());
      t.nbytes = v.size() * 4;
      return t;
    };
  }

 private:
  const SafetensorsReader& at(const std::string& n) const {
    auto it = where_.find(n);
    REQUIRE_MESSAGE(it != where_.end(), "fixture tensor " << n << " missing");
    return *it->second;
  }
  std::vector<std::unique_ptr<SafetensorsReader>> readers_;
  std::map<std::string, const SafetensorsReader*> where_;
  std::map<std::string, HostVec> hold_;
};

HostVec to_host(Backend& be, const Tensor& t) {
  HostVec v(size_t(t.numel()));
  be.copy_to_host(v.data(), t.data, v.size() * 4);
  return v;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("fixture gpt2: logits, loss and every gradient equal stored PyTorch results") {
  Fixture w("gpt2.weights"), io("gpt2.io"), gr("gpt2.grads");
  auto be = make_backend("cpu");
  GptSpec s;
  s.n_layer = 2, s.n_head = 2, s.n_embd = 64, s.block_size = 16, s.vocab_size = 100;
  ParamStore ps;
  auto model = build_gpt(s, ps);
  ps.finalize(*be);
  ps.import_state(w.lookup(), "tests/fixtures/gpt2.weights");
  CHECK(ps.state_entries().size() == w.names().size());  // every stored weight is used

  const auto ids = io.ids("ids"), tgt = io.ids("targets");
  const int64_t B = io.shape("ids")[0], T = io.shape("ids")[1], V = s.vocab_size;
  Arena arena(*be);
  Ctx ctx{*be, arena, /*training=*/true, {}};
  Tensor tid = arena.alloc(DType::I32, Shape{B, T});
  Tensor ttg = arena.alloc(DType::I32, Shape{B * T});
  be->copy_from_host(tid.data, ids.data(), ids.size() * 4);
  be->copy_from_host(ttg.data, tgt.data(), tgt.size() * 4);
  Tensor logits = model->forward(ctx, tid);
  GptLoss loss;
  const HostVec losses = to_host(*be, loss.forward(ctx, logits, ttg, V));
  model->backward(ctx, loss.backward());

  const int64_t Vp = model->spec().padded_vocab;
  const HostVec lg = to_host(*be, logits);
  HostVec lgv;
  for (int64_t i = 0; i < B * T; ++i) lgv.insert(lgv.end(), lg.begin() + i * Vp, lg.begin() + i * Vp + V);
  CHECK(testing::nerr(lgv, io.f32("logits")) < 1e-4);
  double mean = 0;
  for (float l : losses) mean += l;
  mean /= double(losses.size());
  CHECK(mean == doctest::Approx(io.f32("loss")[0]).epsilon(1e-4));

  const HostVec g = to_host(*be, ps.flat_grads());
  int compared = 0;
  for (const auto& d : ps.params()) {
    const HostVec want = gr.f32(d.name);
    HostVec got(g.begin() + d.offset, g.begin() + d.offset + int64_t(want.size()));
    CAPTURE(d.name);
    CHECK(testing::nerr(got, want) < 1e-4);
    CHECK(!testing::all_zero(want));
    ++compared;
  }
  CHECK(compared == int(gr.names().size()));
}

}  // TEST_SUITE

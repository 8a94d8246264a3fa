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
#include "models/resnet.h"
#include "models/unet.h"
#include "nn/loss.h"
#include "op_harness.h"
#include "checkpoint/safetensors.h"

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
      const SafetensorsReader& r = at(name);
      std::vector<uint8_t>& v = hold_[name];
      v.resize(r.nbytes(name));
      r.read(name, v.data(), v.size());
      ImportTensor t;
      t.dtype = r.dtype(name);  // F32, or I64 for BatchNorm's num_batches_tracked
      t.shape = shape(name);
      t.data = v.data();
      t.nbytes = v.size();
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
  std::map<std::string, std::vector<uint8_t>> hold_;
};

HostVec to_host(Backend& be, const Tensor& t) {
  HostVec v(size_t(t.numel()));
  be.copy_to_host(v.data(), t.data, v.size() * 4);
  return v;
}

// Every gradient of `ps` (PyTorch layout) against the fixture's.
void check_grads(Backend& be, const ParamStore& ps, const Fixture& gr) {
  const HostVec g = to_host(be, ps.flat_grads());
  int compared = 0;
  for (const auto& d : ps.params()) {
    const HostVec want = gr.f32(d.name);
    HostVec got(want.size());
    REQUIRE(int64_t(want.size()) <= d.shape.numel());
    if (d.layout == Layout::OHWI)
      ohwi_to_oihw(g.data() + d.offset, got.data(), d.shape);
    else
      std::copy(g.begin() + d.offset, g.begin() + d.offset + int64_t(want.size()), got.begin());
    CAPTURE(d.name);
    CHECK(testing::nerr(got, want) < 1e-4);
    CHECK(!testing::all_zero(want));
    ++compared;
  }
  CHECK(compared == int(gr.names().size()));
}

// A ResNet / U-Net fixture: train-mode forward of the stored NHWC input, the loss, backward.
void check_image_fixture(const std::string& prefix, bool classify,
                         std::unique_ptr<Model> (*build)(ParamStore&)) {
  Fixture w(prefix + ".weights"), io(prefix + ".io"), gr(prefix + ".grads");
  auto be = make_backend("cpu");
  ParamStore ps;
  auto model = build(ps);
  ps.finalize(*be);
  ps.initialize(0);
  ps.import_state(w.lookup(), "tests/fixtures/" + prefix + ".weights");
  CHECK(ps.state_entries().size() == w.names().size());

  Arena arena(*be);
  Ctx ctx{*be, arena, /*training=*/true, {}};
  const auto ish = io.shape("input");
  const HostVec xin = io.f32("input");
  Tensor x = arena.alloc(DType::F32, Shape::from(ish.begin(), ish.end()));
  be->copy_from_host(x.data, xin.data(), xin.size() * 4);
  Tensor y = model->forward(ctx, x);
  const HostVec out = to_host(*be, y);
  CHECK(testing::nerr(out, io.f32("output")) < 1e-4);
  double loss = 0;
  if (classify) {
    const auto lab = io.ids("labels");
    Tensor labels = arena.alloc(DType::I32, Shape{int64_t(lab.size())});
    be->copy_from_host(labels.data, lab.data(), lab.size() * 4);
    SoftmaxCrossEntropy xent(0.1f);
    const HostVec losses = to_host(*be, xent.forward(ctx, y, labels));
    for (float l : losses) loss += l;
    loss /= double(losses.size());
    model->backward(ctx, xent.backward());
  } else {  // loss = sum(y * r): dL/dy = r
    const HostVec r = io.f32("r");
    REQUIRE(r.size() == out.size());
    for (size_t i = 0; i < r.size(); ++i) loss += double(out[i]) * r[i];
    Tensor dy = arena.alloc(DType::F32, y.shape);
    be->copy_from_host(dy.data, r.data(), r.size() * 4);
    model->backward(ctx, dy);
  }
  CHECK(loss == doctest::Approx(io.f32("loss")[0]).epsilon(1e-4));
  check_grads(*be, ps, gr);
}

std::unique_ptr<Model> build_fixture_resnet(ParamStore& ps) {
  ResNetSpec s;
  s.depth = 8, s.width = 4, s.stem = "cifar", s.num_classes = 5, s.in_channels = 3;
  return build_resnet(s, ps);
}

std::unique_ptr<Model> build_fixture_unet(ParamStore& ps) {
  return build_unet(UNetSpec{1, 4, 3, 3, "transpose"}, ps);
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("fixture resnet: BasicBlock ResNet output and loss and every gradient equal stored PyTorch results") {
  check_image_fixture("resnet", true, build_fixture_resnet);
}

TEST_CASE("fixture unet: one-level U-Net output and loss and every gradient equal stored PyTorch results") {
  check_image_fixture("unet", false, build_fixture_unet);
}

TEST_CASE("fixture gpt2: logits and loss and every gradient equal stored PyTorch results") {
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

  check_grads(*be, ps, gr);
}

}  // TEST_SUITE

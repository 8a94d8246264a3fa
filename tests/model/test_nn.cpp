// ParamStore (flat buffers, init, segments, checkpoint export/import) and layers
// (finite-difference gradient checks on the CPU backend).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>

#include "core/rng.h"
#include "nn/layers.h"
#include "nn/loss.h"
#include "nn/params.h"

using namespace dtrain;

namespace {

std::vector<float> to_host(Backend& be, const Tensor& t) {
  std::vector<float> h(static_cast<size_t>(t.numel()));
  if (!h.empty()) be.copy_to_host(h.data(), t.data, h.size() * 4);
  return h;
}
void to_device(Backend& be, const std::vector<float>& h, const Tensor& t) {
  REQUIRE(size_t(t.numel()) == h.size());
  be.copy_from_host(t.data, h.data(), h.size() * 4);
}
// Distinct values, away from 0 and from each other (no ties for max pooling, no ReLU kinks
// within the finite-difference step).
std::vector<float> distinct_values(int64_t n, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = float(i - n / 2) * 0.05f + 0.025f;
  Rng r(seed);
  for (int64_t i = n - 1; i > 0; --i) std::swap(v[size_t(i)], v[size_t(r.below(uint64_t(i + 1)))]);
  return v;
}

// Checks dx and every parameter grad of `m` against central differences of
// L = sum(forward(x) * r). Samples up to `samples` coordinates of x and of the params.
void gradcheck(Backend& be, ParamStore& ps, Module& m, Shape xshape, uint64_t seed,
               double tol = 1e-2, double eps = 1e-3, int samples = 48, bool check_dx = true) {
  Arena arena(be);
  Ctx ctx{be, arena, true};
  Buffer xb(be, size_t(xshape.numel()) * 4);
  Tensor x = xb.tensor(DType::F32, xshape);
  std::vector<float> xh = distinct_values(xshape.numel(), seed);
  to_device(be, xh, x);

  Tensor y = m.forward(ctx, x);
  std::vector<float> r(static_cast<size_t>(y.numel()));
  Rng rng(seed, 7);
  for (auto& v : r) v = rng.normal();
  Tensor dy = arena.alloc(DType::F32, y.shape);
  to_device(be, r, dy);
  ps.zero_grads();
  Tensor dx = m.backward(ctx, dy);
  std::vector<float> dxh = check_dx ? to_host(be, dx) : std::vector<float>();
  std::vector<float> gh = to_host(be, ps.flat_grads());

  auto loss = [&]() {
    arena.reset();
    Tensor yy = m.forward(ctx, x);
    std::vector<float> yh = to_host(be, yy);
    double s = 0;
    for (size_t i = 0; i < yh.size(); ++i) s += double(yh[i]) * r[i];
    return s;
  };
  auto numeric = [&](std::vector<float>& host, const Tensor& dev, size_t i) {
    const float orig = host[i];
    host[i] = orig + float(eps);
    to_device(be, host, dev);
    const double lp = loss();
    host[i] = orig - float(eps);
    to_device(be, host, dev);
    const double lm = loss();
    host[i] = orig;
    to_device(be, host, dev);
    return (lp - lm) / (2 * eps);
  };
  auto compare = [&](const char* what, std::vector<float>& host, const Tensor& dev,
                     const std::vector<float>& analytic, int64_t base) {
    const size_t n = host.size();
    double maxabs = 1e-3, maxerr = 0;
    for (size_t k = 0; k < n; ++k) maxabs = std::max(maxabs, double(std::fabs(analytic[base + k])));
    const size_t stride = std::max<size_t>(1, n / size_t(samples));
    for (size_t i = 0; i < n; i += stride) {
      const double num = numeric(host, dev, i);
      maxerr = std::max(maxerr, std::fabs(num - analytic[base + i]));
    }
    INFO(std::string(what) << ": max error " << maxerr << " vs max |grad| " << maxabs);
    CHECK(maxerr <= tol * maxabs);
  };
  if (check_dx) compare("dx", xh, x, dxh, 0);
  std::vector<float> ph = to_host(be, ps.flat_params());
  for (const auto& d : ps.params()) {
    std::vector<float> sub(ph.begin() + d.offset, ph.begin() + d.offset + d.shape.numel());
    compare(d.name.c_str(), sub, ps.param(ps.find_param(d.name)), gh, d.offset);
  }
}

struct Fixture {
  std::unique_ptr<Backend> be = make_backend("cpu");
  ParamStore ps;
};

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("ParamStore: offsets / counts / merged weight-decay segments / PyTorch state entries") {
  Fixture f;
  Conv2d conv(f.ps, "conv1", 3, 8, 3, Conv2dOptions{1, 1, 1, true});
  BatchNorm2d bn(f.ps, "bn1", 8);
  Linear fc(f.ps, "fc", 8, 5);
  CHECK(f.ps.num_params() == 8 * 3 * 3 * 3 + 8 + 16 + 40 + 5);
  CHECK(f.ps.num_buffer_elements() == 16);
  auto segs = f.ps.segments(false);
  REQUIRE(segs.size() == 4);  // conv.w | conv.b bn.w bn.b | fc.w | fc.b
  CHECK((segs[0].offset == 0 && segs[0].count == 216 && segs[0].decay));
  CHECK((segs[1].offset == 216 && segs[1].count == 24 && !segs[1].decay));
  CHECK((segs[2].count == 40 && segs[2].decay));
  CHECK((segs[3].count == 5 && !segs[3].decay));
  auto all = f.ps.segments(true);
  REQUIRE(all.size() == 1);
  CHECK(all[0].count == f.ps.num_params());
  auto e = f.ps.state_entries();
  std::vector<std::string> names;
  for (auto& s : e) names.push_back(s.name);
  CHECK(names == std::vector<std::string>{"conv1.weight", "conv1.bias", "bn1.weight", "bn1.bias",
                                          "bn1.running_mean", "bn1.running_var",
                                          "bn1.num_batches_tracked", "fc.weight", "fc.bias"});
  CHECK(e[0].shape == std::vector<int64_t>{8, 3, 3, 3});  // OIHW in the checkpoint
  CHECK(f.ps.params()[0].shape == Shape{8, 3, 3, 3});     // OHWI inside: [O,KH,KW,I] = 8,3,3,3
  CHECK((e[6].dtype == "I64" && e[6].shape.empty()));
  CHECK(e[7].shape == std::vector<int64_t>{5, 8});
  CHECK_THROWS_AS(f.ps.declare({"fc.bias", Shape{1}}), RuntimeFault);  // duplicate name
}

TEST_CASE("ParamStore: initialization is deterministic and follows the PyTorch initializers") {
  auto stats = [](const std::vector<float>& v, size_t b, size_t n, double* mean, double* sd, double* maxabs) {
    double s = 0, q = 0, m = 0;
    for (size_t i = b; i < b + n; ++i) { s += v[i]; q += double(v[i]) * v[i]; m = std::max(m, double(std::fabs(v[i]))); }
    *mean = s / double(n);
    *sd = std::sqrt(q / double(n) - *mean * *mean);
    *maxabs = m;
  };
  Fixture f;
  Conv2d conv(f.ps, "conv", 32, 64, 3);  // fan_out = 576
  BatchNorm2d bn(f.ps, "bn", 64, BatchNormOptions{0.1f, 1e-5f, true});
  Linear fc(f.ps, "fc", 400, 50);
  f.ps.finalize(*f.be);
  f.ps.initialize(123);
  auto p1 = to_host(*f.be, f.ps.flat_params());
  double mean, sd, mx;
  stats(p1, 0, 18432, &mean, &sd, &mx);
  CHECK(std::fabs(mean) < 0.003);
  CHECK(sd == doctest::Approx(std::sqrt(2.0 / 576)).epsilon(0.03));
  const size_t bn_w = 18432, fc_w = 18432 + 128;
  CHECK(std::all_of(p1.begin() + bn_w, p1.begin() + bn_w + 128, [](float v) { return v == 0.f; }));  // zero_init
  stats(p1, fc_w, 20000, &mean, &sd, &mx);
  CHECK(mx <= 1.0 / std::sqrt(400.0));
  CHECK(sd == doctest::Approx(1.0 / std::sqrt(400.0) / std::sqrt(3.0)).epsilon(0.03));  // U(-b,b): b/sqrt(3)
  stats(p1, fc_w + 20000, 50, &mean, &sd, &mx);
  CHECK(mx <= 1.0 / std::sqrt(400.0));
  CHECK(mx > 0.0);
  auto b = to_host(*f.be, f.ps.flat_buffers());
  CHECK(std::all_of(b.begin(), b.begin() + 64, [](float v) { return v == 0.f; }));
  CHECK(std::all_of(b.begin() + 64, b.end(), [](float v) { return v == 1.f; }));

  f.ps.initialize(123);
  CHECK(to_host(*f.be, f.ps.flat_params()) == p1);
  f.ps.initialize(124);
  CHECK(to_host(*f.be, f.ps.flat_params()) != p1);
}

TEST_CASE("ParamStore: export converts OHWI->OIHW / import validates then restores") {
  Fixture f;
  Conv2d conv(f.ps, "c", 3, 2, 2);  // OHWI [2,2,2,3]
  BatchNorm2d bn(f.ps, "bn", 2);
  f.ps.finalize(*f.be);
  f.ps.initialize(1);
  std::vector<float> w(24);
  std::iota(w.begin(), w.end(), 0.f);  // value = ((o*2+h)*2+w)*3+i
  to_device(*f.be, w, f.ps.param(conv.weight_id()));
  Arena arena(*f.be);
  Ctx ctx{*f.be, arena, true};
  Buffer xb(*f.be, 4 * 2 * 2 * 2 * 4);
  Tensor x = xb.tensor(DType::F32, Shape{4, 2, 2, 2});
  to_device(*f.be, distinct_values(32, 3), x);
  bn.forward(ctx, x);  // num_batches_tracked = 1, running stats move

  auto ex = f.ps.export_state();
  REQUIRE(ex.size() == 6);
  CHECK(ex[0].name == "c.weight");
  CHECK(ex[0].shape == std::vector<int64_t>{2, 3, 2, 2});
  const float* oihw = reinterpret_cast<const float*>(ex[0].bytes.data());
  for (int o = 0; o < 2; ++o)
    for (int i = 0; i < 3; ++i)
      for (int h = 0; h < 2; ++h)
        for (int ww = 0; ww < 2; ++ww)
          CHECK(oihw[((o * 3 + i) * 2 + h) * 2 + ww] == float(((o * 2 + h) * 2 + ww) * 3 + i));
  CHECK(ex[5].name == "bn.num_batches_tracked");
  int64_t nbt;
  std::memcpy(&nbt, ex[5].bytes.data(), 8);
  CHECK(nbt == 1);

  std::map<std::string, ParamStore::Exported> byname;
  for (auto& x2 : ex) byname[x2.name] = x2;
  auto lookup = [&](const std::string& n) -> std::optional<ImportTensor> {
    auto it = byname.find(n);
    if (it == byname.end()) return std::nullopt;
    return ImportTensor{it->second.dtype, it->second.shape, it->second.bytes.data(), it->second.bytes.size()};
  };
  Fixture g;
  Conv2d conv2(g.ps, "c", 3, 2, 2);
  BatchNorm2d bn2(g.ps, "bn", 2);
  g.ps.finalize(*g.be);
  g.ps.initialize(99);
  g.ps.import_state(lookup, "model.safetensors");
  CHECK(to_host(*g.be, g.ps.flat_params()) == to_host(*f.be, f.ps.flat_params()));
  CHECK(to_host(*g.be, g.ps.flat_buffers()) == to_host(*f.be, f.ps.flat_buffers()));
  CHECK(g.ps.counter(0) == 1);

  // errors name the file and the tensor; nothing is modified on failure
  g.ps.initialize(5);
  auto before = to_host(*g.be, g.ps.flat_params());
  byname["bn.running_var"].shape = {3};
  CHECK_THROWS_WITH_AS(g.ps.import_state(lookup, "model.safetensors"),
                       "model.safetensors: tensor 'bn.running_var': expected F32 [2], got F32 [3]",
                       UserError);
  CHECK(to_host(*g.be, g.ps.flat_params()) == before);
  byname.erase("bn.bias");
  CHECK_THROWS_WITH_AS(g.ps.import_state(lookup, "m.safetensors"),
                       "m.safetensors: tensor 'bn.bias' is missing (expected F32 [2])", UserError);
}

TEST_CASE("Conv2d gradients match finite differences (bias / stride / padding / dilation)") {
  {
    Fixture f;
    Conv2d c(f.ps, "c", 3, 4, 3, Conv2dOptions{2, 1, 1, true});
    f.ps.finalize(*f.be);
    f.ps.initialize(1);
    gradcheck(*f.be, f.ps, c, Shape{2, 5, 6, 3}, 11);
  }
  {
    Fixture f;
    Conv2d c(f.ps, "c", 2, 3, 3, Conv2dOptions{1, 2, 2, false});
    f.ps.finalize(*f.be);
    f.ps.initialize(2);
    gradcheck(*f.be, f.ps, c, Shape{1, 5, 5, 2}, 12);
  }
}

TEST_CASE("Linear / ReLU / MaxPool2d / GlobalAvgPool / Flatten gradients match finite differences") {
  {
    Fixture f;
    Linear l(f.ps, "fc", 6, 4);
    f.ps.finalize(*f.be);
    f.ps.initialize(3);
    gradcheck(*f.be, f.ps, l, Shape{5, 6}, 13);
  }
  {
    Fixture f;
    Sequential s;
    s.add<MaxPool2d>(3, 2, 1);
    s.add<ReLU>();
    s.add<GlobalAvgPool>();
    f.ps.finalize(*f.be);
    gradcheck(*f.be, f.ps, s, Shape{2, 7, 6, 3}, 14);
  }
  {
    Fixture f;
    Sequential s;
    s.add<Flatten>();
    s.add<Linear>(f.ps, "fc", 2 * 3 * 2, 3);
    f.ps.finalize(*f.be);
    f.ps.initialize(4);
    gradcheck(*f.be, f.ps, s, Shape{3, 2, 3, 2}, 15);
  }
}

TEST_CASE("BatchNorm2d (training mode) gradients match finite differences") {
  Fixture f;
  Sequential s;
  s.add<BatchNorm2d>(f.ps, "bn", 3);
  s.add<ReLU>(true);  // in place over the BN output: BN keeps its input, not its output
  f.ps.finalize(*f.be);
  f.ps.initialize(5);
  std::vector<float> gb = {0.5f, 1.5f, -0.7f, 0.1f, -0.2f, 0.3f};  // weight, bias
  to_device(*f.be, gb, f.ps.flat_params());
  gradcheck(*f.be, f.ps, s, Shape{2, 3, 3, 3}, 16, 2e-2);
}

TEST_CASE("BatchNorm2d: running statistics / num_batches_tracked and eval mode as PyTorch") {
  Fixture f;
  BatchNorm2d bn(f.ps, "bn", 2);
  f.ps.finalize(*f.be);
  f.ps.initialize(0);
  Arena arena(*f.be);
  Ctx ctx{*f.be, arena, true};
  Buffer xb(*f.be, 4 * 4 * 2);
  Tensor x = xb.tensor(DType::F32, Shape{4, 2});
  std::vector<float> xh = {1, 10, 2, 20, 3, 30, 6, 40};  // ch0 mean 3 var_unbiased 14/3; ch1 mean 25 var 166.67
  to_device(*f.be, xh, x);
  bn.forward(ctx, x);
  auto b = to_host(*f.be, f.ps.flat_buffers());
  CHECK(b[0] == doctest::Approx(0.3));
  CHECK(b[1] == doctest::Approx(2.5));
  CHECK(b[2] == doctest::Approx(0.9 + 0.1 * 14.0 / 3.0));
  CHECK(b[3] == doctest::Approx(0.9 + 0.1 * 500.0 / 3.0));
  CHECK(f.ps.counter(0) == 1);
  ctx.training = false;
  Tensor y = bn.forward(ctx, x);
  auto yh = to_host(*f.be, y);
  CHECK(yh[0] == doctest::Approx((1 - b[0]) / std::sqrt(b[2] + 1e-5)));
  CHECK(f.ps.counter(0) == 1);  // eval does not count
  CHECK_THROWS_AS(bn.backward(ctx, y), RuntimeFault);
}

TEST_CASE("backward accumulates parameter grads and ReLU in place gives the same result") {
  Fixture f;
  Sequential a;
  a.add<Conv2d>(f.ps, "c", 2, 3, 3, Conv2dOptions{1, 1, 1, true});
  a.add<BatchNorm2d>(f.ps, "bn", 3);
  a.add<ReLU>(false);
  a.add<GlobalAvgPool>();
  f.ps.finalize(*f.be);
  f.ps.initialize(8);
  Fixture g;
  Sequential b;
  b.add<Conv2d>(g.ps, "c", 2, 3, 3, Conv2dOptions{1, 1, 1, true});
  b.add<BatchNorm2d>(g.ps, "bn", 3);
  b.add<ReLU>(true);
  b.add<GlobalAvgPool>();
  g.ps.finalize(*g.be);
  g.ps.initialize(8);

  auto run = [](Fixture& fx, Sequential& s, int times) {
    Arena arena(*fx.be);
    Ctx ctx{*fx.be, arena, true};
    Buffer xb(*fx.be, 2 * 4 * 4 * 2 * 4);
    Tensor x = xb.tensor(DType::F32, Shape{2, 4, 4, 2});
    to_device(*fx.be, distinct_values(64, 9), x);
    fx.ps.zero_grads();
    std::vector<float> dx;
    for (int k = 0; k < times; ++k) {
      Tensor y = s.forward(ctx, x);
      Tensor dy = arena.alloc(DType::F32, y.shape);
      to_device(*fx.be, std::vector<float>(size_t(y.numel()), 1.f), dy);
      dx = to_host(*fx.be, s.backward(ctx, dy));
      arena.reset();
    }
    return std::make_pair(to_host(*fx.be, fx.ps.flat_grads()), dx);
  };
  auto [g1, dx1] = run(f, a, 1);
  auto [g2, dx2] = run(f, a, 2);
  for (size_t i = 0; i < g1.size(); ++i) CHECK(g2[i] == doctest::Approx(2 * g1[i]).epsilon(1e-5));
  auto [gi, dxi] = run(g, b, 1);
  CHECK(gi == g1);
  CHECK(dxi == dx1);
}

TEST_CASE("softmax cross-entropy: mean loss / label smoothing / gradient scale") {
  Fixture f;
  Arena arena(*f.be);
  Ctx ctx{*f.be, arena, true};
  Buffer lb(*f.be, 2 * 3 * 4), yb(*f.be, 2 * 4);
  Tensor logits = lb.tensor(DType::F32, Shape{2, 3});
  Tensor labels = yb.tensor(DType::I32, Shape{2});
  to_device(*f.be, {1.f, 2.f, 3.f, 0.5f, -1.f, 0.f}, logits);
  const int32_t lab[2] = {2, 0};
  f.be->copy_from_host(labels.data, lab, 8);
  SoftmaxCrossEntropy xent(0.1f);
  Tensor losses = xent.forward(ctx, logits, labels, 8.f);
  // reference: torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)
  auto ce = [](std::vector<double> z, int t, double eps) {
    double m = *std::max_element(z.begin(), z.end()), s = 0;
    for (double v : z) s += std::exp(v - m);
    double lse = m + std::log(s), l = 0;
    for (size_t k = 0; k < z.size(); ++k) l -= ((k == size_t(t) ? 1 - eps : 0) + eps / 3) * (z[k] - lse);
    return l;
  };
  const double want = (ce({1, 2, 3}, 2, 0.1) + ce({0.5, -1, 0}, 0, 0.1)) / 2;
  CHECK(mean_loss(*f.be, losses) == doctest::Approx(want).epsilon(1e-6));
  // dlogits = 8 * d(mean)/dlogits: check by finite differences of the mean loss
  auto d = to_host(*f.be, xent.backward());
  std::vector<double> z = {1, 2, 3, 0.5, -1, 0};
  for (int k = 0; k < 6; ++k) {
    auto zp = z, zm = z;
    zp[size_t(k)] += 1e-5;
    zm[size_t(k)] -= 1e-5;
    auto mean = [&](const std::vector<double>& v) {
      return (ce({v[0], v[1], v[2]}, 2, 0.1) + ce({v[3], v[4], v[5]}, 0, 0.1)) / 2;
    };
    CHECK(d[size_t(k)] == doctest::Approx(8 * (mean(zp) - mean(zm)) / 2e-5).epsilon(1e-4));
  }
  CHECK_THROWS_AS(SoftmaxCrossEntropy(1.5f), UserError);
}

TEST_CASE("a convolution larger than its input is a UserError") {
  Fixture f;
  Conv2d c(f.ps, "layer1.0.conv1", 1, 1, 7, Conv2dOptions{2, 0, 1, false});
  f.ps.finalize(*f.be);
  Arena arena(*f.be);
  Ctx ctx{*f.be, arena, true};
  Buffer xb(*f.be, 4 * 4 * 4);
  Tensor x = xb.tensor(DType::F32, Shape{1, 4, 4, 1});
  CHECK_THROWS_WITH_AS(c.forward(ctx, x),
                       doctest::Contains("layer1.0.conv1: input of 4x4 pixels is too small"), UserError);
}
}

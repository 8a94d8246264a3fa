// Mixed precision (DESIGN: Precision): the fp16 loss scaler, the compute-dtype copy of the
// weights, the mixed-dtype ops it relies on (16-bit activations, f32 weight gradients), and
// whole training steps of each model family in bf16 / fp16 against fp32 on the CPU, where
// 16-bit storage is emulated. The same steps on CUDA against the CPU are in the gpu suite
// (a visible skip without a device).
#include <doctest/doctest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>

#include "skip.h"
#include "backend/backend.h"
#include "core/buffer.h"
#include "core/rng.h"
#include "optim/loss_scaler.h"
#include "session/step.h"
#include "train_fixtures.h"

using namespace dtrain;

namespace {

std::string model_block(const std::string& family) {
  if (family == "resnet")
    return R"(
[model]
kind = "resnet"
depth = 8
width = 4
stem = "cifar"
in_channels = 3
num_classes = 10
[data]
kind = "synthetic"
synthetic_height = 16
synthetic_width = 16
[optim]
name = "sgd"
lr = 0.05
momentum = 0.9
)";
  if (family == "gpt")
    return R"(
[model]
kind = "gpt"
n_layer = 2
n_head = 2
n_embd = 32
block_size = 16
vocab_size = 96
[data]
kind = "synthetic"
[optim]
name = "adamw"
lr = 1e-3
)";
  REQUIRE(family == "unet");
  return R"(
[model]
kind = "unet"
depth = 2
base_channels = 4
in_channels = 3
num_classes = 3
[data]
kind = "synthetic"
synthetic_height = 16
synthetic_width = 16
[train]
dice_weight = 0.5
[optim]
name = "adamw"
lr = 1e-3
)";
}

// A session of `family` on synthetic data computing in `dtype`. fp16 runs with a loss
// scale of 256 unless `extra` says otherwise (the closeness checks want no skipped step).
std::unique_ptr<Session> session(const std::string& family, const std::string& dtype,
                                 const std::string& device = "cpu", const std::string& extra = "") {
  std::string text = "[run]\nseed = 5\nthreads = 2\ndevice = \"" + device + "\"\n" + model_block(family);
  // batch size: the [train] table may already exist (unet)
  const std::string batch = family == "gpt" ? "4" : "8";
  if (text.find("[train]") == std::string::npos) text += "[train]\n";
  text.insert(text.find("[train]") + 8, "batch_size = " + batch + "\nmax_steps = 10\n");
  text += "[precision]\ndtype = \"" + dtype + "\"\ntf32 = false\n";
  if (extra.find("loss_scale") == std::string::npos) text += "loss_scale = 256.0\n";
  text += extra;
  return make_session(Config::parse(text, family + "_" + dtype + ".toml"), SessionOptions{});
}

std::vector<float> host(Session& s, const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  s.be->copy_to_host(v.data(), t.data, t.nbytes());
  return v;
}

// ||a/scale_a - b|| / ||b||
double rel_l2(const std::vector<float>& a, const std::vector<float>& b, double scale_a = 1.0) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) / scale_a - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

bool host_equal(Backend& be, const Tensor& a, const Tensor& b) {
  std::vector<float> x(size_t(a.numel())), y(size_t(b.numel()));
  be.copy_to_host(x.data(), a.data, a.nbytes());
  be.copy_to_host(y.data(), b.data, b.nbytes());
  return x == y;
}

bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("loss scaler: overflow skips and halves - clean steps double it after the interval") {
  LossScaler ls(true, 1024.0, 3);
  CHECK(ls.enabled());
  CHECK(ls.scale() == 1024.f);
  CHECK_FALSE(ls.update(false));  // inf/nan: skip
  CHECK(ls.scale() == 512.f);
  CHECK(ls.state().skipped_steps == 1);
  CHECK(ls.update(true));
  CHECK(ls.update(true));
  CHECK(ls.scale() == 512.f);
  CHECK(ls.update(true));  // third clean step in a row: grow
  CHECK(ls.scale() == 1024.f);
  CHECK(ls.state().good_steps == 0);
  CHECK(ls.update(true));
  CHECK_FALSE(ls.update(false));  // an overflow resets the clean-step count
  CHECK(ls.state().good_steps == 0);
  CHECK(ls.scale() == 512.f);
  CHECK(ls.state().skipped_steps == 2);

  LossScaler restored(true, 65536.0, 3);
  restored.restore(ls.state());
  CHECK(restored.scale() == 512.f);
  CHECK(restored.state().skipped_steps == 2);
  CHECK_THROWS_AS(restored.restore(LossScalerState{0.0, 0, 0}), UserError);
  CHECK_THROWS_AS(restored.restore(LossScalerState{std::nan(""), 0, 0}), UserError);
}

TEST_CASE("loss scaler: disabled for fp32 and bf16 - scale 1 and every step applies") {
  LossScaler off(false, 65536.0, 2000);
  CHECK(off.scale() == 1.f);
  CHECK(off.update(false));
  CHECK(off.state().skipped_steps == 0);
  CHECK(off.scale() == 1.f);
}

TEST_CASE("param store: the compute copy is the master rounded to bf16 or fp16 and follows refresh") {
  for (DType t : {DType::BF16, DType::F16}) {
    auto be = make_backend("cpu");
    ParamStore ps;
    ParamDesc d;
    d.name = "w";
    d.shape = Shape{5, 7};
    d.init = Init::Normal;
    d.init_arg = 1.f;
    const int id = ps.declare(d);
    ps.set_compute_dtype(t);
    ps.finalize(*be);
    ps.initialize(11);
    CHECK(ps.mixed());
    CHECK(ps.param(id).dtype == DType::F32);
    CHECK(ps.cparam(id).dtype == t);
    auto check_rounded = [&] {
      std::vector<float> master(35);
      be->copy_to_host(master.data(), ps.param(id).data, 35 * 4);
      std::vector<uint16_t> low(35);
      be->copy_to_host(low.data(), ps.cparam(id).data, 35 * 2);
      for (size_t i = 0; i < 35; ++i) {
        const uint16_t want = t == DType::BF16 ? f32_to_bf16(master[i]) : f32_to_f16(master[i]);
        REQUIRE(low[i] == want);
      }
    };
    check_rounded();
    Tensor p = ps.flat_params();
    be->scale(p, 3.f);  // the master changes (an optimizer step) ...
    ps.refresh_compute();  // ... and the copy follows
    check_rounded();
  }
  auto be = make_backend("cpu");
  ParamStore plain;  // fp32: cparam is the master itself
  ParamDesc d;
  d.name = "w";
  d.shape = Shape{3};
  const int id = plain.declare(d);
  plain.finalize(*be);
  CHECK_FALSE(plain.mixed());
  CHECK(plain.cparam(id).data == plain.param(id).data);
}

TEST_CASE("cpu backend: cast between f32 and fp16 or bf16 equals the scalar reference conversions") {
  // The cast loops have vectorised paths (F16C for fp16); they must round exactly like
  // core/dtype's round-to-nearest-even conversions, subnormals and overflow included.
  auto be = make_backend("cpu", 0, 2);
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i);
  std::vector<float> probes;
  Rng r(9, 9);
  for (int i = 0; i < 20000; ++i) probes.push_back(r.normal() * std::ldexp(1.f, int(r.below(60)) - 30));
  for (float v : {0.f, -0.f, 65504.f, 65519.f, 65520.f, 1e9f, -1e9f, 5.96e-8f, 2.98e-8f, 6.1e-5f, 1.f + 1.f / 2048,
                  1.f + 3.f / 2048, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()})
    probes.push_back(v);
  for (DType t : {DType::F16, DType::BF16}) {
    CAPTURE(dtype_name(t));
    Buffer lo(*be, all.size() * 2), wide(*be, all.size() * 4);
    be->copy_from_host(lo.data(), all.data(), all.size() * 2);
    Tensor tl = lo.tensor(t, Shape{int64_t(all.size())}), tw = wide.tensor(DType::F32, Shape{int64_t(all.size())});
    be->cast(tl, tw);
    std::vector<float> got(all.size());
    be->copy_to_host(got.data(), tw.data, got.size() * 4);
    for (size_t i = 0; i < all.size(); ++i) {
      const float want = t == DType::F16 ? f16_to_f32(all[i]) : bf16_to_f32(all[i]);
      if (std::isnan(want)) {
        REQUIRE(std::isnan(got[i]));
      } else {
        REQUIRE(std::memcmp(&got[i], &want, 4) == 0);
      }
    }
    Buffer pin(*be, probes.size() * 4), pout(*be, probes.size() * 2);
    be->copy_from_host(pin.data(), probes.data(), probes.size() * 4);
    Tensor ti = pin.tensor(DType::F32, Shape{int64_t(probes.size())}), to = pout.tensor(t, Shape{int64_t(probes.size())});
    be->cast(ti, to);
    std::vector<uint16_t> bits(probes.size());
    be->copy_to_host(bits.data(), to.data, bits.size() * 2);
    for (size_t i = 0; i < probes.size(); ++i) {
      CAPTURE(probes[i]);
      REQUIRE(bits[i] == (t == DType::F16 ? f32_to_f16(probes[i]) : f32_to_bf16(probes[i])));
    }
  }
}

TEST_CASE("cpu backend: 16-bit gemm and conv filter gradient accumulate into f32 exactly") {
  // The CPU computes 16-bit ops in f32 on the widened values, so a bf16 x bf16 -> f32 GEMM
  // equals the f32 GEMM of the rounded inputs bit for bit (the contract the CUDA path is
  // checked against in the gpu suite).
  auto be = make_backend("cpu", 0, 2);
  Rng r(3, 1);
  auto make = [&](Shape s, DType t, std::vector<float>& rounded) {
    const int64_t n = s.numel();
    rounded.resize(size_t(n));
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const float v = r.normal();
      if (t == DType::BF16) {
        bits[size_t(i)] = f32_to_bf16(v);
        rounded[size_t(i)] = bf16_to_f32(f32_to_bf16(v));
      } else {
        bits[size_t(i)] = f32_to_f16(v);
        rounded[size_t(i)] = f16_to_f32(f32_to_f16(v));
      }
    }
    return bits;
  };
  for (DType t : {DType::BF16, DType::F16}) {
    std::vector<float> ra, rb;
    auto a16 = make(Shape{37, 19}, t, ra);  // dy [M=37, N=19]
    auto b16 = make(Shape{37, 23}, t, rb);  // x  [M=37, K=23]
    Buffer A(*be, a16.size() * 2), B(*be, b16.size() * 2), A32(*be, ra.size() * 4), B32(*be, rb.size() * 4);
    Buffer C(*be, 19 * 23 * 4), Cref(*be, 19 * 23 * 4);
    be->copy_from_host(A.data(), a16.data(), a16.size() * 2);
    be->copy_from_host(B.data(), b16.data(), b16.size() * 2);
    be->copy_from_host(A32.data(), ra.data(), ra.size() * 4);
    be->copy_from_host(B32.data(), rb.data(), rb.size() * 4);
    Tensor c = C.tensor(DType::F32, Shape{19, 23}), cref = Cref.tensor(DType::F32, Shape{19, 23});
    be->fill(c, 0.5f);
    be->fill(cref, 0.5f);
    // dW += dy^T x, as Linear's backward does
    be->gemm(true, false, 1.f, A.tensor(t, Shape{37, 19}), B.tensor(t, Shape{37, 23}), 1.f, c);
    be->gemm(true, false, 1.f, A32.tensor(DType::F32, Shape{37, 19}), B32.tensor(DType::F32, Shape{37, 23}), 1.f,
             cref);
    CHECK(host_equal(*be, c, cref));

    std::vector<float> rx, rdy;
    auto x16 = make(Shape{2, 6, 6, 3}, t, rx);
    auto dy16 = make(Shape{2, 6, 6, 4}, t, rdy);
    Buffer X(*be, x16.size() * 2), DY(*be, dy16.size() * 2), X32(*be, rx.size() * 4), DY32(*be, rdy.size() * 4);
    Buffer W(*be, 4 * 3 * 3 * 3 * 4), Wref(*be, 4 * 3 * 3 * 3 * 4), Bb(*be, 16), Bbref(*be, 16);
    be->copy_from_host(X.data(), x16.data(), x16.size() * 2);
    be->copy_from_host(DY.data(), dy16.data(), dy16.size() * 2);
    be->copy_from_host(X32.data(), rx.data(), rx.size() * 4);
    be->copy_from_host(DY32.data(), rdy.data(), rdy.size() * 4);
    Tensor dw = W.tensor(DType::F32, Shape{4, 3, 3, 3}), dwref = Wref.tensor(DType::F32, Shape{4, 3, 3, 3});
    Tensor db = Bb.tensor(DType::F32, Shape{4}), dbref = Bbref.tensor(DType::F32, Shape{4});
    for (Tensor* z : {&dw, &dwref, &db, &dbref}) be->fill(*z, 0.25f);
    Conv2dParams p;
    p.pad_h = p.pad_w = 1;
    be->conv2d_bwd_filter(X.tensor(t, Shape{2, 6, 6, 3}), DY.tensor(t, Shape{2, 6, 6, 4}), dw, db, p, true);
    be->conv2d_bwd_filter(X32.tensor(DType::F32, Shape{2, 6, 6, 3}), DY32.tensor(DType::F32, Shape{2, 6, 6, 4}), dwref,
                          dbref, p, true);
    CHECK(host_equal(*be, dw, dwref));
    CHECK(host_equal(*be, db, dbref));
  }
}
}  // TEST_SUITE unit

TEST_SUITE("integration") {
TEST_CASE("mixed precision: bf16 and fp16 training steps of every model family follow fp32 on the CPU") {
  // Tolerances from the formats and the data: bf16 keeps 8 significant bits (relative
  // rounding 2^-9), fp16 11 (2^-12). The GPT's gradients agree to ~1% (bf16) / ~0.3% (fp16).
  // The conv nets' gradients agree less (up to ~15% bf16 / ~8% fp16 relative L2 at step 1-2,
  // measured): synthetic noise images with random labels give weight and batch-norm gradients
  // that are sums of many terms of both signs, and the cancellation magnifies the 16-bit
  // rounding of x and dy (identical with loss scale 256 and 65536, so it is rounding, not
  // underflow). A wrong dtype path (a gradient from uncast weights, a loss scale not undone,
  // a layer's gradient lost) is off by 100% or more.
  for (const char* family : {"resnet", "gpt", "unet"}) {
    auto ref = session(family, "fp32");
    const double lr = std::string(family) == "resnet" ? 0.05 : 1e-3;
    for (const char* dtype : {"bf16", "fp16"}) {
      CAPTURE(std::string(family));
      CAPTURE(std::string(dtype));
      auto mp = session(family, dtype);
      REQUIRE(mp->params.mixed());
      const bool f16 = std::string(dtype) == "fp16";
      const double scale = f16 ? 256.0 : 1.0;
      CHECK(mp->scaler.scale() == float(scale));
      auto ref_fresh = session(family, "fp32");
      for (int step = 0; step < 3; ++step) {
        StepStats a = train_step(*ref_fresh, step, lr);
        StepStats b = train_step(*mp, step, lr);
        CHECK_FALSE(b.skipped);
        REQUIRE(std::isfinite(b.loss));
        const double loss_err = std::fabs(a.loss - b.loss) / std::max(1.0, std::fabs(a.loss));
        // master grads are f32; under fp16 they hold loss_scale * gradient until the update
        const double gerr =
            rel_l2(host(*mp, mp->params.flat_grads()), host(*ref_fresh, ref_fresh->params.flat_grads()), scale);
        const double perr = rel_l2(host(*mp, mp->params.flat_params()), host(*ref_fresh, ref_fresh->params.flat_params()));
        MESSAGE(std::string(family) << " " << dtype << " step " << step << ": loss " << a.loss << " vs " << b.loss
                       << " | grad rel err " << gerr << " | param rel err " << perr);
        const bool gpt = std::string(family) == "gpt";
        CHECK(loss_err < (f16 ? 1e-3 : 3e-3));
        CHECK(gerr < (gpt ? (f16 ? 1e-2 : 3e-2) : (f16 ? 0.15 : 0.3)));
        CHECK(perr < (f16 ? 5e-3 : 1e-2));
      }
      // the master weights stay f32 and the optimizer state is untouched by the dtype
      CHECK(mp->params.flat_params().dtype == DType::F32);
    }
  }
}

TEST_CASE("mixed precision: fp16 overflow skips the update and halves the loss scale until steps apply") {
  // 2^30 / batch 8 as the logits' gradient scale is far beyond fp16's 65504: the first steps
  // overflow. Each skipped step must leave weights and optimizer state untouched.
  auto s = session("resnet", "fp16", "cpu", "loss_scale = 1073741824.0\ngrowth_interval = 2\n");
  CHECK(s->scaler.scale() == 1073741824.f);
  std::vector<float> before = host(*s, s->params.flat_params());
  int skipped = 0, step = 0;
  for (; step < 40; ++step) {
    const float scale_before = s->scaler.scale();
    StepStats st = train_step(*s, step, 0.05);
    REQUIRE(std::isfinite(st.loss));
    CHECK(st.loss_scale == scale_before);
    if (!st.skipped) break;
    ++skipped;
    CHECK(s->scaler.scale() == scale_before / 2);
    CHECK(s->opt->steps() == 0);
    CHECK(host(*s, s->params.flat_params()) == before);  // bit for bit: nothing was applied
  }
  REQUIRE(step < 40);
  CHECK(skipped >= 3);
  CHECK(s->scaler.state().skipped_steps == skipped);
  CHECK(s->opt->steps() == 1);
  std::vector<float> after = host(*s, s->params.flat_params());
  CHECK(after != before);
  CHECK(all_finite(after));
  // growth: two clean steps in a row double the scale (if neither overflows)
  const float applied_scale = s->scaler.scale();
  StepStats st2 = train_step(*s, step + 1, 0.05);
  if (!st2.skipped) CHECK(s->scaler.scale() == 2 * applied_scale);
}
TEST_CASE("mixed precision: fp16 runs are bit-identical and resume bit-identically with their loss scale") {
  // An initial scale of 2^22 overflows fp16 in the first steps and growth every 3 clean steps
  // overflows again later, so skipped steps and scale changes straddle the checkpoint at step 5.
  const std::string fp16 = "[precision]\ndtype = \"fp16\"\nloss_scale = 4194304.0\ngrowth_interval = 3\n";
  for (const char* n : {"mp16_a", "mp16_b", "mp16_c"}) clean(n);
  auto a = run_cmd(kBin + " train " + recipe("mp16_a", fp16));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  CHECK(a.all().find("fp16 gradients overflowed") != std::string::npos);
  auto b = run_cmd(kBin + " train " + recipe("mp16_b", fp16));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  auto la = losses("mp16_a");
  REQUIRE(la.size() == 12);
  CHECK(la == losses("mp16_b"));  // exact
  CHECK(final_weights("mp16_a") == final_weights("mp16_b"));
  std::vector<double> scales;
  int64_t skipped = 0;
  for (auto& r : jsonl(run_dir("mp16_a") + "/metrics.jsonl"))
    if (r["kind"] == "train") {
      scales.push_back(r.at("loss_scale").get<double>());
      skipped = r.at("skipped_steps").get<int64_t>();
    }
  CHECK(skipped >= 1);
  CHECK(scales.front() < 4194304.0);
  CHECK(std::adjacent_find(scales.begin(), scales.end(), std::less<double>()) != scales.end());  // it grew
  auto c1 = run_cmd("DTRAIN_FAILPOINTS=train.stop_at_step=5 " + kBin + " train " + recipe("mp16_c", fp16));
  REQUIRE_MESSAGE(c1.code == 0, c1.all());
  const std::string state = slurp(run_dir("mp16_c") + "/checkpoints/step_00000005/state.json");
  CHECK(state.find("\"skipped_steps\"") != std::string::npos);
  auto in = run_cmd(kBin + " inspect " + run_dir("mp16_c") + "/checkpoints/step_00000005");
  REQUIRE_MESSAGE(in.code == 0, in.all());
  CHECK_MESSAGE(in.out.find("fp16 loss scale ") != std::string::npos, in.out);
  auto c2 = run_cmd(kBin + " train --resume " + run_dir("mp16_c"));
  REQUIRE_MESSAGE(c2.code == 0, c2.all());
  CHECK(losses("mp16_c") == la);
  CHECK(final_weights("mp16_c") == final_weights("mp16_a"));
}
}  // TEST_SUITE integration

TEST_SUITE("gpu") {
TEST_CASE("CUDA training steps of every model family in fp32 and bf16 and fp16 match the CPU") {
  GPU_OR_SKIP();
  for (const char* family : {"resnet", "gpt", "unet"}) {
    const double lr = std::string(family) == "resnet" ? 0.05 : 1e-3;
    for (const char* dtype : {"fp32", "bf16", "fp16"}) {
      CAPTURE(std::string(family));
      CAPTURE(std::string(dtype));
      auto cpu = session(family, dtype, "cpu");
      auto gpu = session(family, dtype, "cuda");
      REQUIRE(gpu->be->device().is_cuda());
      const bool f16 = std::string(dtype) == "fp16", f32 = std::string(dtype) == "fp32";
      for (int step = 0; step < 3; ++step) {
        StepStats a = train_step(*cpu, step, lr);
        StepStats b = train_step(*gpu, step, lr);
        CHECK(a.skipped == b.skipped);
        REQUIRE(std::isfinite(b.loss));
        const double gerr = rel_l2(host(*gpu, gpu->params.flat_grads()), host(*cpu, cpu->params.flat_grads()));
        const double perr = rel_l2(host(*gpu, gpu->params.flat_params()), host(*cpu, cpu->params.flat_params()));
        MESSAGE(std::string(family) << " " << dtype << " step " << step << ": loss cpu " << a.loss << " cuda " << b.loss
                       << " | grad rel err " << gerr << " | param rel err " << perr);
        // both round to the same 16-bit formats; summation orders differ (same tolerances as
        // against fp32 in the integration test, for the same reasons)
        const bool gpt = std::string(family) == "gpt";
        if (f32) {  // TF32 off: f32 everywhere, only summation orders differ
          CHECK(std::fabs(a.loss - b.loss) / std::max(1.0, std::fabs(a.loss)) < 1e-4);
          CHECK(gerr < 1e-3);
          CHECK(perr < 1e-4);
          continue;
        }
        CHECK(std::fabs(a.loss - b.loss) / std::max(1.0, std::fabs(a.loss)) < (f16 ? 1e-3 : 3e-3));
        CHECK(gerr < (gpt ? (f16 ? 1e-2 : 3e-2) : (f16 ? 0.15 : 0.3)));
        CHECK(perr < (f16 ? 5e-3 : 1e-2));
      }
    }
  }
}

TEST_CASE("cuda backend: 16-bit gemm and conv gradients into f32 match the CPU") {
  GPU_OR_SKIP();
  auto cpu = make_backend("cpu", 0, 2);
  auto gpu = make_backend("cuda");
  Rng r(4, 2);
  for (DType t : {DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(t));
    auto bits = [&](int64_t n) {
      std::vector<uint16_t> v(static_cast<size_t>(n));
      for (auto& x : v) x = t == DType::BF16 ? f32_to_bf16(r.normal()) : f32_to_f16(r.normal());
      return v;
    };
    auto run = [&](Backend& be, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                   const std::vector<uint16_t>& x, const std::vector<uint16_t>& dy) {
      Buffer A(be, a.size() * 2), B(be, b.size() * 2), C(be, 64 * 96 * 4);
      be.copy_from_host(A.data(), a.data(), a.size() * 2);
      be.copy_from_host(B.data(), b.data(), b.size() * 2);
      Tensor c = C.tensor(DType::F32, Shape{64, 96});
      be.fill(c, 0.5f);
      be.gemm(true, false, 1.f, A.tensor(t, Shape{200, 64}), B.tensor(t, Shape{200, 96}), 1.f, c);
      std::vector<float> out(64 * 96);
      be.copy_to_host(out.data(), c.data, out.size() * 4);
      Buffer X(be, x.size() * 2), DY(be, dy.size() * 2), W(be, 16 * 9 * 8 * 4), Bb(be, 16 * 4);
      be.copy_from_host(X.data(), x.data(), x.size() * 2);
      be.copy_from_host(DY.data(), dy.data(), dy.size() * 2);
      Tensor dw = W.tensor(DType::F32, Shape{16, 3, 3, 8}), db = Bb.tensor(DType::F32, Shape{16});
      be.fill(dw, 0.25f);
      be.fill(db, 0.25f);
      Conv2dParams p;
      p.pad_h = p.pad_w = 1;
      be.conv2d_bwd_filter(X.tensor(t, Shape{4, 12, 12, 8}), DY.tensor(t, Shape{4, 12, 12, 16}), dw, db, p, true);
      std::vector<float> w(size_t(dw.numel())), bias(16);
      be.copy_to_host(w.data(), dw.data, w.size() * 4);
      be.copy_to_host(bias.data(), db.data, bias.size() * 4);
      out.insert(out.end(), w.begin(), w.end());
      out.insert(out.end(), bias.begin(), bias.end());
      // a 1x1 convolution (a GEMM over the pixels on CUDA): its filter gradient goes into f32
      // without rounding
      Buffer W1(be, 16 * 8 * 4);
      Tensor dw1 = W1.tensor(DType::F32, Shape{16, 1, 1, 8});
      be.fill(dw1, 0.25f);
      Conv2dParams p1;
      Tensor nob;
      be.conv2d_bwd_filter(X.tensor(t, Shape{4, 12, 12, 8}), DY.tensor(t, Shape{4, 12, 12, 16}), dw1, nob, p1, true);
      std::vector<float> w1(size_t(dw1.numel()));
      be.copy_to_host(w1.data(), dw1.data, w1.size() * 4);
      out.insert(out.end(), w1.begin(), w1.end());
      return out;
    };
    auto a = bits(200 * 64), b = bits(200 * 96), x = bits(4 * 12 * 12 * 8), dy = bits(4 * 12 * 12 * 16);
    auto ref = run(*cpu, a, b, x, dy), got = run(*gpu, a, b, x, dy);
    // [gemm 64x96 | filter gradient 16*9*8 | bias gradient 16 | 1x1 filter gradient 16*8]
    auto part = [](const std::vector<float>& v, size_t from, size_t n) {
      return std::vector<float>(v.begin() + long(from), v.begin() + long(from + n));
    };
    const size_t ng = 64 * 96, nw = 16 * 9 * 8, nb = 16, n1 = 16 * 8;
    const double eg = rel_l2(part(got, 0, ng), part(ref, 0, ng));
    const double ew = rel_l2(part(got, ng, nw), part(ref, ng, nw));
    const double eb = rel_l2(part(got, ng + nw, nb), part(ref, ng + nw, nb));
    const double e1 = rel_l2(part(got, ng + nw + nb, n1), part(ref, ng + nw + nb, n1));
    MESSAGE(dtype_name(t) << ": rel err gemm " << eg << " | filter grad " << ew << " | bias grad " << eb
                          << " | 1x1 filter grad " << e1);
    // The GEMM, the bias gradient and the 1x1 filter gradient (a GEMM on CUDA) accumulate in
    // f32 on both sides: only summation order differs.
    CHECK(eg < 1e-5);
    CHECK(eb < 1e-5);
    CHECK(e1 < 1e-5);
    // cuDNN writes the filter gradient in the activations' dtype (as PyTorch autocast does for a
    // conv weight's gradient), widened and added to the f32 master gradient: rounded once, so
    // its error is bounded by the dtype's unit roundoff (2^-8 bf16, 2^-11 fp16); the CPU keeps f32.
    const double u = t == DType::BF16 ? 1.0 / 256 : 1.0 / 2048;
    CHECK(ew < u);
  }
}
}  // TEST_SUITE gpu

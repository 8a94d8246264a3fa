// Backend parity: every op, in every float dtype the CUDA backend supports, against the
// CPU backend in f32 on the same (dtype-rounded) inputs (ggml test-backend-ops style):
// normalised max error per dtype, outputs must not be all zero, no NaN/Inf, and guard
// bytes after every CUDA output must be untouched. Without a CUDA device every case
// prints "skipped: no CUDA device" and checks nothing (a visible skip, not a pass claim).
#include <doctest/doctest.h>

#include <cmath>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu_skip.h"
#include "backend/backend.h"
#include "core/buffer.h"
#include "core/error.h"
#include "core/rng.h"
#ifdef DTRAIN_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

using namespace dtrain;

namespace {

constexpr size_t kGuard = 256;
constexpr unsigned char kGuardByte = 0xA5;
const DType kDtypes[] = {DType::F32, DType::BF16, DType::F16};

double tol_for(DType t) {
  switch (t) {
    case DType::BF16: return 1e-2;
    case DType::F16: return 2e-3;
    default: return 1e-4;
  }
}

float round_to(DType t, float v) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  if (t == DType::F16) return f16_to_f32(f32_to_f16(v));
  return v;
}

struct Backends {
  std::unique_ptr<Backend> cpu = make_backend("cpu");
  std::unique_ptr<Backend> gpu = make_backend("cuda");
};

// One logical tensor on both backends: f32 on the CPU, `dt` on the GPU (with guard bytes).
struct Pair {
  DType dt = DType::F32;
  size_t off = 0;  // bytes of guard before the GPU tensor in gbuf (0: the tensor starts it)
  Shape shape;
  std::vector<float> host;  // exactly representable in dt
  Buffer cbuf, gbuf;
  Tensor c, g;
};

void upload_gpu(Backend& gpu, const Tensor& t, const std::vector<float>& v) {
  std::vector<uint16_t> h16(v.size());
  if (t.dtype == DType::F32) {
    gpu.copy_from_host(t.data, v.data(), v.size() * 4);
    return;
  }
  for (size_t i = 0; i < v.size(); ++i)
    h16[i] = t.dtype == DType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
  gpu.copy_from_host(t.data, h16.data(), h16.size() * 2);
}

std::vector<float> read(Backend& be, const Tensor& t) {
  std::vector<float> out(size_t(t.numel()));
  if (t.dtype == DType::F32) {
    be.copy_to_host(out.data(), t.data, t.nbytes());
  } else {
    std::vector<uint16_t> h(out.size());
    be.copy_to_host(h.data(), t.data, t.nbytes());
    for (size_t i = 0; i < h.size(); ++i)
      out[i] = t.dtype == DType::BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
  }
  return out;
}

// off_elems > 0 places the GPU tensor that many elements into its buffer (guard bytes
// before it too): a pointer that is not 16-byte aligned, for the kernels' scalar paths.
Pair make_pair_at(Backends& b, Shape s, DType dt, Rng& rng, size_t off_elems, float lo = -1.f,
                  float hi = 1.f) {
  Pair p;
  p.dt = dt;
  p.off = off_elems * dtype_size(dt);
  p.shape = s;
  p.host.resize(size_t(s.numel()));
  for (float& v : p.host) v = round_to(dt, lo + (hi - lo) * rng.uniform());
  size_t n = p.host.size();
  p.cbuf = Buffer(*b.cpu, n * 4 + 4);
  p.c = p.cbuf.tensor(DType::F32, s);
  b.cpu->copy_from_host(p.c.data, p.host.data(), n * 4);
  size_t gbytes = n * dtype_size(dt);
  p.gbuf = Buffer(*b.gpu, p.off + gbytes + kGuard);
  p.g = p.gbuf.tensor(dt, s, p.off);
  upload_gpu(*b.gpu, p.g, p.host);
  std::vector<unsigned char> guard(kGuard, kGuardByte);
  char* base = static_cast<char*>(p.gbuf.data());
  b.gpu->copy_from_host(base + p.off + gbytes, guard.data(), kGuard);
  if (p.off) b.gpu->copy_from_host(base, guard.data(), p.off);
  return p;
}
Pair make_pair(Backends& b, Shape s, DType dt, Rng& rng, float lo = -1.f, float hi = 1.f) {
  return make_pair_at(b, s, dt, rng, 0, lo, hi);
}

void check_guard(Backends& b, const Pair& p, const std::string& what) {
  std::vector<unsigned char> guard(kGuard + p.off);
  const char* base = static_cast<const char*>(p.gbuf.data());
  b.gpu->copy_to_host(guard.data(), base + p.off + p.g.nbytes(), kGuard);
  if (p.off) b.gpu->copy_to_host(guard.data() + kGuard, base, p.off);
  size_t bad = 0;
  for (unsigned char c : guard) bad += c != kGuardByte;
  INFO(what);
  CHECK_MESSAGE(bad == 0, "guard bytes overwritten before or after the output");
}

// Normalised max error |gpu - cpu| / max|cpu| <= tol, no NaN/Inf, not all zero.
void compare(Backends& b, const Pair& p, const std::string& what, double tol = -1) {
  if (tol < 0) tol = tol_for(p.dt);
  std::vector<float> ref = read(*b.cpu, p.c), got = read(*b.gpu, p.g);
  double max_ref = 0, max_err = 0, max_got = 0;
  size_t nonfinite = 0, worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) {
      ++nonfinite;
      continue;
    }
    max_ref = std::max(max_ref, double(std::fabs(ref[i])));
    max_got = std::max(max_got, double(std::fabs(got[i])));
    double e = std::fabs(double(got[i]) - double(ref[i]));
    if (e > max_err) max_err = e, worst = i;
  }
  double err = max_err / std::max(max_ref, 1e-12);
  INFO(what, " dtype=", std::string(dtype_name(p.dt)), " shape=", p.shape.str(),
       " normalised err=", err, " tol=", tol, " worst index ", worst, " cpu ",
       ref.empty() ? 0.f : ref[worst], " gpu ", got.empty() ? 0.f : got[worst]);
  CHECK(nonfinite == 0);
  CHECK(max_ref > 0);  // the reference itself must be non-trivial
  CHECK(max_got > 0);  // and the GPU output not all zero
  CHECK(err <= tol);
  check_guard(b, p, what);
}

bool gpu_supports(Backends& b, Op op, DType t) { return b.gpu->supports(op, t); }

// A u8 tensor on both backends (max pooling's argmax), compared byte for byte.
struct U8Pair {
  Buffer cbuf, gbuf;
  Tensor c, g;
};
U8Pair make_u8_pair(Backends& b, Shape s) {
  U8Pair p;
  p.cbuf = Buffer(*b.cpu, size_t(s.numel()) + 1);
  p.gbuf = Buffer(*b.gpu, size_t(s.numel()) + 1);
  p.c = p.cbuf.tensor(DType::U8, s);
  p.g = p.gbuf.tensor(DType::U8, s);
  return p;
}
void compare_u8(Backends& b, const U8Pair& p, const std::string& what) {
  std::vector<uint8_t> c(size_t(p.c.numel())), g(c.size());
  b.cpu->copy_to_host(c.data(), p.c.data, c.size());
  b.gpu->copy_to_host(g.data(), p.g.data, g.size());
  size_t diff = 0;
  for (size_t i = 0; i < c.size(); ++i) diff += c[i] != g[i];
  INFO(what);
  CHECK_MESSAGE(diff == 0, diff << " of " << c.size() << " argmax bytes differ");
}

// Max pooling forward (with and without argmax), backward and accumulating backward.
void check_maxpool(Backends& b, Pair& x, Pair& y, Pair& dy, Pair& dx, const Pool2dParams& p,
                   Rng& rng, const std::string& tag) {
  U8Pair am = make_u8_pair(b, y.shape);
  Tensor none;
  b.gpu->maxpool2d_fwd(x.g, y.g, none, p);
  b.cpu->maxpool2d_fwd(x.c, y.c, am.c, p);
  compare(b, y, "maxpool2d_fwd without argmax " + tag, 0.0);
  b.gpu->maxpool2d_fwd(x.g, y.g, am.g, p);
  compare(b, y, "maxpool2d_fwd " + tag, 0.0);
  compare_u8(b, am, "maxpool2d_fwd argmax " + tag);
  if (!gpu_supports(b, Op::MaxPoolBwd, y.dt)) return;
  b.cpu->maxpool2d_bwd(am.c, dy.c, dx.c, p, false);
  b.gpu->maxpool2d_bwd(am.g, dy.g, dx.g, p, false);
  compare(b, dx, "maxpool2d_bwd " + tag);
  Pair acc = make_pair(b, dx.shape, dx.dt, rng);
  b.cpu->maxpool2d_bwd(am.c, dy.c, acc.c, p, true);
  b.gpu->maxpool2d_bwd(am.g, dy.g, acc.g, p, true);
  compare(b, acc, "maxpool2d_bwd accumulate " + tag);
}

// Pairwise-distinct values, exact in bf16 and f16 (+-(1+m/128)*2^e, e in [-10,9]), shuffled:
// max pooling then has no ties, whose tie-breaking is not part of the contract.
void make_distinct(Backends& b, Pair& p, Rng& rng) {
  size_t n = p.host.size();
  DTRAIN_CHECK(n <= 256 * 20, "make_distinct: {} values", n);
  for (size_t k = 0; k < n; ++k) {
    float mag = std::ldexp(1.f + float(k % 128) / 128.f, int(k / 256) - 10);
    p.host[k] = (k / 128) % 2 ? -mag : mag;
  }
  for (size_t k = n; k > 1; --k) std::swap(p.host[k - 1], p.host[rng.below(k)]);
  b.cpu->copy_from_host(p.c.data, p.host.data(), n * 4);
  upload_gpu(*b.gpu, p.g, p.host);
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("gpu parity: elementwise ops / casts and bias") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(1, 1);
  const Shape s{7, 13, 11};  // 1001 elements: not a multiple of any block size
  for (DType dt : kDtypes) {
    const std::string dtype = std::string(dtype_name(dt));
    CAPTURE(dtype);
    if (gpu_supports(b, Op::Fill, dt)) {
      Pair y = make_pair(b, s, dt, rng);
      b.cpu->fill(y.c, 0.375f);
      b.gpu->fill(y.g, 0.375f);
      compare(b, y, "fill");
    }
    if (gpu_supports(b, Op::Copy, dt)) {
      Pair x = make_pair(b, s, dt, rng), y = make_pair(b, s, dt, rng);
      b.cpu->copy(x.c, y.c);
      b.gpu->copy(x.g, y.g);
      compare(b, y, "copy");
    }
    if (gpu_supports(b, Op::Add, dt)) {
      Pair x = make_pair(b, s, dt, rng), z = make_pair(b, s, dt, rng), y = make_pair(b, s, dt, rng);
      b.cpu->add(x.c, z.c, y.c);
      b.gpu->add(x.g, z.g, y.g);
      compare(b, y, "add");
      b.cpu->add(x.c, y.c, y.c);  // y may alias
      b.gpu->add(x.g, y.g, y.g);
      compare(b, y, "add aliased");
    }
    if (gpu_supports(b, Op::Axpby, dt)) {
      Pair x = make_pair(b, s, dt, rng), y = make_pair(b, s, dt, rng);
      b.cpu->axpby(0.7f, x.c, -1.3f, y.c);
      b.gpu->axpby(0.7f, x.g, -1.3f, y.g);
      compare(b, y, "axpby");
    }
    if (gpu_supports(b, Op::Scale, dt)) {
      Pair y = make_pair(b, s, dt, rng);
      b.cpu->scale(y.c, -2.5f);
      b.gpu->scale(y.g, -2.5f);
      compare(b, y, "scale");
    }
    if (gpu_supports(b, Op::ReluFwd, dt)) {
      Pair x = make_pair(b, s, dt, rng), y = make_pair(b, s, dt, rng);
      b.cpu->relu_fwd(x.c, y.c);
      b.gpu->relu_fwd(x.g, y.g);
      compare(b, y, "relu_fwd");
      Pair dy = make_pair(b, s, dt, rng), dx = make_pair(b, s, dt, rng);
      b.cpu->relu_bwd(y.c, dy.c, dx.c);
      b.gpu->relu_bwd(y.g, dy.g, dx.g);
      compare(b, dx, "relu_bwd");
    }
    if (gpu_supports(b, Op::AddBias, dt)) {
      Pair y = make_pair(b, {77, 45}, dt, rng), bias = make_pair(b, {45}, dt, rng);
      b.cpu->add_bias(y.c, bias.c);
      b.gpu->add_bias(y.g, bias.g);
      compare(b, y, "add_bias");
    }
    if (gpu_supports(b, Op::SumRows, dt)) {
      for (bool acc : {false, true}) {
        Pair x = make_pair(b, {1031, 67}, dt, rng), y = make_pair(b, {67}, dt, rng);
        b.cpu->sum_rows(x.c, y.c, acc);
        b.gpu->sum_rows(x.g, y.g, acc);
        compare(b, y, acc ? "sum_rows accumulate" : "sum_rows");
      }
    }
  }
  // cast: every float pair
  for (DType from : kDtypes)
    for (DType to : kDtypes) {
      if (!gpu_supports(b, Op::Cast, from) || !gpu_supports(b, Op::Cast, to)) continue;
      Pair x = make_pair(b, s, from, rng, -3.f, 3.f), y = make_pair(b, s, to, rng);
      b.cpu->copy(x.c, y.c);  // the f32 reference of a cast is the value rounded to `to`
      std::vector<float> v = read(*b.cpu, y.c);
      for (float& f : v) f = round_to(to, f);
      b.cpu->copy_from_host(y.c.data, v.data(), v.size() * 4);
      b.gpu->cast(x.g, y.g);
      compare(b, y, std::string("cast ") + std::string(dtype_name(from)) + "->" +
                        std::string(dtype_name(to)), 0.0);
    }
}

// The flat kernels use 16-byte vectors with a scalar tail when every pointer is aligned,
// else scalar code; large n makes the grid-stride loops go round more than once.
TEST_CASE("gpu parity: vectorised elementwise - tails / unaligned pointers / grid stride") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(11, 1);
  struct Case { int64_t n; size_t off_x, off_y; };
  const Case cases[] = {{1, 0, 0},    {7, 0, 0},    {8, 0, 0},       {9, 0, 0},
                        {4099, 0, 0}, {4099, 1, 0}, {4099, 0, 3},    {1001, 2, 2},
                        {9'000'011, 0, 0}};
  for (DType dt : kDtypes) {
    const std::string dtype = std::string(dtype_name(dt));
    CAPTURE(dtype);
    for (const Case& c : cases) {
      const std::string tag = fmt::format(" n={} off={}/{}", c.n, c.off_x, c.off_y);
      Pair x = make_pair_at(b, {c.n}, dt, rng, c.off_x), z = make_pair(b, {c.n}, dt, rng);
      Pair y = make_pair_at(b, {c.n}, dt, rng, c.off_y);
      b.cpu->add(x.c, z.c, y.c);
      b.gpu->add(x.g, z.g, y.g);
      compare(b, y, "add" + tag);
      b.cpu->add(x.c, y.c, y.c);
      b.gpu->add(x.g, y.g, y.g);
      compare(b, y, "add aliased" + tag);
      b.cpu->axpby(0.7f, x.c, -1.3f, y.c);
      b.gpu->axpby(0.7f, x.g, -1.3f, y.g);
      compare(b, y, "axpby" + tag);
      b.cpu->axpby(-0.5f, x.c, 0.f, y.c);
      b.gpu->axpby(-0.5f, x.g, 0.f, y.g);
      compare(b, y, "axpby beta=0" + tag);
      b.cpu->scale(y.c, -2.5f);
      b.gpu->scale(y.g, -2.5f);
      compare(b, y, "scale" + tag);
      b.cpu->relu_fwd(x.c, y.c);
      b.gpu->relu_fwd(x.g, y.g);
      if (c.n >= 1000) compare(b, y, "relu_fwd" + tag);  // a few values may all be <= 0
      Pair dy = make_pair_at(b, {c.n}, dt, rng, c.off_y);
      b.cpu->relu_bwd(y.c, dy.c, dy.c);  // dx aliases dy
      b.gpu->relu_bwd(y.g, dy.g, dy.g);
      if (c.n >= 1000) compare(b, dy, "relu_bwd aliased" + tag);
      b.cpu->fill(y.c, -0.625f);
      b.gpu->fill(y.g, -0.625f);
      compare(b, y, "fill" + tag);
      for (DType to : kDtypes) {
        if (to == dt) continue;
        Pair o = make_pair_at(b, {c.n}, to, rng, c.off_y);
        std::vector<float> v = x.host;
        for (float& f : v) f = round_to(to, f);
        b.cpu->copy_from_host(o.c.data, v.data(), v.size() * 4);
        b.gpu->cast(x.g, o.g);
        compare(b, o, "cast to " + std::string(dtype_name(to)) + tag, 0.0);
      }
    }
  }
}

TEST_CASE("gpu parity: sum / sum_squares and all_finite") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(2, 1);
  for (DType dt : kDtypes) {
    const std::string dtype = std::string(dtype_name(dt));
    CAPTURE(dtype);
    if (!gpu_supports(b, Op::SumSquares, dt)) continue;
    for (int64_t n : {1, 1000, 1 << 20, 3000017}) {
      Pair x = make_pair(b, {n}, dt, rng);
      double rc = b.cpu->sum_squares(x.c), rg = b.gpu->sum_squares(x.g);
      CAPTURE(n);
      CHECK(rg > 0);
      CHECK(std::fabs(rg - rc) <= 1e-6 * rc);  // same rounded inputs, both accumulate wide
      CHECK(b.gpu->sum_squares(x.g) == rg);    // deterministic: bit-identical rerun
      // the plain sum (loss totals): inputs in [-1, 1), so compare against the sum of |x|'s scale
      const double sc = b.cpu->sum(x.c), sg = b.gpu->sum(x.g);
      CHECK(std::fabs(sg - sc) <= 1e-9 * double(n) + 1e-6 * std::sqrt(rc));
      CHECK(b.gpu->sum(x.g) == sg);
      CHECK(b.gpu->all_finite(x.g));
      CHECK(b.cpu->all_finite(x.c));
    }
    if (!gpu_supports(b, Op::AllFinite, dt)) continue;
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      Pair x = make_pair(b, {4099}, dt, rng);
      x.host[4000] = bad;
      upload_gpu(*b.gpu, x.g, x.host);
      CHECK_FALSE(b.gpu->all_finite(x.g));
    }
  }
}

TEST_CASE("gpu parity: gemm (all transposes / awkward sizes)") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(3, 1);
  struct Case { int64_t M, N, K; };
  const Case cases[] = {{37, 53, 71}, {1, 129, 64}, {128, 256, 96}, {300, 7, 513}};
  for (DType dt : kDtypes) {
    if (!gpu_supports(b, Op::Gemm, dt)) continue;
    const std::string dtype = std::string(dtype_name(dt));
    CAPTURE(dtype);
    for (const Case& c : cases)
      for (int t = 0; t < 4; ++t) {
        bool ta = t & 1, tb = t & 2;
        Pair a = make_pair(b, ta ? Shape{c.K, c.M} : Shape{c.M, c.K}, dt, rng);
        Pair w = make_pair(b, tb ? Shape{c.N, c.K} : Shape{c.K, c.N}, dt, rng);
        for (float beta : {0.f, 0.5f}) {
          Pair y = make_pair(b, {c.M, c.N}, dt, rng);
          b.cpu->gemm(ta, tb, 1.25f, a.c, w.c, beta, y.c);
          b.gpu->gemm(ta, tb, 1.25f, a.g, w.g, beta, y.g);
          compare(b, y, fmt::format("gemm M={} N={} K={} ta={} tb={} beta={}", c.M, c.N, c.K, ta,
                                    tb, beta));
        }
        // the Linear forward: c = op(a) op(b) + bias (cuBLASLt bias epilogue on CUDA)
        Pair bias = make_pair(b, {c.N}, dt, rng);
        Pair y = make_pair(b, {c.M, c.N}, dt, rng);
        b.cpu->gemm_bias(ta, tb, a.c, w.c, bias.c, y.c);
        b.gpu->gemm_bias(ta, tb, a.g, w.g, bias.g, y.g);
        compare(b, y, fmt::format("gemm_bias M={} N={} K={} ta={} tb={}", c.M, c.N, c.K, ta, tb));
      }
  }
#ifdef DTRAIN_WITH_CUDA
  // TF32 (opt-in): same answer within TF32's 10-bit mantissa.
  auto* cu = dynamic_cast<CudaBackend*>(b.gpu.get());
  REQUIRE(cu != nullptr);
  cu->set_allow_tf32(true);
  Pair a = make_pair(b, {256, 512}, DType::F32, rng), w = make_pair(b, {512, 384}, DType::F32, rng);
  Pair y = make_pair(b, {256, 384}, DType::F32, rng);
  b.cpu->gemm(false, false, 1.f, a.c, w.c, 0.f, y.c);
  b.gpu->gemm(false, false, 1.f, a.g, w.g, 0.f, y.g);
  compare(b, y, "gemm tf32", 5e-3);
  cu->set_allow_tf32(false);
#endif
}

TEST_CASE("gpu parity: conv2d fwd / bwd_data / bwd_filter (NHWC / OHWI)") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(4, 1);
  struct Case { int64_t N, H, W, C, O, KH, KW; Conv2dParams p; };
  const Case cases[] = {
      {2, 9, 11, 8, 16, 3, 3, {1, 1, 1, 1, 1, 1}},
      {3, 16, 16, 16, 32, 3, 3, {2, 2, 1, 1, 1, 1}},
      {2, 7, 7, 32, 24, 1, 1, {1, 1, 0, 0, 1, 1}},
      {1, 23, 19, 3, 8, 7, 7, {2, 2, 3, 3, 1, 1}},
      {2, 12, 12, 8, 8, 3, 3, {1, 1, 2, 2, 2, 2}},
      // ResNet's downsample shortcut: 1x1 stride 2 goes to cuDNN, not the GEMM path, and with
      // an odd size some dx pixels get no gradient and must keep their value when accumulating
      {2, 9, 9, 16, 32, 1, 1, {2, 2, 0, 0, 1, 1}},
  };
  for (DType dt : kDtypes) {
    const std::string dtype = std::string(dtype_name(dt));
    CAPTURE(dtype);
    for (const Case& c : cases) {
      const Conv2dParams& p = c.p;
      int64_t OH = (c.H + 2 * p.pad_h - p.dil_h * (c.KH - 1) - 1) / p.stride_h + 1;
      int64_t OW = (c.W + 2 * p.pad_w - p.dil_w * (c.KW - 1) - 1) / p.stride_w + 1;
      std::string tag = fmt::format("x[{},{},{},{}] w[{},{},{},{}] s{} p{} d{}", c.N, c.H, c.W, c.C,
                                    c.O, c.KH, c.KW, c.C, p.stride_h, p.pad_h, p.dil_h);
      Pair x = make_pair(b, {c.N, c.H, c.W, c.C}, dt, rng);
      Pair w = make_pair(b, {c.O, c.KH, c.KW, c.C}, dt, rng);
      Pair bias = make_pair(b, {c.O}, dt, rng);
      if (gpu_supports(b, Op::Conv2dFwd, dt)) {
        Pair y = make_pair(b, {c.N, OH, OW, c.O}, dt, rng);
        b.cpu->conv2d_fwd(x.c, w.c, bias.c, y.c, p);
        b.gpu->conv2d_fwd(x.g, w.g, bias.g, y.g, p);
        compare(b, y, "conv2d_fwd " + tag);
        Tensor none;
        b.cpu->conv2d_fwd(x.c, w.c, none, y.c, p);
        b.gpu->conv2d_fwd(x.g, w.g, none, y.g, p);
        compare(b, y, "conv2d_fwd no bias " + tag);
      }
      Pair dy = make_pair(b, {c.N, OH, OW, c.O}, dt, rng);
      if (gpu_supports(b, Op::Conv2dBwdData, dt)) {
        Pair dx = make_pair(b, {c.N, c.H, c.W, c.C}, dt, rng);
        b.cpu->conv2d_bwd_data(dy.c, w.c, dx.c, p, false);
        b.gpu->conv2d_bwd_data(dy.g, w.g, dx.g, p, false);
        compare(b, dx, "conv2d_bwd_data " + tag);
        Pair acc = make_pair(b, {c.N, c.H, c.W, c.C}, dt, rng);  // dx += (a residual's sum)
        b.cpu->conv2d_bwd_data(dy.c, w.c, acc.c, p, true);
        b.gpu->conv2d_bwd_data(dy.g, w.g, acc.g, p, true);
        compare(b, acc, "conv2d_bwd_data accumulate " + tag);
      }
      if (gpu_supports(b, Op::Conv2dBwdFilter, dt)) {
        for (bool acc : {false, true}) {
          Pair dw = make_pair(b, {c.O, c.KH, c.KW, c.C}, dt, rng);
          Pair db = make_pair(b, {c.O}, dt, rng);
          b.cpu->conv2d_bwd_filter(x.c, dy.c, dw.c, db.c, p, acc);
          b.gpu->conv2d_bwd_filter(x.g, dy.g, dw.g, db.g, p, acc);
          compare(b, dw, std::string("conv2d_bwd_filter dw ") + (acc ? "acc " : "") + tag);
          compare(b, db, std::string("conv2d_bwd_filter dbias ") + (acc ? "acc " : "") + tag);
        }
      }
    }
  }
}

TEST_CASE("gpu parity: batchnorm train / eval / backward") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(5, 1);
  // Channel counts with and without 16-byte vectors (C % 8 for 16-bit, C % 4 for f32),
  // partial channel tiles (40, 264), odd row counts, many row chunks (8x28x28), an
  // unaligned x (scalar path for C = 64) and a mean far from 0 relative to the spread.
  struct Case { Shape s; size_t off; float lo, hi; };
  const Case cases[] = {{Shape{4, 7, 9, 24}, 0, -2.f, 3.f},   {Shape{2, 33, 33, 3}, 0, -2.f, 3.f},
                        {Shape{64, 1, 1, 130}, 0, -2.f, 3.f}, {Shape{3, 5, 7, 64}, 0, -2.f, 3.f},
                        {Shape{3, 5, 7, 64}, 1, -2.f, 3.f},   {Shape{2, 9, 11, 40}, 0, -2.f, 3.f},
                        {Shape{1, 1, 3, 16}, 0, -2.f, 3.f},   {Shape{2, 3, 3, 8}, 0, -2.f, 3.f},
                        {Shape{8, 28, 28, 264}, 0, -2.f, 3.f}, {Shape{4, 16, 16, 32}, 0, 20.f, 22.f}};
  for (DType dt : kDtypes) {
    const std::string dtype = std::string(dtype_name(dt));
    CAPTURE(dtype);
    for (const Case& cs : cases) {
      const Shape& s = cs.s;
      int64_t C = s[3];
      std::string tag = fmt::format("x{} off={} range=[{},{}]", s.str(), cs.off, cs.lo, cs.hi);
      Pair x = make_pair_at(b, s, dt, rng, cs.off, cs.lo, cs.hi), y = make_pair(b, s, dt, rng);
      Pair gamma = make_pair(b, {C}, DType::F32, rng, 0.5f, 1.5f);
      Pair beta = make_pair(b, {C}, DType::F32, rng);
      Pair rm = make_pair(b, {C}, DType::F32, rng), rv = make_pair(b, {C}, DType::F32, rng, 0.5f, 2.f);
      Pair sm = make_pair(b, {C}, DType::F32, rng), si = make_pair(b, {C}, DType::F32, rng);
      if (gpu_supports(b, Op::BatchNormFwdTrain, dt)) {
        b.cpu->batchnorm_fwd_train(x.c, gamma.c, beta.c, y.c, rm.c, rv.c, sm.c, si.c, 0.1f, 1e-5f);
        b.gpu->batchnorm_fwd_train(x.g, gamma.g, beta.g, y.g, rm.g, rv.g, sm.g, si.g, 0.1f, 1e-5f);
        compare(b, y, "bn_fwd_train y " + tag);
        double st = dt == DType::F32 ? 1e-5 : 1e-4;  // stats are f32 on both sides
        compare(b, rm, "bn running_mean " + tag, st);
        compare(b, rv, "bn running_var " + tag, st);
        compare(b, sm, "bn save_mean " + tag, st);
        compare(b, si, "bn save_invstd " + tag, st);
      } else {
        continue;
      }
      if (gpu_supports(b, Op::BatchNormFwdEval, dt)) {
        b.cpu->batchnorm_fwd_eval(x.c, gamma.c, beta.c, rm.c, rv.c, y.c, 1e-5f);
        b.gpu->batchnorm_fwd_eval(x.g, gamma.g, beta.g, rm.g, rv.g, y.g, 1e-5f);
        compare(b, y, "bn_fwd_eval " + tag);
      }
      if (gpu_supports(b, Op::BatchNormBwd, dt)) {
        for (bool acc : {false, true}) {
          Pair dy = make_pair(b, s, dt, rng), dx = make_pair(b, s, dt, rng);
          Pair dg = make_pair(b, {C}, DType::F32, rng), dbt = make_pair(b, {C}, DType::F32, rng);
          b.cpu->batchnorm_bwd(dy.c, x.c, gamma.c, sm.c, si.c, dx.c, dg.c, dbt.c, acc);
          b.gpu->batchnorm_bwd(dy.g, x.g, gamma.g, sm.g, si.g, dx.g, dg.g, dbt.g, acc);
          std::string a = acc ? " acc " : " ";
          compare(b, dx, "bn_bwd dx" + a + tag);
          // dgamma/dbeta are f32 sums of 16-bit products: error relative to the sum's scale
          compare(b, dg, "bn_bwd dgamma" + a + tag, dt == DType::F32 ? 1e-4 : 2e-3);
          compare(b, dbt, "bn_bwd dbeta" + a + tag, dt == DType::F32 ? 1e-4 : 2e-3);
        }
      }
    }
  }
}

TEST_CASE("gpu parity: max/avg/global pooling") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(6, 1);
  const Pool2dParams params[] = {{2, 2, 2, 2, 0, 0}, {3, 3, 2, 2, 1, 1}, {3, 3, 1, 1, 1, 1}};
  for (DType dt : kDtypes) {
    const std::string dtype = std::string(dtype_name(dt));
    CAPTURE(dtype);
    // C = 19: scalar kernels; 64 and 24: 16-byte vectors (24 = 3 groups of 8 in 16-bit).
    struct Geom { int64_t N, H, W, C; };
    for (const Geom& gm : {Geom{2, 13, 10, 19}, Geom{1, 7, 9, 64}, Geom{2, 9, 11, 24}})
    for (const Pool2dParams& p : params) {
      const int64_t N = gm.N, H = gm.H, W = gm.W, C = gm.C;
      int64_t OH = (H + 2 * p.pad_h - p.kernel_h) / p.stride_h + 1;
      int64_t OW = (W + 2 * p.pad_w - p.kernel_w) / p.stride_w + 1;
      std::string tag = fmt::format("k{} s{} p{} x[{} {} {} {}]", p.kernel_h, p.stride_h, p.pad_h,
                                    N, H, W, C);
      Pair x = make_pair(b, {N, H, W, C}, dt, rng);
      make_distinct(b, x, rng);
      Pair y = make_pair(b, {N, OH, OW, C}, dt, rng), dy = make_pair(b, {N, OH, OW, C}, dt, rng);
      Pair dx = make_pair(b, {N, H, W, C}, dt, rng);
      if (gpu_supports(b, Op::MaxPoolFwd, dt)) check_maxpool(b, x, y, dy, dx, p, rng, tag);
      if (gpu_supports(b, Op::AvgPoolFwd, dt)) {
        b.cpu->avgpool2d_fwd(x.c, y.c, p);
        b.gpu->avgpool2d_fwd(x.g, y.g, p);
        compare(b, y, "avgpool2d_fwd " + tag);
      }
      if (gpu_supports(b, Op::AvgPoolBwd, dt)) {
        b.cpu->avgpool2d_bwd(dy.c, dx.c, p);
        b.gpu->avgpool2d_bwd(dy.g, dx.g, p);
        compare(b, dx, "avgpool2d_bwd " + tag);
      }
    }
    if (gpu_supports(b, Op::GlobalAvgPoolFwd, dt)) {
      Pair x = make_pair(b, {3, 7, 5, 37}, dt, rng), y = make_pair(b, {3, 37}, dt, rng);
      b.cpu->global_avgpool_fwd(x.c, y.c);
      b.gpu->global_avgpool_fwd(x.g, y.g);
      compare(b, y, "global_avgpool_fwd");
      Pair dx = make_pair(b, {3, 7, 5, 37}, dt, rng);
      b.cpu->global_avgpool_bwd(y.c, dx.c);
      b.gpu->global_avgpool_bwd(y.g, dx.g);
      compare(b, dx, "global_avgpool_bwd");
    }
  }
}

// Ties (ReLU outputs: many equal zeros; few distinct values): the gradient goes to the
// first max of each window in scan order, on both backends.
TEST_CASE("gpu parity: max pooling backward with ties") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(12, 1);
  const Pool2dParams params[] = {{2, 2, 2, 2, 0, 0}, {3, 3, 2, 2, 1, 1}, {3, 3, 1, 1, 1, 1}};
  const float levels[] = {0.f, 0.f, 0.f, 0.5f, 1.f, -1.f};
  for (DType dt : kDtypes) {
    if (!gpu_supports(b, Op::MaxPoolBwd, dt)) continue;
    const std::string dtype = std::string(dtype_name(dt));
    CAPTURE(dtype);
    for (int64_t C : {19, 64})
      for (const Pool2dParams& p : params) {
        const int64_t N = 2, H = 11, W = 9;
        int64_t OH = (H + 2 * p.pad_h - p.kernel_h) / p.stride_h + 1;
        int64_t OW = (W + 2 * p.pad_w - p.kernel_w) / p.stride_w + 1;
        Pair x = make_pair(b, {N, H, W, C}, dt, rng);
        for (float& v : x.host) v = levels[rng.below(6)];
        b.cpu->copy_from_host(x.c.data, x.host.data(), x.host.size() * 4);
        upload_gpu(*b.gpu, x.g, x.host);
        Pair y = make_pair(b, {N, OH, OW, C}, dt, rng), dy = make_pair(b, {N, OH, OW, C}, dt, rng);
        Pair dx = make_pair(b, {N, H, W, C}, dt, rng);
        std::string tag = fmt::format("ties k{} s{} p{} C={}", p.kernel_h, p.stride_h, p.pad_h, C);
        check_maxpool(b, x, y, dy, dx, p, rng, tag);
      }
  }
}

TEST_CASE("gpu parity: softmax cross-entropy") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(7, 1);
  for (DType dt : kDtypes) {
    if (!gpu_supports(b, Op::SoftmaxXent, dt)) continue;
    const std::string dtype = std::string(dtype_name(dt));
    CAPTURE(dtype);
    // Rows per thread (C <= 16), per warp (C <= 1024), per block; many rows (segmentation
    // pixels) make the grid-stride loops go round.
    struct Case { int64_t N, C; };
    for (const Case& nc : {Case{9, 2}, Case{9, 10}, Case{9, 16}, Case{9, 17}, Case{9, 1000},
                           Case{9, 1025}, Case{9, 50257}, Case{1'100'003, 2}, Case{40'000, 21}})
      for (float ls : {0.f, 0.1f}) {
        const int64_t N = nc.N, C = nc.C;
        Pair logits = make_pair(b, {N, C}, dt, rng, -8.f, 8.f);
        Pair dl = make_pair(b, {N, C}, dt, rng);
        Pair losses = make_pair(b, {N}, DType::F32, rng);
        std::vector<int32_t> lab(N);
        for (auto& l : lab) l = int32_t(rng.below(uint64_t(C)));
        Buffer lc(*b.cpu, N * 4), lg(*b.gpu, N * 4);
        Tensor tlc = lc.tensor(DType::I32, {N}), tlg = lg.tensor(DType::I32, {N});
        b.cpu->copy_from_host(tlc.data, lab.data(), N * 4);
        b.gpu->copy_from_host(tlg.data, lab.data(), N * 4);
        b.cpu->softmax_xent(logits.c, tlc, ls, 0.5f, losses.c, dl.c);
        b.gpu->softmax_xent(logits.g, tlg, ls, 0.5f, losses.g, dl.g);
        std::string tag = fmt::format("N={} C={} ls={}", N, C, ls);
        compare(b, losses, "softmax_xent losses " + tag, 1e-5);  // f32 math on equal inputs
        compare(b, dl, "softmax_xent dlogits " + tag);
        Tensor none;
        b.gpu->softmax_xent(logits.g, tlg, ls, 0.5f, losses.g, none);  // loss only
        compare(b, losses, "softmax_xent losses (no dlogits) " + tag, 1e-5);
      }
  }
}

TEST_CASE("gpu parity: sgd and adamw steps over segments") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(8, 1);
  const int64_t n = 10000;
  // Covers part of the buffer, with decay and no-decay segments and an empty one.
  std::vector<ParamSegment> segs = {{0, 4000, true}, {4000, 33, false}, {4033, 0, true},
                                    {5000, 4999, true}};
  for (bool nesterov : {false, true}) {
    Pair p = make_pair(b, {n}, DType::F32, rng), g = make_pair(b, {n}, DType::F32, rng);
    Pair mom = make_pair(b, {n}, DType::F32, rng);
    for (int step = 0; step < 3; ++step) {
      SgdArgs a;
      a.lr = 0.05f;
      a.momentum = 0.9f;
      a.dampening = nesterov ? 0.f : 0.1f;
      a.weight_decay = 5e-4f;
      a.nesterov = nesterov;
      a.first_step = step == 0;
      a.grad_scale = 0.5f;
      b.cpu->sgd_step(p.c, g.c, mom.c, segs, a);
      b.gpu->sgd_step(p.g, g.g, mom.g, segs, a);
    }
    compare(b, p, nesterov ? "sgd nesterov params" : "sgd params", 1e-6);
    compare(b, mom, "sgd momentum", 1e-6);
  }
  {
    Pair p = make_pair(b, {n}, DType::F32, rng), g = make_pair(b, {n}, DType::F32, rng);
    Pair m = make_pair(b, {n}, DType::F32, rng, 0.f, 0.f), v = make_pair(b, {n}, DType::F32, rng, 0.f, 0.f);
    for (int step = 1; step <= 3; ++step) {
      AdamWArgs a;
      a.lr = 1e-2f;
      a.weight_decay = 0.1f;
      a.step = step;
      a.grad_scale = 2.f;
      if (step == 3) segs[1].decay = true;  // a changed table must be re-uploaded
      b.cpu->adamw_step(p.c, g.c, m.c, v.c, segs, a);
      b.gpu->adamw_step(p.g, g.g, m.g, v.g, segs, a);
    }
    compare(b, p, "adamw params", 1e-6);
    compare(b, m, "adamw m", 1e-6);
    compare(b, v, "adamw v", 1e-6);
  }
}

TEST_CASE("gpu: reductions are deterministic - OOM is a clear RuntimeFault") {
  GPU_OR_SKIP();
  Backends b;
  Rng rng(9, 1);
  Pair x = make_pair(b, {4096, 96}, DType::F32, rng), y1 = make_pair(b, {96}, DType::F32, rng);
  Pair y2 = make_pair(b, {96}, DType::F32, rng);
  b.gpu->sum_rows(x.g, y1.g, false);
  b.gpu->sum_rows(x.g, y2.g, false);
  CHECK(read(*b.gpu, y1.g) == read(*b.gpu, y2.g));
  for (DType dt : {DType::BF16, DType::F32}) {  // batch norm statistics and sums: bit-identical reruns
    const Shape s{8, 28, 28, 264};
    const int64_t C = 264;
    Pair bx = make_pair(b, s, dt, rng, -2.f, 3.f), by = make_pair(b, s, dt, rng), bd = make_pair(b, s, dt, rng);
    Pair dx1 = make_pair(b, s, dt, rng), dx2 = make_pair(b, s, dt, rng);
    Pair st[10];
    for (Pair& p : st) p = make_pair(b, {C}, DType::F32, rng, 0.5f, 1.5f);
    std::vector<float> first[4];
    for (int run = 0; run < 2; ++run) {
      b.gpu->batchnorm_fwd_train(bx.g, st[0].g, st[1].g, by.g, st[2].g, st[3].g, st[4].g, st[5].g, 0.1f, 1e-5f);
      b.gpu->batchnorm_bwd(bd.g, bx.g, st[0].g, st[4].g, st[5].g, run ? dx2.g : dx1.g, st[6].g, st[7].g, false);
      std::vector<float> now[4] = {read(*b.gpu, st[4].g), read(*b.gpu, st[5].g), read(*b.gpu, st[6].g),
                                   read(*b.gpu, st[7].g)};
      if (run == 0)
        for (int i = 0; i < 4; ++i) first[i] = now[i];
      else
        for (int i = 0; i < 4; ++i) CHECK_MESSAGE(now[i] == first[i], "batch norm rerun differs: output ", i);
    }
    CHECK(read(*b.gpu, dx1.g) == read(*b.gpu, dx2.g));
  }
  try {
    (void)b.gpu->alloc(size_t(1) << 50);  // 1 PiB
    FAIL("alloc of 1 PiB did not throw");
  } catch (const RuntimeFault& e) {
    std::string m = e.what();
    CHECK(m.find("out of memory") != std::string::npos);
    CHECK(m.find("train.batch_size") != std::string::npos);
    CHECK(m.find("precision.dtype") != std::string::npos);
  }
  void* p = b.gpu->alloc(1000);  // the backend still works after the failure
  b.gpu->free(p);
  CHECK(b.gpu->all_finite(x.g));
}


// Milliseconds per call of fn on be: one warm-up call, then iters calls between two syncs.
template <typename F>
double mean_ms(Backend& be, int iters, F&& fn) {
  fn();
  be.synchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) fn();
  be.synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
}

// Throughput report (numbers for the log; the checks are on the timed outputs).
TEST_CASE("gpu: throughput of gemm / conv / batchnorm / adamw") {
  GPU_OR_SKIP();
  Backends b;
  Backend& g = *b.gpu;
  auto time_ms = [&](int iters, auto&& fn) { return mean_ms(g, iters, fn); };
  auto finite_nonzero = [&](const Tensor& t) {
    CHECK(g.all_finite(t));
    CHECK(g.sum_squares(t) > 0);
  };
  for (DType dt : kDtypes) {
    const int64_t n = 4096;
    Buffer ba(g, n * n * 2 * 2), bb(g, n * n * 4), bc(g, n * n * 4);
    Tensor a = ba.tensor(dt, {n, n}), w = bb.tensor(dt, {n, n}), c = bc.tensor(dt, {n, n});
    g.fill(a, 0.01f);
    g.fill(w, 0.02f);
    double ms = time_ms(5, [&] { g.gemm(false, true, 1.f, a, w, 0.f, c); });
    MESSAGE("gemm 4096^3 ", std::string(dtype_name(dt)), ": ", ms, " ms, ", 2.0 * n * n * n / ms / 1e9, " TFLOP/s");
    finite_nonzero(c);
  }
  for (DType dt : kDtypes) {  // ResNet-50 stage-1 3x3 conv, batch 64
    const int64_t N = 64, H = 56, C = 64;
    Buffer bx(g, N * H * H * C * 4), bw(g, C * 9 * C * 4), by(g, N * H * H * C * 4);
    Tensor x = bx.tensor(dt, {N, H, H, C}), w = bw.tensor(dt, {C, 3, 3, C}), y = by.tensor(dt, {N, H, H, C});
    g.fill(x, 0.01f);  // small enough that f16 dw (a sum over 200k products) stays finite
    g.fill(w, 0.001f);
    Conv2dParams p{1, 1, 1, 1, 1, 1};
    Tensor none;
    double flop = 2.0 * N * H * H * C * C * 9;
    double f = time_ms(10, [&] { g.conv2d_fwd(x, w, none, y, p); });
    double d = time_ms(10, [&] { g.conv2d_bwd_data(y, w, x, p, false); });
    double wg = time_ms(10, [&] { g.conv2d_bwd_filter(x, y, w, none, p, false); });
    MESSAGE("conv3x3 64ch 64x56x56 ", std::string(dtype_name(dt)), ": fwd ", flop / f / 1e9,
            " bwd_data ", flop / d / 1e9, " bwd_filter ", flop / wg / 1e9, " TFLOP/s");
    finite_nonzero(w);
    Buffer bs(g, 6 * C * 4);
    Tensor st[6];
    for (int i = 0; i < 6; ++i) st[i] = bs.tensor(DType::F32, {C}, size_t(i) * C * 4);
    g.fill(st[0], 1.f);
    g.fill(st[1], 0.f);
    double bn = time_ms(10, [&] { g.batchnorm_fwd_train(x, st[0], st[1], y, st[2], st[3], st[4], st[5], 0.1f, 1e-5f); });
    MESSAGE("batchnorm_fwd_train 64x56x56x64 ", std::string(dtype_name(dt)), ": ", bn, " ms, ",
            3.0 * x.nbytes() / bn / 1e6, " GB/s (2 reads + 1 write)");
  }
  const int64_t P = 124'000'000;
  Buffer bp(g, P * 4), bg(g, P * 4), bm(g, P * 4), bv(g, P * 4);
  Tensor p = bp.tensor(DType::F32, {P}), gr = bg.tensor(DType::F32, {P}), m = bm.tensor(DType::F32, {P}), v = bv.tensor(DType::F32, {P});
  g.fill(p, 1.f); g.fill(gr, 0.5f); g.fill(m, 0.f); g.fill(v, 0.f);
  std::vector<ParamSegment> segs = {{0, P / 2, true}, {P / 2, P - P / 2, false}};
  AdamWArgs args;
  double ms = time_ms(5, [&] { g.adamw_step(p, gr, m, v, segs, args); });
  MESSAGE("adamw 124M params: ", ms, " ms, ", 7.0 * P * 4 / ms / 1e6, " GB/s");
  finite_nonzero(p);
}

// Memory-bound CNN kernels at ResNet-50 / U-Net sizes: ms per call and GB/s counting the
// minimum traffic (each input read once, each output written once) against ~3000 GB/s.
TEST_CASE("gpu: throughput of the memory-bound CNN kernels") {
  GPU_OR_SKIP();
  Backends b;
  Backend& g = *b.gpu;
  auto time_ms = [&](int iters, auto&& fn) { return mean_ms(g, iters, fn); };
  auto gbs = [](double bytes, double ms) { return bytes / ms / 1e6; };
  Rng rng(13, 1);
  for (DType dt : kDtypes) {
    const std::string dn(dtype_name(dt));
    const int64_t N = 64, H = 56, C = 64, n = N * H * H * C;
    const double nb = double(n) * double(dtype_size(dt));
    std::vector<float> hx(static_cast<size_t>(n)), hd(static_cast<size_t>(n));
    for (auto& v : hx) v = rng.uniform() * 4.f - 2.f;
    for (auto& v : hd) v = rng.uniform() - 0.5f;
    Buffer b1(g, size_t(nb)), b2(g, size_t(nb)), b3(g, size_t(nb));
    Tensor x = b1.tensor(dt, {N, H, H, C}), d = b2.tensor(dt, {N, H, H, C}), z = b3.tensor(dt, {N, H, H, C});
    upload_gpu(g, x, hx);
    upload_gpu(g, d, hd);
    double add = time_ms(20, [&] { g.add(x, d, z); });
    double rf = time_ms(20, [&] { g.relu_fwd(x, z); });
    double rb = time_ms(20, [&] { g.relu_bwd(x, d, z); });
    MESSAGE("64x56x56x64 ", dn, ": add ", add, " ms ", gbs(3 * nb, add), " GB/s, relu_fwd ", rf,
            " ms ", gbs(2 * nb, rf), " GB/s, relu_bwd ", rb, " ms ", gbs(3 * nb, rb), " GB/s");
    Buffer bs(g, 8 * C * 4);
    Tensor st[8];
    for (int i = 0; i < 8; ++i) st[i] = bs.tensor(DType::F32, {C}, size_t(i) * C * 4);
    g.fill(st[0], 1.f);
    g.fill(st[1], 0.f);
    g.fill(st[2], 0.f);
    g.fill(st[3], 1.f);
    double bf = time_ms(20, [&] { g.batchnorm_fwd_train(x, st[0], st[1], z, st[2], st[3], st[4], st[5], 0.1f, 1e-5f); });
    double bw = time_ms(20, [&] { g.batchnorm_bwd(d, x, st[0], st[4], st[5], z, st[6], st[7], false); });
    double be = time_ms(20, [&] { g.batchnorm_fwd_eval(x, st[0], st[1], st[2], st[3], z, 1e-5f); });
    MESSAGE("batchnorm 64x56x56x64 ", dn, ": fwd_train ", bf, " ms ", gbs(3 * nb, bf), " GB/s, bwd ", bw,
            " ms ", gbs(5 * nb, bw), " GB/s, fwd_eval ", be, " ms ", gbs(2 * nb, be), " GB/s");
    CHECK(g.all_finite(z));
    // ResNet stem pooling: 3x3 stride 2 pad 1 over [64,56,56,64] -> [64,28,28,64]
    Pool2dParams pp{3, 3, 2, 2, 1, 1};
    Buffer b4(g, size_t(nb / 4)), b5(g, size_t(nb / 4)), b6(g, size_t(N * 28 * 28 * C));
    Tensor py = b4.tensor(dt, {N, 28, 28, C}), pdy = b5.tensor(dt, {N, 28, 28, C});
    Tensor pam = b6.tensor(DType::U8, {N, 28, 28, C});
    g.fill(pdy, 0.5f);
    const double amb = double(pam.numel());  // argmax bytes
    double pf = time_ms(20, [&] { g.maxpool2d_fwd(x, py, pam, pp); });
    double pb = time_ms(20, [&] { g.maxpool2d_bwd(pam, pdy, z, pp, false); });
    MESSAGE("maxpool 3x3/2 64x56x56x64 ", dn, ": fwd ", pf, " ms ", gbs(1.25 * nb + amb, pf),
            " GB/s, bwd ", pb, " ms ", gbs(1.25 * nb + amb, pb), " GB/s");
    CHECK(g.sum_squares(z) > 0);
  }
  for (DType dt : kDtypes) {  // U-Net 256x256 batch 16: 2-class losses and a skip concat
    const std::string dn(dtype_name(dt));
    const int64_t P = 16 * 256 * 256, K = 2, es = int64_t(dtype_size(dt));
    std::vector<float> hl(static_cast<size_t>(P * K));
    for (auto& v : hl) v = rng.uniform() * 4.f - 2.f;
    std::vector<int32_t> lab(static_cast<size_t>(P));
    for (auto& l : lab) l = int32_t(rng.below(2));
    Buffer bl(g, size_t(P * K * es)), bd(g, size_t(P * K * es)), blab(g, size_t(P * 4)), bloss(g, size_t(P * 4));
    Tensor logits = bl.tensor(dt, {16, 256, 256, K}), dl = bd.tensor(dt, {16, 256, 256, K});
    Tensor labels = blab.tensor(DType::I32, {16, 256, 256}), losses = bloss.tensor(DType::F32, {P});
    upload_gpu(g, logits, hl);
    g.copy_from_host(labels.data, lab.data(), lab.size() * 4);
    Tensor flat = logits.view(Shape{P, K}), dflat = dl.view(Shape{P, K}), lflat = labels.view(Shape{P});
    double xe = time_ms(20, [&] { g.softmax_xent(flat, lflat, 0.f, 1.f / float(P), losses, dflat); });
    Buffer bdice(g, sizeof(float));
    Tensor dice_dev = bdice.tensor(DType::F32, {1});
    double di = time_ms(20, [&] { g.softmax_dice(logits, labels, 1.f, 1.f, dice_dev, dl); });
    float dice = 0;
    g.copy_to_host(&dice, dice_dev.data, sizeof dice);
    const double lb = double(P * K * es), ib = double(P * 4);
    MESSAGE("16x256x256x2 ", dn, ": softmax_xent ", xe, " ms ", gbs(2 * lb + 2 * ib, xe),
            " GB/s, softmax_dice ", di, " ms ", gbs(3 * lb + 2 * ib, di), " GB/s");
    CHECK(std::isfinite(dice));
    const int64_t R = 16 * 128 * 128, Ca = 64;
    Buffer ba(g, size_t(R * Ca * es)), bb(g, size_t(R * Ca * es)), by(g, size_t(R * 2 * Ca * es));
    Tensor ta = ba.tensor(dt, {16, 128, 128, Ca}), tb = bb.tensor(dt, {16, 128, 128, Ca});
    Tensor ty = by.tensor(dt, {16, 128, 128, 2 * Ca});
    g.fill(ta, 1.f);
    g.fill(tb, 2.f);
    double cc = time_ms(20, [&] { g.concat_channels(ta, tb, ty); });
    double sp = time_ms(20, [&] { g.split_channels(ty, ta, tb); });
    const double cb = double(R * 2 * Ca * es);
    MESSAGE("concat/split 16x128x128x(64+64) ", dn, ": concat ", cc, " ms ", gbs(2 * cb, cc),
            " GB/s, split ", sp, " ms ", gbs(2 * cb, sp), " GB/s");
    CHECK(g.sum_squares(ty) > 0);
  }
}

}  // TEST_SUITE("gpu")

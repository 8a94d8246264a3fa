// CpuBackend: construction, dtype support, memory, scratch, elementwise ops and reductions.
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/chunked.h"

#include <malloc.h>

#include <cblas.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#ifdef __F16C__
#include <immintrin.h>
#endif
#include <new>
#include <string_view>

#include "core/error.h"

namespace dtrain {

namespace cpu {
const char* op_name(Op op) {
  switch (op) {
    case Op::Fill: return "fill";
    case Op::Copy: return "copy";
    case Op::Cast: return "cast";
    case Op::Add: return "add";
    case Op::Axpby: return "axpby";
    case Op::Scale: return "scale";
    case Op::SumSquares: return "sum_squares";
    case Op::SumRows: return "sum_rows";
    case Op::AllFinite: return "all_finite";
    case Op::Gemm: return "gemm";
    case Op::AddBias: return "add_bias";
    case Op::Conv2dFwd: return "conv2d_fwd";
    case Op::Conv2dBwdData: return "conv2d_bwd_data";
    case Op::Conv2dBwdFilter: return "conv2d_bwd_filter";
    case Op::BatchNormFwdTrain: return "batchnorm_fwd_train";
    case Op::BatchNormFwdEval: return "batchnorm_fwd_eval";
    case Op::BatchNormBwd: return "batchnorm_bwd";
    case Op::ReluFwd: return "relu_fwd";
    case Op::ReluBwd: return "relu_bwd";
    case Op::MaxPoolFwd: return "maxpool2d_fwd";
    case Op::MaxPoolBwd: return "maxpool2d_bwd";
    case Op::AvgPoolFwd: return "avgpool2d_fwd";
    case Op::AvgPoolBwd: return "avgpool2d_bwd";
    case Op::GlobalAvgPoolFwd: return "global_avgpool_fwd";
    case Op::GlobalAvgPoolBwd: return "global_avgpool_bwd";
    case Op::SoftmaxXent: return "softmax_xent";
    case Op::SgdStep: return "sgd_step";
    case Op::AdamWStep: return "adamw_step";
    case Op::LayerNormFwd: return "layernorm_fwd";
    case Op::LayerNormBwd: return "layernorm_bwd";
    case Op::GeluFwd: return "gelu_fwd";
    case Op::GeluBwd: return "gelu_bwd";
    case Op::EmbeddingFwd: return "embedding_fwd";
    case Op::EmbeddingBwd: return "embedding_bwd";
    case Op::AttentionFwd: return "attention_fwd";
    case Op::AttentionBwd: return "attention_bwd";
    case Op::SoftmaxXentMasked: return "softmax_xent_masked";
    case Op::VocabXent: return "vocab_xent";
    case Op::AttentionDecode: return "attention_decode";
    case Op::UpsampleBilinear2xFwd: return "upsample_bilinear2x_fwd";
    case Op::UpsampleBilinear2xBwd: return "upsample_bilinear2x_bwd";
    case Op::ConcatChannels: return "concat_channels";
    case Op::SplitChannels: return "split_channels";
    case Op::SoftmaxDice: return "softmax_dice";
    case Op::Conv2dCat: return "conv2d_cat";
    case Op::RmsNormFwd: return "rmsnorm_fwd";
    case Op::RmsNormBwd: return "rmsnorm_bwd";
    case Op::RopeFwd: return "rope_fwd";
    case Op::RopeBwd: return "rope_bwd";
    case Op::SwigluFwd: return "swiglu_fwd";
    case Op::SwigluBwd: return "swiglu_bwd";
    case Op::MoeRouteFwd: return "moe_route_fwd";
    case Op::MoeRouteBwd: return "moe_route_bwd";
    case Op::MoeGather: return "moe_gather";
    case Op::MoeCombine: return "moe_combine";
    case Op::MoeCombineBwd: return "moe_combine_bwd";
    case Op::Count_: break;
  }
  return "?";
}
}  // namespace cpu

CpuBackend::CpuBackend(int threads) {
  threads_ = threads > 0 ? threads : omp_get_num_procs();
  // oneDNN (OpenMP build) and our loops use the OpenMP default team size. OpenBLAS stays
  // single-threaded: cpu::sgemm splits the work over the OpenMP team instead (OpenBLAS's own
  // pthread pool would spin against it).
  omp_set_num_threads(threads_);
  openblas_set_num_threads(1);
  if (const char* e = std::getenv("DTRAIN_CPU_CONV")) {
    std::string_view v(e);
    if (v == "im2col") conv_impl_ = cpu::ConvImpl::Im2col;
    else if (v == "dnnl" || v == "onednn" || v.empty()) conv_impl_ = cpu::ConvImpl::Dnnl;
    else user_error("DTRAIN_CPU_CONV: expected 'dnnl' or 'im2col', got '{}'", v);
  }
}

CpuBackend::~CpuBackend() = default;

std::string CpuBackend::name() const {
  return fmt::format("cpu ({} threads, conv {})", threads_,
                     conv_impl_ == cpu::ConvImpl::Dnnl ? "oneDNN" : "im2col+sgemm");
}

bool CpuBackend::supports(Op op, DType t) const {
  if (op == Op::Conv2dCat) return false;  // callers concatenate (the reference path)
  if (t == DType::F32) return true;
  if (t != DType::BF16 && t != DType::F16) return false;
  switch (op) {
    case Op::SgdStep:
    case Op::AdamWStep:
      return false;  // master weights, grads and optimizer state are f32
    default:
      return true;  // Fill/Copy/Cast natively; the rest emulated (16-bit storage, f32 math)
  }
}

void CpuBackend::require(Op op, const Tensor& t) const {
  // Every op starts here: make the OpenMP team (our loops, oneDNN, cpu::sgemm) use this
  // backend's thread count even when another backend in the process set a different one.
  if (omp_get_max_threads() != threads_) omp_set_num_threads(threads_);
  if (!t.defined()) return;
  if (!supports(op, t.dtype))
    fault("cpu backend: op {} does not support dtype {} (tensor {})", cpu::op_name(op),
          dtype_name(t.dtype), t.shape.str());
}

// ---------------------------------------------------------------- memory
void* CpuBackend::alloc(size_t bytes) {
  size_t n = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  void* p = std::aligned_alloc(256, n);
  if (!p) fault("cpu backend: out of host memory allocating {} bytes", bytes);
  counts_.allocs++;
  counts_.system_allocs++;
  counts_.bytes_in_use += int64_t(malloc_usable_size(p));  // what the block really takes
  counts_.peak_bytes = std::max(counts_.peak_bytes, counts_.bytes_in_use);
  return p;
}
void CpuBackend::free(void* p) {
  if (!p) return;
  counts_.frees++;
  counts_.system_frees++;
  counts_.bytes_in_use -= int64_t(malloc_usable_size(p));
  std::free(p);
}
void CpuBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}
void CpuBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}
void CpuBackend::copy_device(void* dst, const void* src, size_t bytes) {
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}

// ---------------------------------------------------------------- scratch / 16-bit views
float* CpuBackend::scratch(int slot, int64_t n) {
  DTRAIN_CHECK(slot >= 0 && slot < kScratchSlots, "scratch slot {}", slot);
  auto& v = scratch_[size_t(slot)];
  if (int64_t(v.size()) < n) {
    v.resize(size_t(n));
    counts_.internal++;
    counts_.system_allocs++;
  }
  return v.data();
}

double* CpuBackend::scratch64(int slot, int64_t n) {
  DTRAIN_CHECK(slot >= 0 && slot < 4, "scratch64 slot {}", slot);
  auto& v = scratch64_[size_t(slot)];
  if (int64_t(v.size()) < n) {
    v.resize(size_t(n));
    counts_.internal++;
    counts_.system_allocs++;
  }
  return v.data();
}

namespace {
// Element conversion of n values between float dtypes (parallel; elementwise, so exact).
void convert(const void* src, DType st, void* dst, DType dt, int64_t n) {
  if (st == dt) {
    if (src != dst) std::memcpy(dst, src, size_t(n) * dtype_size(st));
    return;
  }
  // Fast paths for the conversions mixed precision runs on every op (widen 16-bit inputs,
  // round f32 outputs): one loop per pair without a per-element switch, F16C for fp16
  // (round to nearest even like f32_to_f16; only NaN payloads may differ).
  if (dt == DType::F32 && st == DType::BF16) {
    const uint16_t* a = static_cast<const uint16_t*>(src);
    float* d = static_cast<float*>(dst);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(a[i]);
    return;
  }
  if (dt == DType::BF16 && st == DType::F32) {
    const float* a = static_cast<const float*>(src);
    uint16_t* d = static_cast<uint16_t*>(dst);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) {  // f32_to_bf16 without a branch, so it vectorises
      uint32_t u;
      std::memcpy(&u, a + i, 4);
      const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      const uint32_t quiet_nan = (u >> 16) | 0x40u;
      d[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
    }
    return;
  }
#ifdef __F16C__
  if ((dt == DType::F32 && st == DType::F16) || (dt == DType::F16 && st == DType::F32)) {
    const bool widen = dt == DType::F32;
    const int64_t blocks = n / 8;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t b = 0; b < blocks; ++b) {
      if (widen) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + 8 * b));
        _mm256_storeu_ps(static_cast<float*>(dst) + 8 * b, _mm256_cvtph_ps(h));
      } else {
        __m256 f = _mm256_loadu_ps(static_cast<const float*>(src) + 8 * b);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(dst) + 8 * b),
                         _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
    }
    for (int64_t i = blocks * 8; i < n; ++i) {
      if (widen)
        static_cast<float*>(dst)[i] = f16_to_f32(static_cast<const uint16_t*>(src)[i]);
      else
        static_cast<uint16_t*>(dst)[i] = f32_to_f16(static_cast<const float*>(src)[i]);
    }
    return;
  }
#endif
  auto load = [&](int64_t i) -> float {
    switch (st) {
      case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
      case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
      default: return static_cast<const float*>(src)[i];
    }
  };
  if (dt == DType::F32) {
    float* d = static_cast<float*>(dst);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) d[i] = load(i);
  } else if (dt == DType::BF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(load(i));
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(load(i));
  }
}

void check_float(const char* op, const Tensor& t, const char* what) {
  if (!is_float(t.dtype))
    fault("cpu backend: {}: {} must be a float tensor, got {}", op, what, t.str());
}
void check_numel(const char* op, const Tensor& a, const Tensor& b) {
  if (a.numel() != b.numel())
    fault("cpu backend: {}: element counts differ: {} vs {}", op, a.str(), b.str());
}
// y[i] = f(a[i], b[i]) over f32 views (slots 0, 1, 2), parallel above 64Ki elements.
template <class F>
void map2(CpuBackend& be, const Tensor& a, const Tensor& b, const Tensor& y, const F& f) {
  const float* pa = be.in_f32(a, 0);
  const float* pb = be.in_f32(b, 1);
  float* py = be.out_f32(y, 2, false);
  const int64_t n = y.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) py[i] = f(pa[i], pb[i]);
  be.store_f32(py, y);
}
}  // namespace

const float* CpuBackend::in_f32(const Tensor& t, int slot) {
  if (!t.defined()) return nullptr;
  if (t.dtype == DType::F32) return static_cast<const float*>(t.data);
  float* s = scratch(slot, t.numel());
  convert(t.data, t.dtype, s, DType::F32, t.numel());
  return s;
}
float* CpuBackend::out_f32(const Tensor& t, int slot, bool load_old) {
  if (!t.defined()) return nullptr;
  if (t.dtype == DType::F32) return static_cast<float*>(t.data);
  float* s = scratch(slot, t.numel());
  if (load_old) convert(t.data, t.dtype, s, DType::F32, t.numel());
  return s;
}
void CpuBackend::store_f32(const float* src, const Tensor& t) {
  if (!t.defined() || t.dtype == DType::F32) return;
  convert(src, DType::F32, t.data, t.dtype, t.numel());
}
void CpuBackend::add_rounded(const float* v, Tensor& acc, int slot) {
  if (acc.dtype == DType::F32) {
    add(acc, Tensor(const_cast<float*>(v), DType::F32, device(), acc.shape), acc);
    return;
  }
  // 16 bits: v rounded into 16-bit storage (half a float each) first
  void* r = scratch(slot, (acc.numel() + 1) / 2);
  convert(v, DType::F32, r, acc.dtype, acc.numel());
  add(acc, Tensor(r, acc.dtype, device(), acc.shape), acc);
}

// ---------------------------------------------------------------- elementwise
void CpuBackend::fill(Tensor& y, float value) {
  require(Op::Fill, y);
  check_float("fill", y, "y");
  const int64_t n = y.numel();
  if (y.dtype == DType::F32) {
    float* p = y.f32();
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) p[i] = value;
  } else {
    uint16_t h = y.dtype == DType::BF16 ? f32_to_bf16(value) : f32_to_f16(value);
    uint16_t* p = y.ptr<uint16_t>();
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) p[i] = h;
  }
}

void CpuBackend::copy(const Tensor& x, Tensor& y) {
  require(Op::Copy, x);
  require(Op::Copy, y);
  check_numel("copy", x, y);
  if (x.dtype != y.dtype) fault("cpu backend: copy: dtypes differ: {} vs {} (use cast)", x.str(), y.str());
  copy_device(y.data, x.data, x.nbytes());
}

void CpuBackend::cast(const Tensor& x, Tensor& y) {
  require(Op::Cast, x);
  require(Op::Cast, y);
  check_float("cast", x, "x");
  check_float("cast", y, "y");
  check_numel("cast", x, y);
  convert(x.data, x.dtype, y.data, y.dtype, x.numel());
}

void CpuBackend::add(const Tensor& a, const Tensor& b, Tensor& y) {
  require_all(Op::Add, a, b, y);
  check_numel("add", a, y);
  check_numel("add", b, y);
  map2(*this, a, b, y, [](float u, float v) { return u + v; });
}

void CpuBackend::axpby(float alpha, const Tensor& x, float beta, Tensor& y) {
  require(Op::Axpby, x);
  require(Op::Axpby, y);
  check_numel("axpby", x, y);
  const float* px = in_f32(x, 0);
  float* py = out_f32(y, 1, beta != 0.f);
  const int64_t n = y.numel();
  if (beta == 0.f) {  // y is not read (it may hold NaN), as BLAS does
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) py[i] = alpha * px[i];
  } else {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) py[i] = alpha * px[i] + beta * py[i];
  }
  store_f32(py, y);
}

void CpuBackend::scale(Tensor& y, float s) {
  require(Op::Scale, y);
  float* py = out_f32(y, 0, true);
  const int64_t n = y.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) py[i] *= s;
  store_f32(py, y);
}

// ---------------------------------------------------------------- reductions
// One serial pass in double, in index order (what the tasks' loss sums always were).
double CpuBackend::sum(const Tensor& x) {
  require(Op::SumSquares, x);
  const float* p = in_f32(x, 0);
  double s = 0;
  for (int64_t i = 0; i < x.numel(); ++i) s += p[i];
  return s;
}
void CpuBackend::sum_into(const Tensor& x, double scale, Tensor& acc, bool accumulate) {
  if (acc.dtype != DType::F64 || acc.numel() != 1) fault("cpu backend: sum_into: acc {} must be f64 [1]", acc.str());
  const double s = scale * sum(x);
  double* a = acc.ptr<double>();
  *a = accumulate ? *a + s : s;
}
double CpuBackend::sum_squares(const Tensor& x) {
  require(Op::SumSquares, x);
  const float* p = in_f32(x, 0);
  const int64_t n = x.numel();
  const int64_t nchunks = (n + cpu::kChunkElems - 1) / cpu::kChunkElems;
  double* part = scratch64(3, nchunks);
#pragma omp parallel for schedule(static) if (nchunks > 1)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t b = c * cpu::kChunkElems, e = std::min(n, b + cpu::kChunkElems);
    double s = 0;
    for (int64_t i = b; i < e; ++i) s += double(p[i]) * double(p[i]);
    part[c] = s;
  }
  double s = 0;
  for (int64_t c = 0; c < nchunks; ++c) s += part[c];
  return s;
}

void CpuBackend::sum_rows(const Tensor& x, Tensor& y, bool accumulate) {
  require(Op::SumRows, x);
  require(Op::SumRows, y);
  const int64_t N = y.numel();
  if (N == 0 || x.numel() % N != 0 || (x.ndim() >= 1 && x.dim(-1) != N))
    fault("cpu backend: sum_rows: x {} is not [M,{}] for y {}", x.str(), N, y.str());
  const int64_t M = x.numel() / N;
  const float* px = in_f32(x, 0);
  float* py = out_f32(y, 1, accumulate);
  cpu::sum_rows_f32(px, M, N, py, accumulate, scratch64(3, cpu::sum_rows_partials(M, N)));
  store_f32(py, y);
}

namespace cpu {
int64_t sum_rows_partials(int64_t M, int64_t N) {
  const int64_t R = chunk_rows(N);
  return (M + R - 1) / R * N;
}
void sum_rows_f32(const float* px, int64_t M, int64_t N, float* py, bool accumulate,
                  double* part) {
  const int64_t nchunks = chunk_partials(M, N, N, part, [&](int64_t r, double* acc) {
    const float* row = px + r * N;
    for (int64_t j = 0; j < N; ++j) acc[j] += row[j];
  });
#pragma omp parallel for schedule(static) if (N > 4096)
  for (int64_t j = 0; j < N; ++j) {
    double s = accumulate ? py[j] : 0.0;
    for (int64_t c = 0; c < nchunks; ++c) s += part[c * N + j];
    py[j] = float(s);
  }
}
}  // namespace cpu

bool CpuBackend::all_finite(const Tensor& x) {
  require(Op::AllFinite, x);
  const int64_t n = x.numel();
  bool ok = true;
  if (x.dtype == DType::F32) {
    const uint32_t* p = x.ptr<uint32_t>();
#pragma omp parallel for schedule(static) reduction(&& : ok) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) ok = ok && ((p[i] & 0x7f800000u) != 0x7f800000u);
  } else {
    const uint16_t* p = x.ptr<uint16_t>();
    const uint16_t m = x.dtype == DType::BF16 ? 0x7f80u : 0x7c00u;
#pragma omp parallel for schedule(static) reduction(&& : ok) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) ok = ok && ((p[i] & m) != m);
  }
  return ok;
}

// ---------------------------------------------------------------- activations
void CpuBackend::relu_fwd(const Tensor& x, Tensor& y) {
  require(Op::ReluFwd, x);
  require(Op::ReluFwd, y);
  check_numel("relu_fwd", x, y);
  const float* px = in_f32(x, 0);
  float* py = out_f32(y, 1, false);
  const int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) py[i] = px[i] > 0.f ? px[i] : 0.f;
  store_f32(py, y);
}

void CpuBackend::relu_bwd(const Tensor& y, const Tensor& dy, Tensor& dx) {
  require_all(Op::ReluBwd, y, dy, dx);
  check_numel("relu_bwd", y, dy);
  check_numel("relu_bwd", y, dx);
  // g is loaded unconditionally (an argument): the select vectorises (no branch)
  map2(*this, y, dy, dx, [](float v, float g) { return v > 0.f ? g : 0.f; });
}

std::unique_ptr<Backend> make_cpu_backend(int threads) {
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace dtrain

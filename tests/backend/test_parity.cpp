// The op parity table (tests/backend/parity/): every Op has rows; each family of rows runs
//   "parity cpu: F ..."       the CPU against the naive reference, gradient checks, the CPU's
//                             16-bit emulation, 1 thread vs 2, reruns (harness.h, stage 1)
//   "parity backends: F ..."  a second CPU backend (1 thread) against the CPU through the same
//                             comparison the GPU gets, so that it is exercised where no GPU is
//   "parity cuda: F ..."      CUDA against the CPU in f32, bf16 and f16 (gpu; skipped without
//                             a device)
// and the harness itself is checked against a backend with planted faults.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "parity/harness.h"
#include "skip.h"

using namespace dtrain;
using namespace dtrain::parity;

namespace {

// Every family of the table, in the order of the test cases below.
const char* const kFamilies[] = {"elementwise", "gemm", "conv", "norm", "pool", "loss", "optim", "gpt", "attention", "unet",
                                 "llama", "moe"};

// Ops whose gradient comes out of the op itself (losses) or of other calls of it (gemm), besides
// the *Bwd ops: each needs a row with a finite-difference gradient check.
const Op kGradOps[] = {Op::SoftmaxXent, Op::SoftmaxXentMasked, Op::SoftmaxDice, Op::Gemm, Op::SplitChannels};

void expect_clean(const Report& r, const std::string& what) {
  const size_t shown = std::min<size_t>(r.problems.size(), 40);
  for (size_t i = 0; i < shown; ++i) FAIL_CHECK(r.problems[i]);
  CHECK_MESSAGE(r.problems.empty(), what << ": " << r.problems.size() << " problems (" << shown << " shown)");
  CHECK_MESSAGE(r.compared > 0, what << ": nothing was compared");
  MESSAGE(what << ": " << r.compared << " comparisons");
}

std::vector<const Row*> family(const std::string& f) {
  std::vector<const Row*> out;
  for (const Row& r : rows())
    if (r.family == f) out.push_back(&r);
  REQUIRE_MESSAGE(!out.empty(), "no rows in family " << f);
  return out;
}

void run_cpu(const std::string& f) {
  Report all;
  for (const Row* r : family(f)) all.add(cpu_vs_reference(*r));
  expect_clean(all, f + " on the cpu");
}

void run_backend(Backend& other, const std::string& f) {
  CpuBackend cpu(2);
  Report all;
  for (const Row* r : family(f))
    if (r->cpu || !other.device().is_cpu()) all.add(backend_vs_cpu(*r, other, cpu));
  expect_clean(all, f + " on " + other.name() + " vs the cpu");
}

std::string op_str(Op op) { return cpu::op_name(op); }

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("parity: every op has a row with a reference and every backward a gradient check") {
  for (int i = 0; i < kOpCount; ++i) {
    const Op op = Op(i);
    CAPTURE(op_str(op));
    bool has_ref = false, has_grad = false;
    for (const Row& r : rows()) {
      if (std::find(r.ops.begin(), r.ops.end(), op) == r.ops.end()) continue;
      has_ref = has_ref || (r.ref && r.cpu);
      has_grad = has_grad || r.grad.has_value();
    }
    CHECK_MESSAGE(has_ref, "op " << op_str(op) << " has no row with a reference (tests/backend/parity/rows_*.cpp)");
    const std::string name = op_str(op);
    const bool backward = name.size() > 4 && name.substr(name.size() - 4) == "_bwd";
    if (backward || std::find(std::begin(kGradOps), std::end(kGradOps), op) != std::end(kGradOps))
      CHECK_MESSAGE(has_grad, "op " << name << " has no row with a gradient check");
  }
  std::vector<std::string> names;
  for (const Row& r : rows()) {
    CHECK_MESSAGE(std::find(std::begin(kFamilies), std::end(kFamilies), r.family) != std::end(kFamilies),
                  "row " << r.name << ": family " << r.family << " has no test cases");
    CHECK_MESSAGE(!r.ops.empty(), "row " << r.name << " covers no op");
    CHECK_MESSAGE(r.run, "row " << r.name << " has no run");
    names.push_back(r.family + "/" + r.name);
  }
  std::sort(names.begin(), names.end());
  CHECK_MESSAGE(std::adjacent_find(names.begin(), names.end()) == names.end(), "two rows share a name");
  MESSAGE(rows().size() << " rows over " << kOpCount << " ops");
}

#define PARITY_CPU(F)                                                                                   \
  TEST_CASE("parity cpu: " F " against the naive reference - gradients - 16-bit emulation - threads") { \
    run_cpu(F);                                                                                         \
  }                                                                                                     \
  TEST_CASE("parity backends: " F " on a second cpu backend (1 thread) against the cpu") {            \
    CpuBackend one(1);                                                                                  \
    run_backend(one, F);                                                                                \
  }
PARITY_CPU("elementwise")
PARITY_CPU("gemm")
PARITY_CPU("conv")
PARITY_CPU("norm")
PARITY_CPU("pool")
PARITY_CPU("loss")
PARITY_CPU("optim")
PARITY_CPU("gpt")
PARITY_CPU("attention")
PARITY_CPU("unet")
PARITY_CPU("llama")
PARITY_CPU("moe")

}  // TEST_SUITE("unit")

TEST_SUITE("gpu") {

#define PARITY_CUDA(F)                                          \
  TEST_CASE("parity cuda: " F " against the cpu in f32 bf16 f16") { \
    GPU_OR_SKIP();                                              \
    auto gpu = make_backend("cuda");                            \
    run_backend(*gpu, F);                                       \
  }
PARITY_CUDA("elementwise")
PARITY_CUDA("gemm")
PARITY_CUDA("conv")
PARITY_CUDA("norm")
PARITY_CUDA("pool")
PARITY_CUDA("loss")
PARITY_CUDA("optim")
PARITY_CUDA("gpt")
PARITY_CUDA("attention")
PARITY_CUDA("unet")
PARITY_CUDA("llama")
PARITY_CUDA("moe")

}  // TEST_SUITE("gpu")

// ---------------------------------------------------------------- the harness catches faults
namespace {

// The CPU backend with one fault planted in relu_fwd.
enum class Fault { None, Guard, Unwritten, Zero, Input, Wrong };
class Faulty : public CpuBackend {
 public:
  explicit Faulty(Fault f) : CpuBackend(1), fault_(f) {}
  void relu_fwd(const Tensor& x, Tensor& y) override {
    const int64_t n = y.numel();
    if (fault_ == Fault::Unwritten) {  // the last element is never written
      Tensor xs(x.data, x.dtype, x.device, Shape{n - 1}), ys(y.data, y.dtype, y.device, Shape{n - 1});
      CpuBackend::relu_fwd(xs, ys);
      return;
    }
    CpuBackend::relu_fwd(x, y);
    REQUIRE(y.dtype == DType::F32);
    float* p = y.ptr<float>();
    if (fault_ == Fault::Guard) static_cast<unsigned char*>(y.data)[y.nbytes()] = 0;  // one byte past the end
    if (fault_ == Fault::Zero) std::memset(p, 0, y.nbytes());
    if (fault_ == Fault::Input) x.ptr<float>()[0] += 1.f;
    if (fault_ == Fault::Wrong) p[n / 2] += 0.5f;
  }

 private:
  Fault fault_;
};

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("parity harness: guard bytes - unwritten outputs - all-zero outputs - modified inputs - wrong values are caught") {
  const Row* relu = nullptr;
  for (const Row& r : rows())
    if (r.name == "relu fwd / bwd (dx aliasing dy) n=4099 off=0/0") relu = &r;
  REQUIRE(relu != nullptr);
  Row only_f32 = *relu;
  only_f32.dtypes = {DType::F32};
  CpuBackend cpu(2);
  struct Case {
    Fault f;
    const char* needle;
  };
  for (const Case& c : {Case{Fault::None, ""}, Case{Fault::Guard, "guard bytes"}, Case{Fault::Unwritten, "not finite"},
                        Case{Fault::Zero, "all zero"}, Case{Fault::Input, "an input was modified"},
                        Case{Fault::Wrong, "max error"}}) {
    CAPTURE(c.needle);
    Faulty be(c.f);
    const Report r = backend_vs_cpu(only_f32, be, cpu);
    CHECK(r.compared > 0);
    if (c.f == Fault::None) {
      CHECK(r.problems.empty());
      continue;
    }
    bool found = false;
    for (const auto& p : r.problems) found = found || p.find(c.needle) != std::string::npos;
    CHECK_MESSAGE(found, "no problem mentions '" << c.needle << "' among " << r.problems.size());
  }
}
}  // TEST_SUITE("unit")

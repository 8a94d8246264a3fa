#pragma once
// The op parity table's harness. A Row runs one or more backend ops on tensors it declares
// through an Io (inputs with seeded values, outputs), and may give a naive reference for
// its outputs (tests/support/ref_ops.h, in double), a finite-difference gradient check, and checks
// relating one run's outputs. The stages (harness.cpp), each returning a Report:
//   cpu_vs_reference  CPU, f32, against the reference (every CPU convolution implementation
//                     a row names); then the gradient check, the CPU's 16-bit emulation (the
//                     16-bit result is the f32 result rounded, bit for bit), 1 thread == 2
//                     threads, and a rerun being bit-identical
//   backend_vs_cpu    another backend (CUDA; or a second CPU backend, which checks this
//                     stage's machinery where no GPU is) against the CPU, in every float dtype
//                     both support, with the row's tolerance per output and dtype
// Every run of every stage: each tensor sits between guard bytes that must stay untouched,
// inputs must come back unchanged, outputs start as NaN (every element must be written) and
// must be finite and not all zero (Opts says where an output may be otherwise).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "core/buffer.h"
#include "core/rng.h"
#include "gradcheck.h"

namespace dtrain::parity {

using HostVec = std::vector<float>;
using IntVec = std::vector<int32_t>;
using Vals = std::vector<double>;  // an output as read back (f64: host scalars keep their precision)

// A tensor's storage: `act` follows the run's dtype (f32, bf16 or f16; f32 holding values
// rounded to that dtype on the CPU side of a comparison in f32); otherwise `dt` everywhere.
struct TType {
  bool act = true;
  DType dt = DType::F32;
};
inline constexpr TType kAct{true, DType::F32};
inline constexpr TType kF32{false, DType::F32};
inline constexpr TType fixed(DType t) { return {false, t}; }

// L2: ||got - want|| / ||want||; Max: max|got - want| / max|want| (ggml's test-backend-ops);
// Approx: max |got - want| / (1 + max(|got|, |want|)) per element (doctest's Approx);
// Abs: max|got - want|; Bits: bit-identical.
enum class Metric { L2, Max, Approx, Abs, Bits };
struct Check {
  Metric m = Metric::L2;
  double tol = 1e-5;
};
struct Opts {
  Check ref{Metric::L2, 1e-5};  // CPU f32 against the reference
  Check dev[3] = {{Metric::Max, 1e-4}, {Metric::Max, 1e-2}, {Metric::Max, 2e-3}};  // vs the CPU: f32, bf16, f16
  bool nonzero = true;  // not all zero (on every side)
  bool finite = true;   // no NaN or Inf
  bool emul = true;     // in the CPU's 16-bit emulation check
  bool cross = true;    // compared across backends (false: backend-specific, e.g. attention's saved)
  bool rerun = true;    // in the rerun-is-bit-identical check
  // In the 1-thread-vs-2 check bit for bit; false: a reduction the library splits by thread count
  // (oneDNN's AVX-512 backward-weights splits the minibatch over threads; its AVX2 kernel does not),
  // compared there with the `ref` tolerance instead: the thread count is part of the numerics
  // (docs/config.md, run.threads).
  bool threads = true;
  int64_t offset = 0;   // elements between the guard and the tensor (an unaligned pointer)
};
// Opts with the across-backends check set for all three dtypes.
inline Opts dev(Metric m, double f32, double bf16, double f16, Opts o = {}) {
  o.dev[0] = {m, f32}, o.dev[1] = {m, bf16}, o.dev[2] = {m, f16};
  return o;
}
inline Opts ref(Metric m, double tol, Opts o = {}) {
  o.ref = {m, tol};
  return o;
}
inline Opts no_emul(Opts o = {}) {
  o.emul = false;
  return o;
}
inline Opts may_be_zero(Opts o = {}) {
  o.nonzero = false;
  return o;
}
inline Opts thread_split(Opts o = {}) {
  o.threads = false;
  return o;
}
inline Opts at_offset(int64_t elements, Opts o = {}) {
  o.offset = elements;
  return o;
}

struct Report {
  std::vector<std::string> problems;
  int64_t compared = 0;  // output comparisons made
  void fail(std::string what) { problems.push_back(std::move(what)); }
  void add(const Report& o) {
    problems.insert(problems.end(), o.problems.begin(), o.problems.end());
    compared += o.compared;
  }
};

struct Row;
struct Out {
  Vals v;
  Opts o;
  TType t;
};
using Outs = std::map<std::string, Out>;
struct Want : std::map<std::string, Vals> {  // reference values by output name
  void put(const std::string& name, const HostVec& v) { (*this)[name] = Vals(v.begin(), v.end()); }
  void put(const std::string& name, Vals v) { (*this)[name] = std::move(v); }
};
using Overrides = std::map<std::string, HostVec>;  // input values replacing the seeded ones

// One run of a row on one backend.
class Io {
 public:
  Io(Backend& be, DType dt, bool act_f32, std::string seed_key, const Overrides* overrides = nullptr);
  ~Io();
  Backend& be;
  const DType dt;      // the run's dtype
  const bool act_f32;  // act tensors stored f32 (values still rounded to dt)
  bool on_cpu() const;

  // Inputs: seeded uniform values in [lo, hi) (rounded to the storage dtype), or given ones.
  Tensor in(const std::string& name, Shape s, TType t = kAct, float lo = -1.f, float hi = 1.f, int64_t offset = 0);
  Tensor in_vals(const std::string& name, Shape s, TType t, HostVec v, int64_t offset = 0);
  Tensor ids(const std::string& name, Shape s, IntVec v);
  // Outputs: NaN-filled, or (inout) holding initial values first (accumulation, in place).
  Tensor& out(const std::string& name, Shape s, TType t = kAct, Opts o = {});
  Tensor& inout(const std::string& name, Shape s, TType t, float lo, float hi, Opts o = {});
  Tensor& inout_vals(const std::string& name, Shape s, TType t, HostVec v, Opts o = {});
  // A host-side result (sum_squares, all_finite, a loss read back) as a 1-element output.
  void scalar(const std::string& name, double v, Opts o = {});
  // An output computed from others after the run (a slice), compared like any output.
  void derive(const std::string& name, Opts o, std::function<Vals(const Outs&)> f);
  // Scratch the row needs (NaN-filled, guarded, not compared).
  Tensor& temp(Shape s, TType t = kAct);

  // The values an input or output started with (rounded as stored), for references.
  const HostVec& h(const std::string& name) const;
  const IntVec& hi(const std::string& name) const;
  HostVec uniform(const std::string& name, size_t n, float lo, float hi) const;  // seeded
  Rng rng(const std::string& name) const;
  DType storage(TType t) const { return t.act ? (act_f32 ? DType::F32 : dt) : t.dt; }
  float round(TType t, float v) const;  // v as the tensor would hold it

  Outs collect(Report& r, const std::string& ctx);  // reads and checks every output
  std::vector<std::string> output_names() const;

 private:
  struct Slot;
  Slot& alloc(const std::string& name, Shape s, DType d, int64_t offset, bool nan);
  void upload(Slot& sl, const HostVec& v);
  std::string key_;
  const Overrides* overrides_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::map<std::string, HostVec> host_;
  std::map<std::string, IntVec> host_ids_;
  std::vector<std::tuple<std::string, Opts, double>> scalars_;
  std::vector<std::tuple<std::string, Opts, std::function<Vals(const Outs&)>>> derived_;
};

// Finite differences: loss = sum_i y_i * weight_i (weight "" : 1), run on the CPU in f32 with
// the input perturbed; its gradient w.r.t. each `wrt` input must equal the output named with
// it (what the row's backward op gave for the upstream gradient `weight`).
struct Grad {
  std::string y, weight;
  std::vector<std::pair<std::string, std::string>> wrt;
  testing::GradCheckOptions opt{};
  std::function<bool(const Io&, const std::string& input, int64_t i)> skip;  // known kinks
  bool bound_skips = true;  // at most 1 in 10 elements skipped
};

struct Row {
  std::string family, name;
  std::vector<Op> ops;                                   // what it covers
  std::function<void(Io&)> run;
  std::function<void(const Io&, Want&)> ref;             // naive reference of the outputs
  std::function<void(const Io&, const Outs&, Report&)> check;  // relations between outputs
  std::optional<Grad> grad;
  std::vector<DType> dtypes{DType::F32, DType::BF16, DType::F16};  // across backends
  bool same_dtype = false;   // the CPU side runs in the same dtype (emulated) instead of f32
  bool cpu = true;           // in the CPU stages (false: a size for the GPU's grid loops)
  bool emul = false;         // CPU 16-bit == CPU f32 rounded, bit for bit
  bool threads = false;      // CPU 1 thread == 2 threads, bit for bit (outputs with Opts::threads)
  bool dev_rerun = false;    // another backend's rerun is bit-identical (the CPU's always is)
  bool conv_impls = false;   // stage 1 under each CPU convolution implementation
  std::function<void(Backend&, bool on)> setup;  // backend options around the run (TF32, ...)
};

std::vector<Row>& rows();                 // the table (filled by the rows_*.cpp files)
int add_rows(std::vector<Row> more);      // for static registration: static int r = add_rows({...});
std::vector<std::string> families();      // in table order

Report cpu_vs_reference(const Row& row);
Report backend_vs_cpu(const Row& row, Backend& other, CpuBackend& cpu);

// Helpers for rows.
HostVec round_to(DType t, HostVec v);
float round_to(DType t, float v);
Vals wide(const HostVec& v);

}  // namespace dtrain::parity

// The parity table's harness (harness.h): tensors between guard bytes, NaN-filled outputs,
// the comparisons and the stages.
#include "harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include <fmt/format.h>

namespace dtrain::parity {

namespace {

constexpr size_t kGuard = 256;             // bytes before and after every tensor
constexpr unsigned char kGuardByte = 0xA5;
constexpr unsigned char kNanByte = 0xFF;   // 0xFFFF.. is a NaN in f32, bf16 and f16

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

int dtype_index(DType t) { return t == DType::BF16 ? 1 : t == DType::F16 ? 2 : 0; }

std::string describe(DType t) { return std::string(dtype_name(t)); }

}  // namespace

float round_to(DType t, float v) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  if (t == DType::F16) return f16_to_f32(f32_to_f16(v));
  return v;
}
HostVec round_to(DType t, HostVec v) {
  for (float& f : v) f = round_to(t, f);
  return v;
}
Vals wide(const HostVec& v) { return Vals(v.begin(), v.end()); }

// ---------------------------------------------------------------- Io
struct Io::Slot {
  std::string name;
  enum Kind { In, Output, Temp } kind = In;
  Buffer buf;
  Tensor t;
  size_t pre = 0;                    // bytes before the tensor (guard + offset)
  std::vector<unsigned char> bytes;  // an input's bytes as uploaded
  TType tt;
  Opts o;
};

Io::Io(Backend& b, DType d, bool f32, std::string key, const Overrides* ov)
    : be(b), dt(d), act_f32(f32), key_(std::move(key)), overrides_(ov) {}
Io::~Io() = default;

bool Io::on_cpu() const { return be.device().is_cpu(); }

float Io::round(TType t, float v) const { return round_to(t.act ? dt : t.dt, v); }

Rng Io::rng(const std::string& name) const { return Rng(fnv1a(key_ + "/" + name), 7); }

HostVec Io::uniform(const std::string& name, size_t n, float lo, float hi) const {
  Rng r = rng(name);
  HostVec v(n);
  for (float& f : v) f = lo + (hi - lo) * r.uniform();
  return v;
}

Io::Slot& Io::alloc(const std::string& name, Shape s, DType d, int64_t offset, bool nan) {
  for (const auto& sl : slots_)
    DTRAIN_CHECK(name.empty() || sl->name != name, "parity row: tensor name {} used twice", name);
  auto sl = std::make_unique<Slot>();
  sl->name = name;
  const size_t n = size_t(s.numel()) * dtype_size(d);
  sl->pre = kGuard + size_t(offset) * dtype_size(d);
  sl->buf = Buffer(be, sl->pre + n + kGuard);
  sl->t = sl->buf.tensor(d, s, sl->pre);
  std::vector<unsigned char> init(sl->buf.bytes(), kGuardByte);
  if (nan) std::fill(init.begin() + long(sl->pre), init.begin() + long(sl->pre + n), kNanByte);
  be.copy_from_host(sl->buf.data(), init.data(), init.size());
  slots_.push_back(std::move(sl));
  return *slots_.back();
}

void Io::upload(Slot& sl, const HostVec& v) {
  DTRAIN_CHECK(int64_t(v.size()) == sl.t.numel(), "parity row: {} values for {} {}", v.size(), sl.name,
               sl.t.shape.str());
  std::vector<unsigned char> b(sl.t.nbytes());
  for (size_t i = 0; i < v.size(); ++i) {
    switch (sl.t.dtype) {
      case DType::F32: std::memcpy(&b[i * 4], &v[i], 4); break;
      case DType::BF16: { const uint16_t h = f32_to_bf16(v[i]); std::memcpy(&b[i * 2], &h, 2); break; }
      case DType::F16: { const uint16_t h = f32_to_f16(v[i]); std::memcpy(&b[i * 2], &h, 2); break; }
      case DType::U8: b[i] = uint8_t(v[i]); break;
      case DType::I32: { const int32_t k = int32_t(v[i]); std::memcpy(&b[i * 4], &k, 4); break; }
      default: DTRAIN_CHECK(false, "parity row: dtype {}", dtype_name(sl.t.dtype));
    }
  }
  be.copy_from_host(sl.t.data, b.data(), b.size());
  sl.bytes = std::move(b);
}

Tensor Io::in(const std::string& name, Shape s, TType t, float lo, float hi, int64_t offset) {
  return in_vals(name, s, t, uniform(name, size_t(s.numel()), lo, hi), offset);
}

Tensor Io::in_vals(const std::string& name, Shape s, TType t, HostVec v, int64_t offset) {
  if (overrides_) {
    auto it = overrides_->find(name);
    if (it != overrides_->end()) v = it->second;
  }
  for (float& f : v) f = round(t, f);
  Slot& sl = alloc(name, s, storage(t), offset, false);
  sl.kind = Slot::In;
  sl.tt = t;
  upload(sl, v);
  host_[name] = std::move(v);
  return sl.t;
}

Tensor Io::ids(const std::string& name, Shape s, IntVec v) {
  Slot& sl = alloc(name, s, DType::I32, 0, false);
  sl.kind = Slot::In;
  sl.tt = fixed(DType::I32);
  DTRAIN_CHECK(int64_t(v.size()) == s.numel(), "parity row: {} ids for {}", v.size(), s.str());
  sl.bytes.resize(v.size() * 4);
  std::memcpy(sl.bytes.data(), v.data(), sl.bytes.size());
  be.copy_from_host(sl.t.data, v.data(), sl.bytes.size());
  host_ids_[name] = std::move(v);
  return sl.t;
}

Tensor& Io::out(const std::string& name, Shape s, TType t, Opts o) {
  Slot& sl = alloc(name, s, storage(t), o.offset, true);
  sl.kind = Slot::Output;
  sl.tt = t;
  sl.o = o;
  return sl.t;
}

Tensor& Io::inout(const std::string& name, Shape s, TType t, float lo, float hi, Opts o) {
  return inout_vals(name, s, t, uniform(name, size_t(s.numel()), lo, hi), o);
}

Tensor& Io::inout_vals(const std::string& name, Shape s, TType t, HostVec v, Opts o) {
  for (float& f : v) f = round(t, f);
  Slot& sl = alloc(name, s, storage(t), o.offset, false);
  sl.kind = Slot::Output;
  sl.tt = t;
  sl.o = o;
  upload(sl, v);
  host_[name] = std::move(v);
  return sl.t;
}

void Io::scalar(const std::string& name, double v, Opts o) { scalars_.emplace_back(name, o, v); }

void Io::derive(const std::string& name, Opts o, std::function<Vals(const Outs&)> f) {
  derived_.emplace_back(name, o, std::move(f));
}

Tensor& Io::temp(Shape s, TType t) {
  Slot& sl = alloc("", s, storage(t), 0, true);
  sl.kind = Slot::Temp;
  return sl.t;
}

const HostVec& Io::h(const std::string& name) const {
  auto it = host_.find(name);
  DTRAIN_CHECK(it != host_.end(), "parity row: no input named {}", name);
  return it->second;
}
const IntVec& Io::hi(const std::string& name) const {
  auto it = host_ids_.find(name);
  DTRAIN_CHECK(it != host_ids_.end(), "parity row: no ids named {}", name);
  return it->second;
}

std::vector<std::string> Io::output_names() const {
  std::vector<std::string> n;
  for (const auto& sl : slots_)
    if (sl->kind == Slot::Output) n.push_back(sl->name);
  return n;
}

Outs Io::collect(Report& r, const std::string& ctx) {
  be.synchronize();
  Outs outs;
  for (const auto& slp : slots_) {
    const Slot& sl = *slp;
    const std::string what = ctx + " " + (sl.name.empty() ? std::string("scratch") : sl.name) + " " + sl.t.str();
    std::vector<unsigned char> all(sl.buf.bytes());
    be.copy_to_host(all.data(), sl.buf.data(), all.size());
    const size_t n = sl.t.nbytes();
    size_t bad = 0;
    for (size_t i = 0; i < sl.pre; ++i) bad += all[i] != kGuardByte;
    for (size_t i = sl.pre + n; i < all.size(); ++i) bad += all[i] != kGuardByte;
    if (bad) r.fail(fmt::format("{}: {} guard bytes around it overwritten", what, bad));
    const unsigned char* p = all.data() + sl.pre;
    if (sl.kind == Slot::In) {
      if (std::memcmp(p, sl.bytes.data(), n) != 0) r.fail(what + ": an input was modified");
      continue;
    }
    if (sl.kind == Slot::Temp) continue;
    Vals v(size_t(sl.t.numel()));
    for (size_t i = 0; i < v.size(); ++i) {
      switch (sl.t.dtype) {
        case DType::F32: { float f; std::memcpy(&f, p + i * 4, 4); v[i] = f; break; }
        case DType::BF16: { uint16_t h; std::memcpy(&h, p + i * 2, 2); v[i] = bf16_to_f32(h); break; }
        case DType::F16: { uint16_t h; std::memcpy(&h, p + i * 2, 2); v[i] = f16_to_f32(h); break; }
        case DType::U8: v[i] = p[i]; break;
        case DType::I32: { int32_t k; std::memcpy(&k, p + i * 4, 4); v[i] = k; break; }
        default: break;
      }
    }
    outs[sl.name] = Out{std::move(v), sl.o, sl.tt};
  }
  for (const auto& [name, o, v] : scalars_) outs[name] = Out{{v}, o, kF32};
  for (const auto& [name, o, f] : derived_) outs[name] = Out{f(outs), o, kAct};
  for (const auto& [name, out] : outs) {
    size_t nonfinite = 0;
    bool zero = true;
    for (double x : out.v) nonfinite += !std::isfinite(x), zero = zero && x == 0;
    if (out.o.finite && nonfinite)
      r.fail(fmt::format("{} {}: {} of {} values not finite (unwritten elements stay NaN)", ctx, name, nonfinite,
                         out.v.size()));
    if (out.o.nonzero && zero) r.fail(fmt::format("{} {}: all zero", ctx, name));
  }
  return outs;
}

// ---------------------------------------------------------------- comparisons
namespace {

void compare(Report& r, const std::string& what, const Vals& got, const Vals& want, Check c) {
  r.compared++;
  if (got.size() != want.size()) {
    r.fail(fmt::format("{}: {} values, expected {}", what, got.size(), want.size()));
    return;
  }
  double se = 0, sw = 0, maxd = 0, maxw = 0, approx = 0;
  size_t worst = 0, differ = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(got[i] - want[i]);
    se += d * d, sw += want[i] * want[i];
    maxw = std::max(maxw, std::fabs(want[i]));
    const double a = d / (1 + std::max(std::fabs(got[i]), std::fabs(want[i])));
    if (d > maxd || (std::isnan(d) && !std::isnan(maxd))) maxd = d, worst = i;
    approx = std::max(approx, a);
    differ += std::memcmp(&got[i], &want[i], sizeof(double)) != 0;
  }
  double err = 0;
  switch (c.m) {
    case Metric::L2: err = std::sqrt(se) / std::max(std::sqrt(sw), 1e-30); break;
    case Metric::Max: err = maxd / std::max(maxw, 1e-12); break;
    case Metric::Approx: err = approx; break;
    case Metric::Abs: err = maxd; break;
    case Metric::Bits: err = double(differ); break;
  }
  static const char* names[] = {"L2", "max", "approx", "abs", "differing values"};
  if (!(err <= c.tol))
    r.fail(fmt::format("{}: {} error {:.3g} > {:.3g} (worst at {}: got {:.9g}, want {:.9g})", what, names[int(c.m)],
                       err, c.tol, worst, got.empty() ? 0.0 : got[worst], want.empty() ? 0.0 : want[worst]));
}

void compare_all(Report& r, const std::string& ctx, const Outs& got, const Outs& want, bool (*use)(const Opts&)) {
  for (const auto& [name, w] : want) {
    if (!use(w.o)) continue;
    auto it = got.find(name);
    if (it == got.end()) {
      r.fail(ctx + " " + name + ": missing in the second run");
      continue;
    }
    compare(r, ctx + " " + name, it->second.v, w.v, {Metric::Bits, 0});
  }
}

bool all_supported(const Row& row, const Backend& be, DType t, const Backend& cpu) {
  for (Op op : row.ops)  // an op the CPU never has (Conv2dCat) is composed by the row where missing
    if (cpu.supports(op, DType::F32) && !be.supports(op, t)) return false;
  return true;
}

struct ConvImplScope {  // runs a CPU row under one convolution implementation, restoring it after
  CpuBackend& cpu;
  cpu::ConvImpl saved;
  ConvImplScope(CpuBackend& c, cpu::ConvImpl i) : cpu(c), saved(c.conv_impl()) { cpu.set_conv_impl(i); }
  ~ConvImplScope() { cpu.set_conv_impl(saved); }
};

Outs run_row(const Row& row, Backend& be, DType t, bool act_f32, Report& r, const std::string& ctx,
             const Overrides* ov = nullptr, std::unique_ptr<Io>* keep = nullptr) {
  auto io = std::make_unique<Io>(be, t, act_f32, row.name, ov);
  if (row.setup) row.setup(be, true);
  row.run(*io);
  Outs o = io->collect(r, ctx);
  if (row.setup) row.setup(be, false);
  if (row.check) row.check(*io, o, r);
  if (keep) *keep = std::move(io);
  return o;
}

void gradient_check(const Row& row, CpuBackend& cpu, Report& r) {
  const Grad& g = *row.grad;
  const std::string ctx = "[" + row.name + "] gradient check";
  std::unique_ptr<Io> base;
  Outs o0 = run_row(row, cpu, DType::F32, true, r, ctx, nullptr, &base);
  const HostVec w = g.weight.empty() ? HostVec(o0.at(g.y).v.size(), 1.f) : base->h(g.weight);
  for (const auto& [xname, dxname] : g.wrt) {
    HostVec x = base->h(xname);
    const Vals& a = o0.at(dxname).v;
    HostVec analytic(a.begin(), a.end());
    Overrides ov;
    Report runs;
    auto loss = [&] {
      ov[xname] = x;
      const Outs o = run_row(row, cpu, DType::F32, true, runs, ctx, &ov);
      const Vals& y = o.at(g.y).v;
      double s = 0;
      for (size_t i = 0; i < y.size(); ++i) s += y[i] * double(w[i]);
      return s;
    };
    testing::GradCheckOptions opt = g.opt;
    if (g.skip) opt.skip = [&](int64_t i) { return g.skip(*base, xname, i); };
    const auto res = testing::check_gradient<float>(loss, x, analytic, opt);
    if (!runs.problems.empty()) r.fail(runs.problems.front());
    const std::string what = ctx + " d" + g.y + "/d" + xname + " (" + dxname + ")";
    if (!res.ok) r.fail(what + ": " + res.summary());
    if (g.bound_skips && res.skipped * 10 > res.checked) r.fail(what + ": too many skipped: " + res.summary());
    if (std::all_of(analytic.begin(), analytic.end(), [](float f) { return f == 0.f; }))
      r.fail(what + ": the analytic gradient is all zero");
    r.compared++;
  }
}

}  // namespace

// ---------------------------------------------------------------- stages
Report cpu_vs_reference(const Row& row) {
  Report r;
  if (!row.cpu) return r;
  CpuBackend cpu(2);
  std::vector<cpu::ConvImpl> impls{cpu.conv_impl()};
  if (row.conv_impls) impls = {cpu::ConvImpl::Dnnl, cpu::ConvImpl::Im2col};
  for (cpu::ConvImpl impl : impls) {
    ConvImplScope scope(cpu, impl);
    const std::string ctx = "[" + row.name + "] cpu" + (row.conv_impls ? impl == cpu::ConvImpl::Dnnl ? " dnnl" : " im2col" : "");
    std::unique_ptr<Io> io;
    const Outs got = run_row(row, cpu, DType::F32, true, r, ctx + " f32", nullptr, &io);
    if (row.ref) {
      Want want;
      row.ref(*io, want);
      if (want.empty()) r.fail(ctx + ": the reference gave no outputs");
      for (const auto& [name, w] : want) {
        auto it = got.find(name);
        if (it == got.end()) {
          r.fail(ctx + ": the reference names " + name + ", which the row did not make");
          continue;
        }
        compare(r, ctx + " vs reference: " + name, it->second.v, w, it->second.o.ref);
      }
    }
    const Outs again = run_row(row, cpu, DType::F32, true, r, ctx + " rerun");
    compare_all(r, ctx + " rerun", again, got, [](const Opts& o) { return o.rerun; });
    if (row.grad) gradient_check(row, cpu, r);
  }
  if (row.emul)
    for (DType t : {DType::BF16, DType::F16}) {
      if (std::find(row.dtypes.begin(), row.dtypes.end(), t) == row.dtypes.end() || !all_supported(row, cpu, t, cpu))
        continue;
      const std::string ctx = "[" + row.name + "] cpu " + describe(t);
      const Outs a = run_row(row, cpu, t, false, r, ctx + " emulated");
      const Outs b = run_row(row, cpu, t, true, r, ctx + " as f32");
      for (const auto& [name, ob] : b) {
        if (!ob.o.emul) continue;
        Vals want = ob.v;
        if (ob.t.act)
          for (double& x : want) x = round_to(t, float(x));
        compare(r, ctx + " emulation: " + name + " = the f32 result rounded", a.at(name).v, want, {Metric::Bits, 0});
      }
    }
  if (row.threads) {
    CpuBackend one(1);
    const std::string ctx = "[" + row.name + "] cpu";
    const Outs a = run_row(row, one, DType::F32, true, r, ctx + " 1 thread");
    const Outs b = run_row(row, cpu, DType::F32, true, r, ctx + " 2 threads");
    compare_all(r, ctx + " 1 thread vs 2 threads", a, b, [](const Opts& o) { return o.threads; });
    for (const auto& [name, w] : b)  // thread-split reductions: as close as to the reference
      if (!w.o.threads && a.count(name)) compare(r, ctx + " 1 thread vs 2 threads " + name, a.at(name).v, w.v, w.o.ref);
  }
  return r;
}

Report backend_vs_cpu(const Row& row, Backend& other, CpuBackend& cpu) {
  Report r;
  for (DType t : row.dtypes) {
    const DType ct = row.same_dtype ? t : DType::F32;
    if (!all_supported(row, other, t, cpu) || !all_supported(row, cpu, ct, cpu)) continue;
    const std::string ctx = "[" + row.name + "] " + describe(t);
    const Outs got = run_row(row, other, t, false, r, ctx + " " + other.name());
    const Outs want = run_row(row, cpu, t, !row.same_dtype, r, ctx + " cpu");
    for (const auto& [name, w] : want) {
      if (!w.o.cross) continue;
      auto it = got.find(name);
      if (it == got.end()) {
        r.fail(ctx + " " + name + ": not made on " + other.name());
        continue;
      }
      compare(r, ctx + " " + other.name() + " vs cpu: " + name, it->second.v, w.v, w.o.dev[dtype_index(t)]);
    }
    if (row.dev_rerun) {
      const Outs again = run_row(row, other, t, false, r, ctx + " " + other.name() + " rerun");
      compare_all(r, ctx + " " + other.name() + " rerun", again, got, [](const Opts& o) { return o.rerun; });
    }
  }
  return r;
}

// ---------------------------------------------------------------- the table
std::vector<Row>& rows() {
  static std::vector<Row> table;
  return table;
}
int add_rows(std::vector<Row> more) {
  for (Row& r : more) rows().push_back(std::move(r));
  return int(rows().size());
}
std::vector<std::string> families() {
  std::vector<std::string> f;
  for (const Row& r : rows())
    if (std::find(f.begin(), f.end(), r.family) == f.end()) f.push_back(r.family);
  return f;
}

}  // namespace dtrain::parity

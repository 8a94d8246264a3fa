#include "parallel/grad_compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "core/error.h"
#include "core/rng.h"
#include "parallel/grad_buckets.h"

namespace dtrain::parallel {

GradCompression parse_grad_compression(const std::string& s) {
  if (s == "none") return GradCompression::None;
  if (s == "bf16") return GradCompression::BF16;
  if (s == "fp16") return GradCompression::FP16;
  if (s == "powersgd") return GradCompression::PowerSGD;
  user_error("parallel.grad_compression = \"{}\": expected \"none\", \"bf16\", \"fp16\" or \"powersgd\"", s);
}

const char* grad_compression_name(GradCompression c) {
  switch (c) {
    case GradCompression::None: return "none";
    case GradCompression::BF16: return "bf16";
    case GradCompression::FP16: return "fp16";
    case GradCompression::PowerSGD: return "powersgd";
  }
  return "?";
}

PsgdMatrix plan_psgd_matrix(const ParamDesc& p, int id, int rank) {
  PsgdMatrix m;
  m.param = id;
  m.offset = p.offset;
  const int64_t n = p.shape.numel();
  m.rows = p.shape.ndim() > 0 ? p.shape[0] : 1;
  m.cols = m.rows > 0 ? n / m.rows : 0;
  const int64_t r = std::min<int64_t>({m.rows, m.cols, int64_t(rank)});
  m.rank = r > 0 && (m.rows + m.cols) * r * 2 < m.rows * m.cols ? int(r) : 0;
  return m;
}

void orthogonalize_columns(float* a, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < cols; ++i) {
    double sq = 0;
    for (int64_t k = 0; k < rows; ++k) sq += double(a[k * cols + i]) * double(a[k * cols + i]);
    const float norm = float(std::sqrt(sq));
    if (norm > 0)
      for (int64_t k = 0; k < rows; ++k) a[k * cols + i] /= norm;
    for (int64_t j = i + 1; j < cols; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < rows; ++k) dot += double(a[k * cols + i]) * double(a[k * cols + j]);
      for (int64_t k = 0; k < rows; ++k) a[k * cols + j] -= float(dot) * a[k * cols + i];
    }
  }
}

// Per bucket. 16-bit: the cast buffer. PowerSGD: the plan, packed uncompressed gradients,
// P and Q of every compressed matrix (packed in plan order), E over the compressed elements.
struct GradCompressor::State {
  Tensor grads;  // the bucket's slice (set by launch)
  Buffer half;
  std::vector<std::shared_ptr<comm::Work>> work;
  std::vector<PsgdMatrix> plan;
  int64_t n_plain = 0, n_p = 0, n_q = 0, n_err = 0;
  Buffer plain, p, q, err;
  bool q_ready = false;  // Q drawn (warm start after)
  bool psgd = false;     // this step's launch went through PowerSGD
  // matrix m's views: its slot of the uncompressed buffer (rank 0) or of E [rows, cols], P
  // [rows, r] and Q [cols, r] (offsets from the plan)
  Tensor packed_of(const PsgdMatrix& m) const {
    return (m.rank == 0 ? plain : err).tensor(DType::F32, Shape{m.rows, m.cols}, size_t(m.packed) * 4);
  }
  Tensor p_of(const PsgdMatrix& m) const { return p.tensor(DType::F32, Shape{m.rows, int64_t(m.rank)}, size_t(m.p_at) * 4); }
  Tensor q_of(const PsgdMatrix& m) const { return q.tensor(DType::F32, Shape{m.cols, int64_t(m.rank)}, size_t(m.q_at) * 4); }
};

namespace {

Buffer make_buffer(Backend& be, DType t, int64_t n) { return n > 0 ? Buffer(be, size_t(n) * dtype_size(t)) : Buffer(); }

Tensor part(const Tensor& flat, int64_t offset, Shape s) {
  return Tensor(static_cast<float*>(flat.data) + offset, DType::F32, flat.device, s);
}

}  // namespace

GradCompressor::GradCompressor(comm::Communicator& comm, ParamStore& ps, const std::vector<Bucket>& buckets,
                               const CompressionOptions& o)
    : comm_(comm), ps_(ps), opts_(o) {
  DTRAIN_CHECK(o.kind != GradCompression::None, "GradCompressor: no compression");
  DTRAIN_CHECK(o.powersgd_rank >= 1, "GradCompressor: PowerSGD rank {}", o.powersgd_rank);
  Backend& be = ps.backend();
  for (const Bucket& b : buckets) {
    auto s = std::make_unique<State>();
    const int64_t n = b.end - b.begin;
    if (o.kind == GradCompression::BF16 || o.kind == GradCompression::FP16) {
      s->half = make_buffer(be, DType::BF16, n);
    } else {
      // in flat-buffer order (ascending offsets), so every rank packs alike
      std::vector<int> ids(b.params.rbegin(), b.params.rend());
      std::sort(ids.begin(), ids.end(), [&](int x, int y) { return ps.params()[size_t(x)].offset < ps.params()[size_t(y)].offset; });
      for (int id : ids) {
        PsgdMatrix m = plan_psgd_matrix(ps.params()[size_t(id)], id, o.powersgd_rank);
        m.packed = m.rank == 0 ? s->n_plain : s->n_err;
        m.p_at = s->n_p;
        m.q_at = s->n_q;
        if (m.rank == 0) s->n_plain += m.rows * m.cols;
        else {
          s->n_p += m.rows * m.rank;
          s->n_q += m.cols * m.rank;
          s->n_err += m.rows * m.cols;
        }
        s->plan.push_back(m);
      }
      s->plain = make_buffer(be, DType::F32, s->n_plain);
      s->p = make_buffer(be, DType::F32, s->n_p);
      s->q = make_buffer(be, DType::F32, s->n_q);
      s->err = make_buffer(be, DType::F32, s->n_err);
    }
    st_.push_back(std::move(s));
  }
}

GradCompressor::~GradCompressor() = default;

const std::vector<PsgdMatrix>& GradCompressor::psgd_plan(size_t b) const { return st_.at(b)->plan; }

static std::vector<float> host_copy(Backend& be, const Buffer& buf, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  if (n > 0) be.copy_to_host(out.data(), buf.data(), size_t(n) * 4);
  return out;
}

std::vector<float> GradCompressor::psgd_error(size_t b) const { return host_copy(ps_.backend(), st_.at(b)->err, st_.at(b)->n_err); }
std::vector<float> GradCompressor::psgd_q(size_t b) const { return host_copy(ps_.backend(), st_.at(b)->q, st_.at(b)->n_q); }

std::vector<ParamStore::Exported> GradCompressor::export_state() const {
  std::vector<ParamStore::Exported> out;
  Backend& be = ps_.backend();
  auto put = [&](const std::string& name, const Buffer& buf, int64_t n) {
    const std::vector<float> v = host_copy(be, buf, n);
    ParamStore::Exported x{name, "F32", {n}, std::vector<uint8_t>(v.size() * 4)};
    std::memcpy(x.bytes.data(), v.data(), x.bytes.size());
    out.push_back(std::move(x));
  };
  for (size_t b = 0; b < st_.size(); ++b) {
    const State& s = *st_[b];
    if (!s.q_ready) continue;
    put(fmt::format("powersgd.bucket_{}.error", b), s.err, s.n_err);
    put(fmt::format("powersgd.bucket_{}.q", b), s.q, s.n_q);
  }
  return out;
}

bool GradCompressor::import_state(const TensorLookup& lookup) {
  struct Found {
    std::optional<ImportTensor> err, q;
  };
  std::vector<Found> found(st_.size());
  for (size_t b = 0; b < st_.size(); ++b) {
    const State& s = *st_[b];
    found[b].err = lookup(fmt::format("powersgd.bucket_{}.error", b));
    found[b].q = lookup(fmt::format("powersgd.bucket_{}.q", b));
    if (found[b].err.has_value() != found[b].q.has_value()) return false;
    if (!found[b].err) continue;
    auto fits = [](const ImportTensor& t, int64_t n) {
      return t.dtype == "F32" && t.shape == std::vector<int64_t>{n} && t.nbytes == size_t(n) * 4 && (n == 0 || t.data);
    };
    if (s.n_q == 0 || !fits(*found[b].err, s.n_err) || !fits(*found[b].q, s.n_q)) return false;
  }
  Backend& be = ps_.backend();
  for (size_t b = 0; b < st_.size(); ++b) {
    if (!found[b].err) continue;
    State& s = *st_[b];
    be.copy_from_host(s.err.data(), found[b].err->data, found[b].err->nbytes);
    be.copy_from_host(s.q.data(), found[b].q->data, found[b].q->nbytes);
    s.q_ready = true;
  }
  return true;
}

void GradCompressor::launch(size_t b, Tensor grads) {
  State& s = *st_.at(b);
  s.grads = grads;
  s.work.clear();
  s.psgd = false;
  Backend& be = ps_.backend();
  if (opts_.kind == GradCompression::PowerSGD) {
    if (powersgd_active()) return launch_powersgd(b, grads);
    s.work.push_back(comm_.allreduce_async(grads, comm::ReduceOp::Avg));  // warm-up: as "none"
    return;
  }
  const DType dt = opts_.kind == GradCompression::BF16 ? DType::BF16 : DType::F16;
  if (grads.numel() == 0) return;
  Tensor h = s.half.tensor(dt, grads.shape);
  be.cast(grads, h);
  s.work.push_back(comm_.allreduce_async(h, comm::ReduceOp::Avg));
}

uint64_t GradCompressor::complete(size_t b) {
  State& s = *st_.at(b);
  if (s.psgd) return complete_powersgd(b);
  uint64_t bytes = 0;
  for (auto& w : s.work) {
    w->wait();
    bytes += w->bytes_sent();
  }
  if (opts_.kind != GradCompression::PowerSGD && s.grads.numel() > 0) {
    Backend& be = ps_.backend();
    Tensor h = s.half.tensor(opts_.kind == GradCompression::BF16 ? DType::BF16 : DType::F16, s.grads.shape);
    be.cast(h, s.grads);
  }
  s.work.clear();
  return bytes;
}

void GradCompressor::launch_powersgd(size_t b, Tensor grads) {
  State& s = *st_.at(b);
  Backend& be = ps_.backend();
  s.psgd = true;
  const Tensor flat = ps_.flat_grads();
  // Q's first draw: normal, seeded alike on every rank, orthogonalized
  if (!s.q_ready && s.n_q > 0) {
    std::vector<float> q(size_t(s.n_q));
    for (const PsgdMatrix& m : s.plan) {
      if (m.rank == 0) continue;
      Rng rng(opts_.seed, stream_id(0x9577d, b, uint64_t(m.param)));
      for (int64_t i = 0; i < m.cols * m.rank; ++i) q[size_t(m.q_at + i)] = rng.normal();
      orthogonalize_columns(q.data() + m.q_at, m.cols, m.rank);
    }
    be.copy_from_host(s.q.data(), q.data(), q.size() * 4);
    Tensor e = s.err.tensor(DType::F32, Shape{s.n_err});
    be.fill(e, 0.f);
    s.q_ready = true;
  }
  for (const PsgdMatrix& m : s.plan) {
    Tensor g = part(flat, m.offset, Shape{m.rows, m.cols});
    if (m.rank == 0) {
      Tensor dst = s.packed_of(m);
      be.copy(g, dst);
      continue;
    }
    Tensor e = s.packed_of(m), p = s.p_of(m);
    be.add(g, e, g);                       // M += E
    be.copy(g, e);                         // E holds M until complete() subtracts P Q^T
    be.gemm(false, false, 1.f, g, s.q_of(m), 0.f, p);  // P = M Q
  }
  DTRAIN_CHECK(grads.numel() == s.n_plain + s.n_err, "PowerSGD: bucket {} plan covers {} of {} elements", b,
               s.n_plain + s.n_err, grads.numel());
  if (s.n_plain > 0) {
    Tensor t = s.plain.tensor(DType::F32, Shape{s.n_plain});
    s.work.push_back(comm_.allreduce_async(t, comm::ReduceOp::Avg));
  }
  if (s.n_p > 0) {
    Tensor t = s.p.tensor(DType::F32, Shape{s.n_p});
    s.work.push_back(comm_.allreduce_async(t, comm::ReduceOp::Sum));
  }
}

uint64_t GradCompressor::complete_powersgd(size_t b) {
  State& s = *st_.at(b);
  Backend& be = ps_.backend();
  const Tensor flat = ps_.flat_grads();
  uint64_t bytes = 0;
  for (auto& w : s.work) {
    w->wait();
    bytes += w->bytes_sent();
  }
  s.work.clear();
  if (s.n_p > 0) {  // orthogonalize each P on the host (P is [rows, r], small)
    std::vector<float> p = host_copy(be, s.p, s.n_p);
    for (const PsgdMatrix& m : s.plan)
      if (m.rank > 0) orthogonalize_columns(p.data() + m.p_at, m.rows, m.rank);
    be.copy_from_host(s.p.data(), p.data(), p.size() * 4);
  }
  for (const PsgdMatrix& m : s.plan) {  // Q = M^T P
    if (m.rank == 0) continue;
    Tensor q = s.q_of(m);
    be.gemm(true, false, 1.f, part(flat, m.offset, Shape{m.rows, m.cols}), s.p_of(m), 0.f, q);
  }
  if (s.n_q > 0) {
    Tensor t = s.q.tensor(DType::F32, Shape{s.n_q});
    auto w = comm_.allreduce_async(t, comm::ReduceOp::Sum);
    w->wait();
    bytes += w->bytes_sent();
    be.scale(t, 1.f / float(comm_.size()));
  }
  for (const PsgdMatrix& m : s.plan) {
    Tensor g = part(flat, m.offset, Shape{m.rows, m.cols});
    if (m.rank == 0) {  // the averaged uncompressed gradients back in place
      be.copy(s.packed_of(m), g);
      continue;
    }
    Tensor e = s.packed_of(m);
    be.gemm(false, true, 1.f, s.p_of(m), s.q_of(m), 0.f, g);  // M = P Q^T
    be.axpby(-1.f, g, 1.f, e);                                // E = M (with error) - P Q^T
  }
  return bytes;
}

}  // namespace dtrain::parallel

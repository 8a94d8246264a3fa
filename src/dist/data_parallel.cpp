#include "dist/data_parallel.h"

#include <chrono>
#include <cstring>

#include "core/clock.h"
#include "core/error.h"
#include "core/sha256.h"

namespace dtrain::dist {
namespace {


}  // namespace

std::vector<Bucket> plan_buckets(const std::vector<ParamDesc>& params, double first_bucket_mb,
                                 double bucket_mb) {
  if (bucket_mb <= 0) user_error("data_parallel.bucket_mb = {}: expected a positive size", bucket_mb);
  if (first_bucket_mb <= 0) first_bucket_mb = bucket_mb;
  std::vector<Bucket> out;
  Bucket cur;
  int64_t cap = int64_t(first_bucket_mb * 1024 * 1024 / sizeof(float));
  for (size_t k = params.size(); k-- > 0;) {
    const ParamDesc& p = params[k];
    int64_t n = p.shape.numel();
    if (cur.params.empty()) cur.begin = cur.end = p.offset + n;
    DTRAIN_CHECK(p.offset + n == cur.begin, "param '{}' is not contiguous with the next one", p.name);
    cur.begin = p.offset;
    cur.params.push_back(int(k));
    if (cur.end - cur.begin >= cap) {
      out.push_back(std::move(cur));
      cur = Bucket{};
      cap = int64_t(bucket_mb * 1024 * 1024 / sizeof(float));
    }
  }
  if (!cur.params.empty()) out.push_back(std::move(cur));
  return out;
}

GradBuckets::GradBuckets(Communicator& comm, ParamStore& ps, double bucket_mb, double first_bucket_mb)
    : comm_(comm), ps_(ps) {
  DTRAIN_CHECK(ps.finalized(), "GradBuckets needs a finalized ParamStore");
  buckets_ = plan_buckets(ps.params(), first_bucket_mb, bucket_mb);
  bucket_of_.assign(ps.params().size(), -1);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (int id : buckets_[b].params) bucket_of_[size_t(id)] = int(b);
  begin_step(true);
}

void GradBuckets::begin_step(bool sync) {
  sync_ = sync;
  param_ready_.assign(ps_.params().size(), 0);
  pending_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) pending_[b] = int(buckets_[b].params.size());
  work_.assign(buckets_.size(), nullptr);
}

void GradBuckets::launch(size_t b) {
  Tensor g = ps_.flat_grads();
  Tensor part(static_cast<float*>(g.data) + buckets_[b].begin, DType::F32, g.device,
              Shape{buckets_[b].end - buckets_[b].begin});
  // Gloo reads host memory directly: make sure the backend finished writing the grads.
  if (g.device.is_cpu()) ps_.backend().synchronize();
  work_[b] = comm_.allreduce_async(part, ReduceOp::Avg);
}

void GradBuckets::on_grad_ready(int param_id) {
  if (!sync_) return;
  DTRAIN_CHECK(param_id >= 0 && size_t(param_id) < bucket_of_.size(), "grad_ready for param id {}", param_id);
  if (param_ready_[size_t(param_id)]) return;  // reported twice (e.g. a tied weight)
  param_ready_[size_t(param_id)] = 1;
  size_t b = size_t(bucket_of_[size_t(param_id)]);
  if (--pending_[b] == 0) launch(b);
}

int GradBuckets::launched() const {
  int n = 0;
  for (auto& w : work_) n += w != nullptr;
  return n;
}

double GradBuckets::finish() {
  // Launch in bucket order so every rank submits the same sequence even if some params
  // got no gradient (their bucket launches here, identically on every rank).
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (!work_[b]) launch(b);
  auto t0 = Clock::now();
  for (auto& w : work_) w->wait();
  double waited = seconds_since(t0);
  begin_step(true);
  return waited;
}

std::array<uint8_t, 32> params_digest(ParamStore& ps) {
  Sha256 h;
  std::vector<uint8_t> host;
  for (const Tensor& t : {ps.flat_params(), ps.flat_buffers()}) {
    host.resize(t.nbytes());
    if (!host.empty()) ps.backend().copy_to_host(host.data(), t.data, host.size());
    h.update(host.data(), host.size());
  }
  return h.digest();
}

void sync_params(Communicator& comm, ParamStore& ps) {
  Tensor p = ps.flat_params(), b = ps.flat_buffers();
  if (p.numel()) comm.broadcast(p, 0);
  if (b.numel()) comm.broadcast(b, 0);
  verify_params(comm, ps);
}

void verify_params(Communicator& comm, ParamStore& ps) {
  Tensor p = ps.flat_params();
  // Digest as 16 floats holding 16-bit halves (exact in f32, safe through any transport).
  auto d = params_digest(ps);
  const int W = comm.size();
  std::vector<float> mine(16), all(size_t(16 * W));
  for (int i = 0; i < 16; ++i) mine[size_t(i)] = float(d[size_t(2 * i)] | (d[size_t(2 * i + 1)] << 8));
  Buffer dev_mine, dev_all;
  Tensor tm, ta;
  Backend& be = ps.backend();
  if (p.device.is_cpu()) {
    tm = Tensor(mine.data(), DType::F32, p.device, Shape{16});
    ta = Tensor(all.data(), DType::F32, p.device, Shape{int64_t(16 * W)});
  } else {
    dev_mine = Buffer(be, 16 * sizeof(float));
    dev_all = Buffer(be, all.size() * sizeof(float));
    tm = dev_mine.tensor(DType::F32, Shape{16});
    ta = dev_all.tensor(DType::F32, Shape{int64_t(16 * W)});
    be.copy_from_host(tm.data, mine.data(), 16 * sizeof(float));
  }
  comm.allgather(tm, ta);
  if (!p.device.is_cpu()) be.copy_to_host(all.data(), ta.data, all.size() * sizeof(float));
  std::string bad;
  for (int r = 1; r < W; ++r)
    if (std::memcmp(all.data() + 16 * r, all.data(), 16 * sizeof(float)) != 0)
      bad += (bad.empty() ? "" : ", ") + std::to_string(r);
  if (!bad.empty())
    fault("parameter check: rank(s) {} hold parameters/buffers that differ from rank 0 "
          "(SHA-256 of the flat buffers, checked on rank {})", bad, comm.rank());
}

FlatRange shard_range(int64_t total, int rank, int world) {
  DTRAIN_CHECK(world >= 1 && rank >= 0 && rank < world && total >= 0, "shard_range({}, {}, {})", total,
               rank, world);
  int64_t s = (total + world - 1) / world;
  return FlatRange{std::min(total, rank * s), std::min(total, (rank + 1) * s)};
}

ZeroSharder::ZeroSharder(Communicator& comm, ParamStore& ps) : comm_(comm), ps_(ps) {
  DTRAIN_CHECK(ps.finalized(), "ZeroSharder needs a finalized ParamStore");
  int64_t total = ps.num_params();
  int W = comm.size();
  shard_ = (total + W - 1) / W;
  range_ = shard_range(total, comm.rank(), W);
  padded_ = Buffer(ps.backend(), size_t(shard_ * W) * sizeof(float));
  shard_buf_ = Buffer(ps.backend(), size_t(shard_) * sizeof(float));
  if (shard_ * W) {
    Tensor t = padded_.tensor(DType::F32, Shape{shard_ * W});
    ps.backend().fill(t, 0.f);  // the tail past `total` stays zero
  }
}

double ZeroSharder::reduce_scatter_grads() {
  auto t0 = Clock::now();
  const int W = comm_.size();
  if (shard_ == 0) return 0;
  Backend& be = ps_.backend();
  Tensor g = ps_.flat_grads();
  be.copy_device(padded_.data(), g.data, g.nbytes());
  Tensor in = padded_.tensor(DType::F32, Shape{shard_ * W});
  Tensor out = shard_buf_.tensor(DType::F32, Shape{shard_});
  if (g.device.is_cpu()) be.synchronize();
  comm_.reduce_scatter(in, out, ReduceOp::Avg);
  int64_t n = range_.end - range_.begin;
  if (n > 0) be.copy_device(static_cast<float*>(g.data) + range_.begin, out.data, size_t(n) * sizeof(float));
  return seconds_since(t0);
}

double ZeroSharder::allgather_params() {
  auto t0 = Clock::now();
  const int W = comm_.size();
  if (shard_ == 0) return 0;
  Backend& be = ps_.backend();
  Tensor p = ps_.flat_params();
  int64_t n = range_.end - range_.begin;
  Tensor shard = shard_buf_.tensor(DType::F32, Shape{shard_});
  if (n > 0) be.copy_device(shard.data, static_cast<float*>(p.data) + range_.begin, size_t(n) * sizeof(float));
  Tensor out = padded_.tensor(DType::F32, Shape{shard_ * W});
  if (p.device.is_cpu()) be.synchronize();
  comm_.allgather(shard, out);
  be.copy_device(p.data, out.data, p.nbytes());
  return seconds_since(t0);
}

}  // namespace dtrain::dist

#include "parallel/zero.h"

#include <algorithm>

#include "core/clock.h"
#include "core/error.h"

namespace dtrain::parallel {

FlatRange shard_range(int64_t total, int rank, int world) {
  DTRAIN_CHECK(world >= 1 && rank >= 0 && rank < world && total >= 0, "shard_range({}, {}, {})", total,
               rank, world);
  int64_t s = (total + world - 1) / world;
  return FlatRange{std::min(total, rank * s), std::min(total, (rank + 1) * s)};
}

ZeroSharder::ZeroSharder(comm::Communicator& comm, ParamStore& ps, int stage)
    : comm_(comm), ps_(ps), stage_(stage) {
  DTRAIN_CHECK(ps.finalized(), "ZeroSharder needs a finalized ParamStore");
  DTRAIN_CHECK(stage == 1 || stage == 2, "ZeroSharder: stage {} (expected 1 or 2)", stage);
  const int64_t total = ps.num_params();
  const int W = comm.size();
  shard_ = (total + W - 1) / W;
  range_ = shard_range(total, comm.rank(), W);
  padded_ = Buffer(ps.backend(), size_t(shard_ * W) * sizeof(float));
  shard_buf_ = Buffer(ps.backend(), size_t(shard_) * sizeof(float));
  norm_buf_ = Buffer(ps.backend(), sizeof(float));
  if (shard_ > 0) {
    Tensor t = padded_.tensor(DType::F32, Shape{shard_ * W});
    ps.backend().fill(t, 0.f);  // the tail past `total` stays zero
  }
}

Tensor ZeroSharder::reduced_grads() const {
  Tensor g = ps_.flat_grads();
  return stage_ == 2 ? g.slice0(range_.begin, range_.end) : g;
}

double ZeroSharder::reduce_grads() {
  if (stage_ != 2 || shard_ == 0) return 0;
  auto t0 = Clock::now();
  const int W = comm_.size();
  Backend& be = ps_.backend();
  Tensor g = ps_.flat_grads();
  be.copy_device(padded_.data(), g.data, g.nbytes());
  Tensor in = padded_.tensor(DType::F32, Shape{shard_ * W});
  Tensor out = shard_buf_.tensor(DType::F32, Shape{shard_});
  comm_.reduce_scatter(in, out, comm::ReduceOp::Avg);
  const int64_t n = range_.end - range_.begin;
  if (n > 0) be.copy_device(static_cast<float*>(g.data) + range_.begin, out.data, size_t(n) * sizeof(float));
  return seconds_since(t0);
}

double ZeroSharder::grad_sq_norm(double scale) {
  Backend& be = ps_.backend();
  const Tensor g = reduced_grads();
  double sq = g.numel() ? be.sum_squares(g) : 0.0;
  sq *= scale * scale;
  if (stage_ != 2) return sq;
  return sum_over_group(comm_, be, norm_buf_, sq);  // the shards' squares summed over the group
}

double sum_over_group(comm::Communicator& comm, Backend& be, const Buffer& scratch, double x) {
  float v = float(x);
  be.copy_from_host(scratch.data(), &v, sizeof v);
  Tensor t = scratch.tensor(DType::F32, Shape{1});
  comm.allreduce(t, comm::ReduceOp::Sum);
  be.copy_to_host(&v, scratch.data(), sizeof v);
  return double(v);
}

double ZeroSharder::allgather_params() {
  if (shard_ == 0) return 0;
  auto t0 = Clock::now();
  const int W = comm_.size();
  Backend& be = ps_.backend();
  Tensor p = ps_.flat_params();
  const int64_t n = range_.end - range_.begin;
  Tensor shard = shard_buf_.tensor(DType::F32, Shape{shard_});
  if (n > 0) be.copy_device(shard.data, static_cast<float*>(p.data) + range_.begin, size_t(n) * sizeof(float));
  Tensor out = padded_.tensor(DType::F32, Shape{shard_ * W});
  comm_.allgather(shard, out);
  be.copy_device(p.data, out.data, p.nbytes());
  return seconds_since(t0);
}

}  // namespace dtrain::parallel

#include "parallel/data_parallel.h"

#include <algorithm>
#include <cmath>

#include "core/clock.h"
#include "core/error.h"
#include "parallel/param_sync.h"

namespace dtrain::parallel {

double full_grad_norm(Backend& be, const Tensor& grads, double scale) {
  return std::sqrt(be.sum_squares(grads)) * std::fabs(scale);
}

DataParallel::DataParallel(comm::Communicator& comm, ParamStore& ps, const DataParallelOptions& o)
    : comm_(comm), ps_(ps), opts_(o) {
  DTRAIN_CHECK(o.zero_stage >= 0 && o.zero_stage <= 2, "DataParallel: zero stage {}", o.zero_stage);
  sync_params(comm, ps);
  if (o.zero_stage < 2)
    buckets_ = std::make_unique<GradBuckets>(comm, ps, o.bucket_mb, std::min(1.0, o.bucket_mb));
  if (o.zero_stage > 0) zero_ = std::make_unique<ZeroSharder>(comm, ps, o.zero_stage);
  flags_ = Buffer(ps.backend(), 4 * sizeof(float));
}

FlatRange DataParallel::optimizer_range() const { return zero_ ? zero_->range() : FlatRange{}; }

void DataParallel::begin_micro(bool last) {
  if (buckets_) buckets_->begin_step(last);
}

std::function<void(int)> DataParallel::grad_hook() {
  if (!buckets_) return {};
  return buckets_->hook();
}

std::function<void(Tensor&)> DataParallel::sync_sum() {
  if (!opts_.sync_bn) return {};
  return [this](Tensor& t) { comm_.allreduce(t, comm::ReduceOp::Sum); };
}

double DataParallel::reduce_grads() {
  double waited = 0;
  if (buckets_) waited += buckets_->finish();
  if (zero_) waited += zero_->reduce_grads();
  return waited;
}

Tensor DataParallel::reduced_grads() const { return zero_ ? zero_->reduced_grads() : ps_.flat_grads(); }

double DataParallel::grad_norm(double scale) {
  if (zero_ && zero_->stage() == 2) return std::sqrt(zero_->grad_sq_norm(scale));
  return full_grad_norm(ps_.backend(), ps_.flat_grads(), scale);
}

StepFlags DataParallel::agree(const StepFlags& mine) {
  Backend& be = ps_.backend();
  float v[4] = {float(mine.loss_sum), float(mine.samples), mine.stop ? 1.f : 0.f, mine.nonfinite ? 1.f : 0.f};
  be.copy_from_host(flags_.data(), v, sizeof v);
  Tensor t = flags_.tensor(DType::F32, Shape{4});
  comm_.allreduce(t, comm::ReduceOp::Sum);
  be.copy_to_host(v, flags_.data(), sizeof v);
  return StepFlags{v[0], v[1], v[2] > 0, v[3] > 0};
}

double DataParallel::gather_params() { return zero_ ? zero_->allgather_params() : 0.0; }

}  // namespace dtrain::parallel

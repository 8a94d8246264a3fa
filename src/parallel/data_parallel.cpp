#include "parallel/data_parallel.h"

#include <algorithm>
#include <cmath>

#include "core/clock.h"
#include "comm/mesh.h"
#include "core/error.h"
#include "parallel/param_sync.h"

namespace dtrain::parallel {

double full_grad_norm(Backend& be, const Tensor& grads, double scale) {
  return std::sqrt(be.sum_squares(grads)) * std::fabs(scale);
}

DataParallel::DataParallel(comm::Communicator& comm, ParamStore& ps, const DataParallelOptions& o)
    : comm_(comm), ps_(ps), opts_(o) {
  DTRAIN_CHECK(o.zero_stage >= 0 && o.zero_stage <= 3, "DataParallel: zero stage {}", o.zero_stage);
  DTRAIN_CHECK(o.compression.kind == GradCompression::None || o.zero_stage != 3,
               "DataParallel: gradient compression needs zero stage 0 or 1");
  flags_ = Buffer(ps.backend(), 4 * sizeof(float));
  if (o.zero_stage == 3) {
    // every rank initialised (or loaded) the same full state and kept its own pieces
    const int S = o.shard_group_size;
    if (S > 0 && S < comm.size()) {  // hybrid: every rank takes part in both splits, in this order
      const comm::DeviceMesh mesh(1, comm.size(), 1);
      shard_ = comm.split("dp_shard", mesh.shard_group(comm.rank(), S));
      replicate_ = comm.split("dp_replicate", mesh.replicate_group(comm.rank(), S));
      zero3_ = std::make_unique<Zero3>(*shard_, ps, replicate_.get(), o.reduce_dtype);
    } else {
      zero3_ = std::make_unique<Zero3>(comm, ps, nullptr, o.reduce_dtype);
    }
    return;
  }
  DTRAIN_CHECK(o.reduce_dtype == DType::F32, "DataParallel: reduce dtype {} needs zero stage 3",
               dtype_name(o.reduce_dtype));
  DTRAIN_CHECK(o.compression.kind == GradCompression::None || o.zero_stage < 2,
               "DataParallel: gradient compression {} needs zero stage 0 or 1",
               grad_compression_name(o.compression.kind));
  sync_params(comm, ps);
  if (o.zero_stage < 2)
    buckets_ = std::make_unique<GradBuckets>(comm, ps, o.bucket_mb, std::min(1.0, o.bucket_mb), o.compression);
  if (o.zero_stage > 0) zero_ = std::make_unique<ZeroSharder>(comm, ps, o.zero_stage);
}

FlatRange DataParallel::optimizer_range() const { return zero_ ? zero_->range() : FlatRange{}; }

void DataParallel::begin_micro(bool last) {
  if (buckets_) buckets_->begin_step(last);
  if (zero3_) zero3_->begin_pass(true);
}

void DataParallel::expect_reduction() {
  if (!zero3_ && buckets_) buckets_->begin_step(true);
}

bool DataParallel::scatters_grads() const { return zero_ && zero_->stage() == 2; }

double DataParallel::end_micro() { return zero3_ ? zero3_->end_pass() : 0.0; }

UnitHooks* DataParallel::unit_hooks() {
  // A store of root units alone (LoRA's adapters, nn/lora.h) is gathered for the whole pass by
  // begin_pass; the model's units are another store's (the frozen one), so no per-unit hooks.
  if (zero3_) {
    const auto& u = ps_.units();
    if (std::all_of(u.begin(), u.end(), [](const UnitDesc& d) { return d.root; })) return nullptr;
  }
  return zero3_.get();
}

void DataParallel::begin_eval() {
  if (zero3_) zero3_->begin_pass(false);
}

void DataParallel::end_eval() {
  if (zero3_) zero3_->end_pass();
}

std::vector<float> DataParallel::gather_full_params() {
  return zero3_ ? zero3_->gather_full() : std::vector<float>{};
}

std::function<void(int)> DataParallel::grad_hook() {
  if (!buckets_) return {};
  return buckets_->hook();
}

std::function<void(Tensor&)> DataParallel::sync_sum() {
  if (!opts_.sync_bn) return {};
  return [this](Tensor& t) { comm_.allreduce(t, comm::ReduceOp::Sum); };
}

void DataParallel::set_step(int64_t step) {
  if (buckets_) buckets_->set_step(step);
}

double DataParallel::reduce_grads() {
  double waited = 0;
  grad_bytes_ = 0;
  if (buckets_) {
    waited += buckets_->finish();
    grad_bytes_ += buckets_->last_bytes();
  }
  if (zero_) {
    const uint64_t before = comm_.bytes_sent().reduce_scatter;
    waited += zero_->reduce_grads();
    grad_bytes_ += comm_.bytes_sent().reduce_scatter - before;  // ZeRO-2's (zero 1: none)
  }
  return waited;
}

Tensor DataParallel::reduced_grads() const {
  if (zero3_) return ps_.shard_grads();
  return zero_ ? zero_->reduced_grads() : ps_.flat_grads();
}

double DataParallel::grad_norm(double scale) {
  if (zero3_) return std::sqrt(zero3_->grad_sq_norm(scale));
  if (zero_ && zero_->stage() == 2) return std::sqrt(zero_->grad_sq_norm(scale));
  return full_grad_norm(ps_.backend(), ps_.flat_grads(), scale);
}

ShardedGrads DataParallel::sharded_grads() {
  if (zero3_) return ShardedGrads{ps_.shard_pieces(), ps_.shard_grads(), &state_comm()};
  if (zero_ && zero_->stage() == 2) {
    const FlatRange r = zero_->range();
    return ShardedGrads{{FlatPiece{r.begin, r.begin, r.end - r.begin}}, ps_.flat_grads(), &comm_};
  }
  return {};
}

std::vector<ParamStore::Exported> DataParallel::compression_state() const {
  const GradCompressor* c = buckets_ ? buckets_->compressor() : nullptr;
  if (!c || c->options().kind != GradCompression::PowerSGD) return {};
  return c->export_state();
}

bool DataParallel::load_compression_state(const TensorLookup& lookup) {
  GradCompressor* c = buckets_ ? buckets_->compressor() : nullptr;
  return c && c->options().kind == GradCompression::PowerSGD && c->import_state(lookup);
}

comm::Communicator& DataParallel::state_comm() { return shard_ ? *shard_ : comm_; }

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

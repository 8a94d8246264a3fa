#include "parallel/grad_buckets.h"

#include <chrono>

#include "core/clock.h"
#include "core/error.h"

namespace dtrain::parallel {
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

GradBuckets::GradBuckets(comm::Communicator& comm, ParamStore& ps, double bucket_mb, double first_bucket_mb,
                         const CompressionOptions& comp)
    : comm_(comm), ps_(ps) {
  DTRAIN_CHECK(ps.finalized(), "GradBuckets needs a finalized ParamStore");
  buckets_ = plan_buckets(ps.params(), first_bucket_mb, bucket_mb);
  bucket_of_.assign(ps.params().size(), -1);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (int id : buckets_[b].params) bucket_of_[size_t(id)] = int(b);
  if (comp.kind != GradCompression::None) comp_ = std::make_unique<GradCompressor>(comm, ps, buckets_, comp);
  begin_step(true);
}

GradBuckets::~GradBuckets() = default;

void GradBuckets::set_step(int64_t step) {
  step_ = step;
  if (comp_) comp_->begin_step(step);
}

void GradBuckets::begin_step(bool sync) {
  sync_ = sync;
  param_ready_.assign(ps_.params().size(), 0);
  pending_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) pending_[b] = int(buckets_[b].params.size());
  work_.assign(buckets_.size(), nullptr);
  launched_.assign(buckets_.size(), 0);
}

void GradBuckets::launch(size_t b) {
  Tensor g = ps_.flat_grads();
  Tensor part(static_cast<float*>(g.data) + buckets_[b].begin, DType::F32, g.device,
              Shape{buckets_[b].end - buckets_[b].begin});
  // the communicator orders the all-reduce after the backward's kernels that wrote `part`
  launched_[b] = 1;
  if (comp_) return comp_->launch(b, part);
  work_[b] = comm_.allreduce_async(part, comm::ReduceOp::Avg);
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
  for (char l : launched_) n += l != 0;
  return n;
}

double GradBuckets::finish() {
  // Launch in bucket order so every rank submits the same sequence even if some params
  // got no gradient (their bucket launches here, identically on every rank).
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (!launched_[b]) launch(b);
  auto t0 = Clock::now();
  uint64_t bytes = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (comp_) {
      bytes += comp_->complete(b);
    } else {
      work_[b]->wait();
      bytes += work_[b]->bytes_sent();
    }
  }
  double waited = seconds_since(t0);
  last_bytes_ = bytes;
  set_step(step_ + 1);
  begin_step(true);
  return waited;
}

}  // namespace dtrain::parallel

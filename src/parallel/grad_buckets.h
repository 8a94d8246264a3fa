#pragma once
// Data parallelism's gradient buckets on top of a Communicator and a ParamStore's flat
// buffers (the DDP reducer).
//
// GradBuckets: the flat gradient buffer split into buckets in REVERSE declaration order
// (backward produces the last parameters' grads first). Each bucket is a contiguous
// element range of whole parameters: the first (last-declared) bucket holds about
// first_bucket_mb, the others about bucket_mb. Hook on_grad_ready (Ctx::grad_ready) and
// a bucket's all-reduce (Avg) is launched as soon as all its params are ready, on the
// communicator's thread/stream, overlapping the rest of backward. finish() launches the
// remaining buckets (params that got no gradient this step) and waits for all.
// Gradient accumulation: begin_step(false) on all but the last micro-batch makes the hook
// do nothing; finish() is only called after the last micro-batch.
// Compression (parallel/grad_compression.h): a bucket's launch hands it to the compressor
// and finish() completes the buckets in bucket order; "none" is the plain f32 Avg above.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "nn/params.h"
#include "parallel/grad_compression.h"

namespace dtrain::parallel {

struct Bucket {
  int64_t begin = 0, end = 0;  // element range in the flat buffer
  std::vector<int> params;     // param ids, in the order backward produces them
};

// Pure planning (no communicator): buckets over `params` (offsets/shapes as declared).
std::vector<Bucket> plan_buckets(const std::vector<ParamDesc>& params, double first_bucket_mb,
                                 double bucket_mb);

class GradBuckets {
 public:
  GradBuckets(comm::Communicator& comm, ParamStore& ps, double bucket_mb = 25, double first_bucket_mb = 1,
              const CompressionOptions& comp = {});
  ~GradBuckets();
  // Call before each micro-batch's backward; sync=false (all but the last micro-batch of
  // an accumulation) turns on_grad_ready into a no-op.
  void begin_step(bool sync = true);
  void on_grad_ready(int param_id);  // launches a bucket's all-reduce once complete
  // Launches what is left, waits for every bucket; returns the seconds spent waiting
  // (communication not hidden behind backward). RuntimeFault from a failed collective.
  double finish();
  std::function<void(int)> hook() {
    return [this](int id) { on_grad_ready(id); };
  }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int launched() const;  // buckets launched in the current step
  // Payload bytes this rank sent for the gradients in the last finish() (Work::bytes_sent).
  uint64_t last_bytes() const { return last_bytes_; }
  // The optimizer step the next finish() completes (PowerSGD's warm-up counts in steps);
  // finish() advances it.
  void set_step(int64_t step);
  const GradCompressor* compressor() const { return comp_.get(); }
  GradCompressor* compressor() { return comp_.get(); }

 private:
  void launch(size_t b);
  comm::Communicator& comm_;
  ParamStore& ps_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;     // param id -> bucket index
  std::vector<char> param_ready_;  // this step
  std::vector<int> pending_;       // params not yet ready per bucket
  std::vector<std::shared_ptr<comm::Work>> work_;  // per bucket, null until launched
  std::vector<char> launched_;                     // per bucket, this step
  std::unique_ptr<GradCompressor> comp_;           // null: "none"
  int64_t step_ = 0;
  uint64_t last_bytes_ = 0;
  bool sync_ = true;
};

}  // namespace dtrain::parallel

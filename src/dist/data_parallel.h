#pragma once
// Data parallelism and ZeRO on top of a Communicator and a ParamStore's flat buffers.
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
//
// ZeroSharder (zero = 1 | 2): rank r owns elements shard_range(total, r, world) of the
// flat buffers (its optimizer state and, for stage 2, its reduced gradients). Shards are
// equal-sized ceil(total/world) except the tail, so the collectives work on a padded
// buffer of world * ceil(total/world) elements.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/buffer.h"
#include "dist/communicator.h"
#include "nn/params.h"
#include "optim/optimizer.h"

namespace dtrain::dist {

struct Bucket {
  int64_t begin = 0, end = 0;  // element range in the flat buffer
  std::vector<int> params;     // param ids, in the order backward produces them
};

// Pure planning (no communicator): buckets over `params` (offsets/shapes as declared).
std::vector<Bucket> plan_buckets(const std::vector<ParamDesc>& params, double first_bucket_mb,
                                 double bucket_mb);

class GradBuckets {
 public:
  GradBuckets(Communicator& comm, ParamStore& ps, double bucket_mb = 25, double first_bucket_mb = 1);
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

 private:
  void launch(size_t b);
  Communicator& comm_;
  ParamStore& ps_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;     // param id -> bucket index
  std::vector<char> param_ready_;  // this step
  std::vector<int> pending_;       // params not yet ready per bucket
  std::vector<std::shared_ptr<Work>> work_;  // per bucket, null until launched
  bool sync_ = true;
};

// Broadcasts params and float buffers from rank 0, then checks that every rank holds
// identical params+buffers (allgather of their SHA-256); RuntimeFault naming the ranks
// that differ. Counters (host int64) are not touched.
void sync_params(Communicator& comm, ParamStore& ps);
// The check alone (collective): RuntimeFault on every rank when any rank differs.
void verify_params(Communicator& comm, ParamStore& ps);
// SHA-256 of the flat params followed by the flat buffers (host copy).
std::array<uint8_t, 32> params_digest(ParamStore& ps);

// Rank r's contiguous range: [r*s, min((r+1)*s, total)) with s = ceil(total/world).
FlatRange shard_range(int64_t total, int rank, int world);

class ZeroSharder {
 public:
  ZeroSharder(Communicator& comm, ParamStore& ps);
  FlatRange range() const { return range_; }  // pass to the optimizer
  // Stage 2: grads of every rank reduced (Avg) into this rank's range of flat_grads
  // (the rest of flat_grads is left as it was). Returns seconds spent.
  double reduce_scatter_grads();
  // After the optimizer updated this rank's range of flat_params: every rank receives
  // every shard. Returns seconds spent.
  double allgather_params();

 private:
  Communicator& comm_;
  ParamStore& ps_;
  FlatRange range_;
  int64_t shard_ = 0;  // ceil(total / world)
  Buffer padded_, shard_buf_;
};

}  // namespace dtrain::dist

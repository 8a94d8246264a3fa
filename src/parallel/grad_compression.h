#pragma once
// Gradient compression on the data-parallel all-reduce of the gradient buckets (PyTorch's DDP
// communication hooks, torch/distributed/algorithms/ddp_comm_hooks). parallel.grad_compression:
//
//  * "bf16" / "fp16" (bf16_compress_hook / fp16_compress_hook): the bucket is cast to 16 bits
//    (round to nearest even), all-reduced with Avg in 16 bits (the communicator's ring: each
//    pairwise add in f32 rounded to 16 bits, the sum times 1/size in f32 and rounded once
//    more, comm/communicator.h) and cast back into the f32 gradients. Half the bytes.
//  * "powersgd" (Vogels et al. 2019, PyTorch's powerSGD_hook with warm_start, error feedback,
//    min_compression_rate 2): each gradient is viewed as a matrix M [shape[0], rest] (a conv
//    weight [out, kh*kw*in]); M with (n+m) r * 2 >= n m (vectors, small matrices, and every M
//    with r >= min(n, m)) goes uncompressed: one f32 all-reduce (Avg) of those gradients of the
//    bucket, packed. For the others, r = min(n, m, parallel.powersgd_rank):
//      M += E (error feedback);  P = M Q;  allreduce(P, Sum);  orthogonalize P (Gram-Schmidt
//      over the columns, a zero column stays zero);  Q = M^T P;  allreduce(Q, Sum);  Q /= size;
//      E = M - P Q^T;  M = P Q^T
//    The P's of a bucket travel in one all-reduce, the Q's in another. Q starts from a normal
//    draw seeded by (run.seed, bucket, matrix), equal on every rank, orthogonalized, and is
//    reused (warm start) from step to step; E starts at zero. For the first
//    parallel.powersgd_start_step steps the buckets are all-reduced as with "none" (f32 Avg).
//    Bytes per bucket: (n + m) r * 4 per compressed matrix + 4 per uncompressed element,
//    through f32 ring all-reduces (about 2(size-1)/size of that each).
//
// The PowerSGD state (E and Q) is this rank's own: checkpoints hold it per rank
// (export_state / import_state; train/checkpointer.cpp), so a resume on the same world size
// and bucket layout continues bit for bit; otherwise it starts again (E = 0, Q from the seed).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "nn/params.h"

namespace dtrain::parallel {

struct Bucket;

enum class GradCompression { None, BF16, FP16, PowerSGD };

// "none" | "bf16" | "fp16" | "powersgd"; UserError naming parallel.grad_compression otherwise.
GradCompression parse_grad_compression(const std::string& s);
const char* grad_compression_name(GradCompression c);

struct CompressionOptions {
  GradCompression kind = GradCompression::None;
  int powersgd_rank = 1;           // parallel.powersgd_rank (>= 1)
  int64_t powersgd_start_step = 0;  // parallel.powersgd_start_step: plain all-reduces before it
  uint64_t seed = 0;               // run.seed: Q's initial draw
};

// PowerSGD's plan of one gradient: the matrix view, its rank (0 = uncompressed).
struct PsgdMatrix {
  int param = 0;
  int64_t offset = 0, rows = 0, cols = 0;  // element offset in the flat buffer; M [rows, cols]
  int rank = 0;                             // r; 0 = all-reduced uncompressed
  // Element offsets in the bucket's packed buffers, set by the bucket's plan: `packed` in the
  // uncompressed buffer (rank 0) or the error buffer (rank > 0); p_at/q_at in P and Q.
  int64_t packed = 0, p_at = 0, q_at = 0;
};
// The plan of one parameter shape (min_compression_rate 2): r = min(rows, cols, rank) when
// (rows + cols) r 2 < rows cols, else 0.
PsgdMatrix plan_psgd_matrix(const ParamDesc& p, int id, int rank);

// One bucket's reduction with a compressor, in two halves: launch() when its gradients are
// ready (during backward), complete() in finish() (bucket order). `grads` is the bucket's
// slice of the flat f32 gradients, reduced (averaged) in place by complete().
class GradCompressor {
 public:
  GradCompressor(comm::Communicator& comm, ParamStore& ps, const std::vector<Bucket>& buckets,
                 const CompressionOptions& o);
  ~GradCompressor();
  void begin_step(int64_t step) { step_ = step; }
  void launch(size_t b, Tensor grads);
  // Waits for bucket b's collectives and writes its reduced gradients; returns the bytes this
  // rank sent for it (Work::bytes_sent of its collectives).
  uint64_t complete(size_t b);
  bool powersgd_active() const { return opts_.kind == GradCompression::PowerSGD && step_ >= opts_.powersgd_start_step; }
  const CompressionOptions& options() const { return opts_; }
  // PowerSGD's state for a checkpoint: "powersgd.bucket_<b>.error" [E's elements] and
  // "powersgd.bucket_<b>.q" [Q's] (f32, packed in plan order) of every bucket whose Q was
  // drawn (none before powersgd_start_step, nor for a bucket of uncompressed gradients).
  std::vector<ParamStore::Exported> export_state() const;
  // Loads what export_state wrote: every tensor is checked against this plan first; false,
  // with nothing changed, when one does not fit (another bucket layout or rank). A bucket
  // with no tensors draws Q afresh, as before.
  bool import_state(const TensorLookup& lookup);
  // Tests: bucket b's PowerSGD plan, error buffer E and Q (host copies, packed in plan order).
  const std::vector<PsgdMatrix>& psgd_plan(size_t b) const;
  std::vector<float> psgd_error(size_t b) const;
  std::vector<float> psgd_q(size_t b) const;

 private:
  struct State;
  void launch_powersgd(size_t b, Tensor grads);
  uint64_t complete_powersgd(size_t b);
  comm::Communicator& comm_;
  ParamStore& ps_;
  CompressionOptions opts_;
  int64_t step_ = 0;
  std::vector<std::unique_ptr<State>> st_;  // per bucket
};

// Gram-Schmidt over the columns of the row-major [rows, cols] matrix `a` (in place): each
// column divided by its norm (a zero column stays zero), its projection removed from the
// columns after it. PyTorch's _orthogonalize_gram_schmidt with epsilon 0.
void orthogonalize_columns(float* a, int64_t rows, int64_t cols);

}  // namespace dtrain::parallel

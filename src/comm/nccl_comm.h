#pragma once
// NcclCommunicator: collectives over CUDA buffers (only with DTRAIN_WITH_CUDA): f32, and
// bf16/f16 where communicator.h allows them (ncclBfloat16, ncclFloat16).
// Rank 0 creates the NCCL unique id and publishes it in the store; the communicator is
// created non-blocking (ncclCommInitRankConfig, config.blocking = 0) and every wait polls
// ncclCommGetAsyncError against the deadline, aborting the communicator (ncclCommAbort) on
// timeout or error. Collectives run on the communicator's own CUDA stream; it first waits
// for the producer stream (set_producer_stream, e.g. the CUDA backend's stream; the legacy
// default stream when unset). Work::wait() blocks the host until the collective finished.
// split(): a new communicator over a fresh unique id that the group's rank 0 publishes in
// the store under key_prefix + split_key() (the Store must outlive both); it inherits the
// producer stream. p2p_async(): the batch's ncclSend/ncclRecv in one ncclGroupStart/End on
// the communicator's stream (NCCL ignores the tag and matches each peer's operations in
// order, so exchange both directions in one batch). A collective that fails or times out
// records its arrival in the store and names the peers that did not (report_arrivals).
#ifdef DTRAIN_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>
#include <vector>

#include "comm/communicator.h"

namespace dtrain::comm {

class NcclCommunicator : public Communicator {
 public:
  // `store` must outlive this communicator and those split from it. `global_ranks`:
  // empty = 0..size-1.
  NcclCommunicator(Store& store, int rank, int size, int cuda_device, const std::string& key_prefix,
                   double timeout_s, std::string group_name = "world", std::vector<int> global_ranks = {});
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "nccl"; }
  // NCCL picks its algorithms itself: the counts are the ring's volumes (allreduce 2(n-1)/n
  // of the bytes, reduce-scatter and allgather (n-1) chunks, broadcast the bytes once per
  // rank of the chain but the last), p2p the bytes sent. Caller's thread.
  CommBytes bytes_sent() const override { return sent_; }
  std::string group_name() const override { return group_; }
  std::vector<int> global_ranks() const override { return global_; }
  std::unique_ptr<Communicator> split(const std::string& name, const std::vector<int>& ranks) override;
  std::shared_ptr<Work> p2p_async(const std::vector<P2POp>& ops) override;
  void set_producer_stream(cudaStream_t s) { producer_ = s; }
  cudaStream_t stream() const { return stream_; }

  std::shared_ptr<Work> allreduce_async(Tensor t, ReduceOp op) override;
  std::shared_ptr<Work> reduce_scatter_async(Tensor in, Tensor out_shard, ReduceOp op) override;
  std::shared_ptr<Work> allgather_async(Tensor shard, Tensor out) override;
  std::shared_ptr<Work> broadcast_async(Tensor t, int root) override;
  std::shared_ptr<Work> barrier_async() override;

  // Polls until the communicator is no longer in progress; aborts and throws on error or
  // after the timeout (for collective #seq, seq >= 0, naming the peers that did not
  // arrive). Used by NcclWork.
  void wait_ready(const std::string& what, cudaEvent_t done_event, int64_t seq = -1);

 private:
  // `seq` >= 0 for a collective (its sequence number), -1 for a p2p batch.
  template <typename F>
  std::shared_ptr<Work> launch(const std::string& desc, int64_t seq, F&& enqueue);
  // adds `bytes` to *counter (when not null) and to the Work
  template <typename F>
  std::shared_ptr<Work> launch_collective(const char* name, const std::string& detail, uint64_t* counter,
                                          uint64_t bytes, F&& enqueue);
  std::string where() const;  // "in group 'tp' (global ranks 2,3) on rank 1"
  void abort(const std::string& why);

  Store& store_;
  std::string key_prefix_, group_;
  std::vector<int> global_;
  int rank_, size_, device_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t producer_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  float* barrier_word_ = nullptr;
  uint64_t seq_ = 0, p2p_seq_ = 0, splits_ = 0;
  bool broken_ = false;
  CommBytes sent_;
  std::string broken_reason_;
};

}  // namespace dtrain::comm
#endif  // DTRAIN_WITH_CUDA

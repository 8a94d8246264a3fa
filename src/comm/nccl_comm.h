#pragma once
// NcclCommunicator: collectives over CUDA buffers (only with DTRAIN_WITH_CUDA): f32, and
// bf16/f16 where communicator.h allows them (ncclBfloat16, ncclFloat16).
// Rank 0 creates the NCCL unique id and publishes it in the store; the communicator is
// created non-blocking (ncclCommInitRankConfig, config.blocking = 0) and every wait polls
// ncclCommGetAsyncError against the deadline, aborting the communicator (ncclCommAbort) on
// timeout or error. Operations run on the communicator's own stream (a non-blocking CUDA
// stream from the backend, Communicator::stream()), which the base class has made wait for
// the backend's compute stream first. Work::wait() blocks the host until the operation
// finished. split(): a new communicator over a fresh unique id that the group's rank 0
// publishes in the store under key_prefix + split_key() (the Store must outlive both), with
// a stream of its own after the same producer. p2p: the batch's ncclSend/ncclRecv in one
// ncclGroupStart/End (NCCL matches each peer's operations in order). A collective that fails
// or times out records its arrival in the store and names the peers that did not
// (report_arrivals).
#ifdef DTRAIN_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>
#include <vector>

#include "comm/communicator.h"

namespace dtrain::comm {

class NcclCommunicator : public Communicator {
 public:
  // `store` must outlive this communicator and those split from it; `be`: a CUDA backend (its
  // device; its compute stream is the producer). `global_ranks`: empty = 0..size-1.
  NcclCommunicator(Store& store, int rank, int size, Backend& be, const std::string& key_prefix, double timeout_s,
                   std::string group_name = "world", std::vector<int> global_ranks = {});
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
  cudaStream_t cuda_stream() { return static_cast<cudaStream_t>(stream().native()); }

  // Polls until the communicator is no longer in progress; aborts and throws on error or
  // after the timeout (for collective #seq, seq >= 0, naming the peers that did not
  // arrive). Used by NcclWork.
  void wait_ready(const std::string& what, cudaEvent_t done_event, int64_t seq = -1);

 protected:
  std::unique_ptr<Communicator> split_impl(const std::string& name, const std::vector<int>& ranks) override;
  std::shared_ptr<Work> p2p_impl(const std::vector<P2POp>& ops) override;
  std::shared_ptr<Work> allreduce_impl(Tensor t, ReduceOp op) override;
  std::shared_ptr<Work> reduce_scatter_impl(Tensor in, Tensor out_shard, ReduceOp op) override;
  std::shared_ptr<Work> allgather_impl(Tensor shard, Tensor out) override;
  std::shared_ptr<Work> broadcast_impl(Tensor t, int root) override;
  std::shared_ptr<Work> barrier_impl() override;

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
  float* barrier_word_ = nullptr;
  uint64_t seq_ = 0, p2p_seq_ = 0, splits_ = 0;
  bool broken_ = false;
  CommBytes sent_;
  std::string broken_reason_;
};

}  // namespace dtrain::comm
#endif  // DTRAIN_WITH_CUDA

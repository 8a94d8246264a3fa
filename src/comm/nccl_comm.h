#pragma once
// NcclCommunicator: collectives over CUDA f32 buffers (only with DTRAIN_WITH_CUDA).
// Rank 0 creates the NCCL unique id and publishes it in the store; the communicator is
// created non-blocking (ncclCommInitRankConfig, config.blocking = 0) and every wait polls
// ncclCommGetAsyncError against the deadline, aborting the communicator (ncclCommAbort) on
// timeout or error. Collectives run on the communicator's own CUDA stream; it first waits
// for the producer stream (set_producer_stream, e.g. the CUDA backend's stream; the legacy
// default stream when unset). Work::wait() blocks the host until the collective finished.
#ifdef DTRAIN_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "comm/communicator.h"

namespace dtrain::comm {

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(Store& store, int rank, int size, int cuda_device,
                   const std::string& key_prefix, double timeout_s);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "nccl"; }
  void set_producer_stream(cudaStream_t s) { producer_ = s; }
  cudaStream_t stream() const { return stream_; }

  std::shared_ptr<Work> allreduce_async(Tensor t, ReduceOp op) override;
  std::shared_ptr<Work> reduce_scatter_async(Tensor in, Tensor out_shard, ReduceOp op) override;
  std::shared_ptr<Work> allgather_async(Tensor shard, Tensor out) override;
  std::shared_ptr<Work> broadcast_async(Tensor t, int root) override;
  std::shared_ptr<Work> barrier_async() override;

  // Polls until the communicator is no longer in progress; aborts and throws on error or
  // after the timeout. Used by NcclWork.
  void wait_ready(const std::string& what, cudaEvent_t done_event);

 private:
  template <typename F>
  std::shared_ptr<Work> launch(const char* name, const std::string& detail, F&& enqueue);
  void abort(const std::string& why);

  int rank_, size_, device_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t producer_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  float* barrier_word_ = nullptr;
  uint64_t seq_ = 0;
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace dtrain::comm
#endif  // DTRAIN_WITH_CUDA

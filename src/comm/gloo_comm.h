#pragma once
// GlooCommunicator: collectives over CPU buffers with Gloo's TCP transport: f32; allgather
// also bf16/f16 (the bytes as they are); reduce_scatter/allreduce also bf16 (our ring, each
// pairwise step added in f32 and rounded to bf16: the order in comm/communicator.h);
// allreduce also f16 (the same ring, rounded to f16).
// Byte counts: our rings and p2p count what they hand to the transport; for Gloo's own
// algorithms (f32 allreduce: ring; allgather: ring; broadcast: binomial tree) the count is
// that algorithm's exact volume (comm::wire in communicator.h), added when it completed.
// Rendezvous goes through dtrain's Store (an adapter implements Gloo's Store).
// Collectives run on one worker thread per communicator, in submission order.
// Point-to-point operations are posted on the caller's thread (Gloo's unbound buffers,
// slot = p2p prefix | tag | byte size, so only a same-size same-tag pair matches) and
// waited for, in posting order, by a second thread started at the first p2p batch.
// split() makes a new Gloo context over the same transport device, its rendezvous under
// this communicator's key prefix + split_key(); the Store must outlive both.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace gloo {
class Context;
namespace transport {
class Device;
}
}  // namespace gloo

namespace dtrain::comm {

struct GlooOptions {
  std::string hostname = "127.0.0.1";  // address the other ranks reach us at
  std::string iface;                   // network interface (overrides hostname)
  std::string key_prefix = "gloo/0/";  // store keys of this rendezvous
  double timeout_s = 300;              // rendezvous and every collective
  std::string group_name = "world";    // for messages; split() sets it
  std::vector<int> global_ranks;       // global rank of each member; empty = 0..size-1
};

class GlooCommunicator : public Communicator {
 public:
  // `store` must outlive this communicator and those split from it.
  GlooCommunicator(Store& store, int rank, int size, const GlooOptions& opt);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "gloo"; }
  CommBytes bytes_sent() const override;
  std::string group_name() const override { return opt_.group_name; }
  std::vector<int> global_ranks() const override { return global_; }
  std::unique_ptr<Communicator> split(const std::string& name, const std::vector<int>& ranks) override;
  std::shared_ptr<Work> p2p_async(const std::vector<P2POp>& ops) override;

  std::shared_ptr<Work> allreduce_async(Tensor t, ReduceOp op) override;
  std::shared_ptr<Work> reduce_scatter_async(Tensor in, Tensor out_shard, ReduceOp op) override;
  std::shared_ptr<Work> allgather_async(Tensor shard, Tensor out) override;
  std::shared_ptr<Work> broadcast_async(Tensor t, int root) override;
  std::shared_ptr<Work> barrier_async() override;

 private:
  class GlooWork;
  struct P2PBatch;
  GlooCommunicator(Store& store, int rank, int size, const GlooOptions& opt,
                   std::shared_ptr<gloo::transport::Device> dev);
  struct Task {
    std::shared_ptr<GlooWork> work;
    std::function<void(uint64_t seq)> fn;
    uint64_t seq;
  };
  std::shared_ptr<Work> submit(const char* name, std::string detail, std::function<void(uint64_t)> fn);
  void worker();
  using AddFn = void (*)(void* dst, const void* src, size_t n);
  void reduce_scatter_ring(const void* in, void* out, size_t n, size_t esize, AddFn add, uint64_t seq);
  void allreduce_16(void* t, DType dt, size_t n, ReduceOp op, uint64_t seq);  // bf16, f16
  void count(int kind, uint64_t bytes);  // kind: CommBytes' field index (worker thread)
  void p2p_worker();
  void mark_broken(const std::string& why);
  std::string peer_name(int r) const;  // "rank 1 (global 5)"

  Store& store_;
  GlooOptions opt_;
  int rank_, size_;
  std::vector<int> global_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::transport::Device> dev_;
  std::shared_ptr<gloo::Context> ctx_;
  uint64_t splits_ = 0;
  // payload bytes sent per CommBytes field (allreduce, reduce_scatter, allgather, broadcast, p2p)
  std::atomic<uint64_t> sent_[5] = {};
  GlooWork* cur_ = nullptr;  // the collective the worker runs (worker thread only)  // split() calls so far (the caller's thread only)
  std::vector<char> rs_work_, rs_recv_;  // reduce-scatter scratch (worker thread only)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
  bool broken_ = false;
  std::string broken_reason_;
  uint64_t seq_ = 0;
  std::thread thread_;
  // p2p: batches posted and not yet waited for, in posting order (guarded by mu_)
  std::deque<std::shared_ptr<P2PBatch>> p2p_queue_;
  uint64_t p2p_seq_ = 0;
  std::thread p2p_thread_;
};

}  // namespace dtrain::comm

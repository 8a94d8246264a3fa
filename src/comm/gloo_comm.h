#pragma once
// GlooCommunicator: collectives over CPU buffers with Gloo's TCP transport: f32; allgather
// also bf16/f16 (the bytes as they are); reduce_scatter/allreduce also bf16 (our ring, each
// pairwise step added in f32 and rounded to bf16: the order in comm/communicator.h);
// allreduce also f16 (the same ring, rounded to f16).
// Byte counts: our rings and p2p count what they hand to the transport; for Gloo's own
// algorithms (f32 allreduce: ring; allgather: ring; broadcast: binomial tree) the count is
// that algorithm's exact volume (comm::wire in communicator.h), added when it completed.
// Rendezvous goes through dtrain's Store (an adapter implements Gloo's Store).
//
// NCCL's execution semantics (so that a schedule that would hang or mis-pair on NCCL fails
// here, on the CPU): one worker thread per communicator is its stream, running collectives
// and point-to-point groups one at a time in submission order. A p2p group's operations
// progress together (one thread each) and the group ends when all of them have; a receive,
// and a send too, holds the stream until its partner is running on the peer's stream (a
// rendezvous, NCCL's behaviour for any message that does not fit its buffers). Sends and
// receives have no tags: the k-th send from rank a to rank b pairs with the k-th receive on
// b from a. Each pair first exchanges a header (byte size and the P2POp::what of each side),
// so a pair whose sizes or names disagree fails on both ranks naming both sides, and an
// operation that never finds its partner times out naming itself and what waits behind it
// on the stream.
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
  // `store` must outlive this communicator and those split from it. `be`: the backend whose
  // compute stream produces the tensors (null in tests of the transport alone).
  GlooCommunicator(Store& store, int rank, int size, const GlooOptions& opt, Backend* be = nullptr);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "gloo"; }
  CommBytes bytes_sent() const override;
  std::string group_name() const override { return opt_.group_name; }
  std::vector<int> global_ranks() const override { return global_; }

 protected:
  std::unique_ptr<Communicator> split_impl(const std::string& name, const std::vector<int>& ranks) override;
  std::shared_ptr<Work> p2p_impl(const std::vector<P2POp>& ops) override;
  std::shared_ptr<Work> allreduce_impl(Tensor t, ReduceOp op) override;
  std::shared_ptr<Work> reduce_scatter_impl(Tensor in, Tensor out_shard, ReduceOp op) override;
  std::shared_ptr<Work> allgather_impl(Tensor shard, Tensor out) override;
  std::shared_ptr<Work> broadcast_impl(Tensor t, int root) override;
  std::shared_ptr<Work> barrier_impl() override;

 private:
  class GlooWork;
  struct P2PGroup;
  GlooCommunicator(Store& store, int rank, int size, const GlooOptions& opt,
                   std::shared_ptr<gloo::transport::Device> dev, Backend* be);
  // One operation of the stream: a collective (seq >= 0, its sequence number) or a p2p group
  // (seq < 0).
  struct Task {
    std::shared_ptr<GlooWork> work;
    std::function<void(uint64_t seq)> fn;
    int64_t seq;
  };
  std::shared_ptr<Work> submit(const char* name, std::string detail, std::function<void(uint64_t)> fn);
  void worker();
  void run_p2p(P2PGroup& g);  // the worker thread: one group, start to end
  std::string queued_after() const;  // "; waiting behind it on the stream: ..." (mu_ held by the caller)
  using AddFn = void (*)(void* dst, const void* src, size_t n);
  void reduce_scatter_ring(const void* in, void* out, size_t n, size_t esize, AddFn add, uint64_t seq);
  void allreduce_16(void* t, DType dt, size_t n, ReduceOp op, uint64_t seq);  // bf16, f16
  void count(int kind, uint64_t bytes);  // kind: CommBytes' field index (worker thread)
  void mark_broken(const std::string& why);
  std::string peer_name(int r) const;  // "rank 1 (global 5)"

  Store& store_;
  GlooOptions opt_;
  int rank_, size_;
  std::vector<int> global_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::transport::Device> dev_;
  std::shared_ptr<gloo::Context> ctx_;
  uint64_t splits_ = 0;  // split() calls so far (the caller's thread only)
  // payload bytes sent per CommBytes field (allreduce, reduce_scatter, allgather, broadcast, p2p)
  std::atomic<uint64_t> sent_[5] = {};
  GlooWork* cur_ = nullptr;  // the operation the worker runs (worker thread only)
  std::vector<char> rs_work_, rs_recv_;  // reduce-scatter scratch (worker thread only)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
  bool broken_ = false;
  std::string broken_reason_;
  uint64_t seq_ = 0;
  std::thread thread_;
  // p2p: groups posted so far, and the sends to / receives from each peer so far (the next
  // one's index: NCCL's pairing by order); the caller's thread only
  uint64_t p2p_seq_ = 0;
  std::vector<uint64_t> sends_to_, recvs_from_;
};

}  // namespace dtrain::comm

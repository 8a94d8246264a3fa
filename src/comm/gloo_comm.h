#pragma once
// GlooCommunicator: collectives over CPU f32 buffers with Gloo's TCP transport.
// Rendezvous goes through dtrain's Store (an adapter implements Gloo's Store).
// Collectives run on one worker thread per communicator, in submission order.
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace gloo {
class Context;
}

namespace dtrain::comm {

struct GlooOptions {
  std::string hostname = "127.0.0.1";  // address the other ranks reach us at
  std::string iface;                   // network interface (overrides hostname)
  std::string key_prefix = "gloo/0/";  // store keys of this rendezvous
  double timeout_s = 300;              // rendezvous and every collective
};

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(Store& store, int rank, int size, const GlooOptions& opt);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "gloo"; }

  std::shared_ptr<Work> allreduce_async(Tensor t, ReduceOp op) override;
  std::shared_ptr<Work> reduce_scatter_async(Tensor in, Tensor out_shard, ReduceOp op) override;
  std::shared_ptr<Work> allgather_async(Tensor shard, Tensor out) override;
  std::shared_ptr<Work> broadcast_async(Tensor t, int root) override;
  std::shared_ptr<Work> barrier_async() override;

 private:
  class GlooWork;
  struct Task {
    std::shared_ptr<GlooWork> work;
    std::function<void(uint64_t seq)> fn;
    uint64_t seq;
  };
  std::shared_ptr<Work> submit(const char* name, std::string detail, std::function<void(uint64_t)> fn);
  void worker();
  void reduce_scatter_ring(float* in, float* out, size_t n, uint64_t seq);

  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::Context> ctx_;
  std::vector<float> rs_work_, rs_recv_;  // reduce-scatter scratch (worker thread only)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
  bool broken_ = false;
  std::string broken_reason_;
  uint64_t seq_ = 0;
  std::thread thread_;
};

}  // namespace dtrain::comm

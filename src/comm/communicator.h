#pragma once
// Communicator: collectives over the ranks of a job, on f32 tensors of one device.
// Implementations: GlooCommunicator (CPU, TCP), NcclCommunicator (CUDA, DTRAIN_WITH_CUDA).
// Every collective must be called by all ranks in the same order with the same sizes.
// A failure or timeout throws RuntimeFault naming the collective, its sequence number
// and the peer ranks; after that the communicator is broken (every call throws).
#include <chrono>
#include <memory>
#include <string>

#include <string>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace dtrain::comm {

class Store;
struct DistEnv;

enum class ReduceOp { Sum, Avg };

// Handle of an asynchronous collective. wait() blocks until it completed and rethrows
// its failure (RuntimeFault). Collectives of one communicator run in submission order.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool done() = 0;  // non-blocking
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend_name() const = 0;  // "gloo" | "nccl"

  // In place; Avg divides the sum by size().
  virtual std::shared_ptr<Work> allreduce_async(Tensor t, ReduceOp op) = 0;
  // `in` has size()*n elements, `out_shard` n: out_shard = reduction of every rank's
  // in[rank*n, (rank+1)*n).
  virtual std::shared_ptr<Work> reduce_scatter_async(Tensor in, Tensor out_shard, ReduceOp op) = 0;
  // `out` has size()*n elements, `shard` n; out[r*n, (r+1)*n) = rank r's shard. `shard`
  // may alias its own slot of `out`.
  virtual std::shared_ptr<Work> allgather_async(Tensor shard, Tensor out) = 0;
  virtual std::shared_ptr<Work> broadcast_async(Tensor t, int root) = 0;
  virtual std::shared_ptr<Work> barrier_async() = 0;

  void allreduce(Tensor& t, ReduceOp op) { allreduce_async(t, op)->wait(); }
  void reduce_scatter(const Tensor& in, Tensor& out_shard, ReduceOp op) {
    reduce_scatter_async(in, out_shard, op)->wait();
  }
  void allgather(const Tensor& shard, Tensor& out) { allgather_async(shard, out)->wait(); }
  void broadcast(Tensor& t, int root) { broadcast_async(t, root)->wait(); }
  void barrier() { barrier_async()->wait(); }
};

// The network interface Gloo binds to: DTRAIN_GLOO_IFACE, else the first of PyTorch's
// GLOO_SOCKET_IFNAME (a comma-separated list there), else "" (by address instead).
// UserError naming the variable when this machine has no such interface.
std::string gloo_iface_from_env();

// Gloo for CPU devices, NCCL for CUDA (RuntimeFault/UserError when not built with CUDA).
// `store` is used only during construction (rendezvous); keys are prefixed with the
// restart count so a restarted group never reads a stale address.
std::unique_ptr<Communicator> make_communicator(const DistEnv& env, Store& store,
                                                Device device, double timeout_s);

// What `dtrain info` prints of the collective backends this build has (Gloo; NCCL and its
// version when built with CUDA). One line each.
std::vector<std::string> describe_communicators();

}  // namespace dtrain::comm

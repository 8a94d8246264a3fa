#pragma once
// Communicator: collectives over the ranks of a job, on tensors of one device.
// Dtypes: every collective takes f32; allgather also bf16 and f16 (the bytes travel as they
// are); reduce_scatter and allreduce also bf16 (NCCL: ncclBfloat16, NCCL's own order; Gloo:
// the ring of reduce_scatter below, each pairwise step added in f32 and rounded to bf16,
// round to nearest even; Avg multiplies the sum by 1/size in f32 and rounds once more);
// reduce_scatter and allreduce also f16 (NCCL: ncclFloat16; Gloo: the same ring as bf16, each
// step added in f32 and rounded to f16, round to nearest even; Avg likewise).
// Bytes on the wire: bytes_sent() counts the payload bytes THIS rank handed to the transport,
// per collective kind and p2p (headers not included); each communicator (a split one too)
// counts its own. Work::bytes_sent() is what one operation sent.
// Any other dtype is refused (RuntimeFault naming the collective and the dtype).
// Implementations: GlooCommunicator (CPU, TCP), NcclCommunicator (CUDA, DTRAIN_WITH_CUDA).
// Every collective must be called by all ranks in the same order with the same sizes.
// A failure or timeout throws RuntimeFault naming the collective, its sequence number,
// the group and the peers that did not arrive; after that the communicator is broken
// (every call throws).
//
// Execution (NCCL's, on every backend): a communicator runs its collectives and point-to-point
// batches one after another, in submission order, on its own Stream (backend/stream.h). A
// receive blocks that stream until the matching send arrives; point-to-point has no tags:
// the k-th send from rank a to rank b pairs with the k-th receive on b from a.
// Ordering (docs/distributed.md, "The ordering contract"): an operation starts after the work
// issued so far on its producer stream, the compute stream of the Backend the communicator
// was made with (wired once, in the constructor, so split() inherits it); the caller's later
// work that reads its outputs comes after Work::wait(). Every operation declares the bytes it
// reads and writes on the communicator's stream (the stream-order checker, when on).
//
// Process groups: split() makes a communicator over a subset of this one's ranks (the
// "world" communicator of make_communicator is the root). Point-to-point: p2p_async()
// posts sends and receives between two ranks of one communicator.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/stream.h"
#include "core/device.h"
#include "core/tensor.h"

namespace dtrain {
class Backend;
}

namespace dtrain::comm {

class Store;
struct DistEnv;

enum class ReduceOp { Sum, Avg, Max };

// Payload bytes a rank sent (see bytes_sent()). Barriers send no payload.
struct CommBytes {
  uint64_t allreduce = 0, reduce_scatter = 0, allgather = 0, broadcast = 0, p2p = 0;
  uint64_t total() const { return allreduce + reduce_scatter + allgather + broadcast + p2p; }
};

// The payload bytes one rank of `size` sends in each algorithm (Gloo's and ours; the NCCL
// communicator counts with the ring formulas too). `bytes` = the whole tensor's bytes.
namespace wire {
// gloo::allreduce (gloo/allreduce.cc, algorithm UNSPECIFIED = ring): `elements` of
// `esize` bytes in size*k segments of roundUp(ceil(bytes/(size*k)), esize) bytes, k =
// max(2, ceil(bytes/1 MiB)/size rounded up); reduce-scatter and allgather phases each send
// size*k - k segments, each clamped to the bytes left after its offset (about 2(size-1)/size
// of the bytes; exactly that when size*k divides them).
uint64_t gloo_allreduce(uint64_t elements, uint64_t esize, int size, int rank);
// gloo::allgather (ring): (size-1) x the shard's bytes.
inline uint64_t ring_allgather(uint64_t shard_bytes, int size) { return shard_bytes * uint64_t(size - 1); }
// Our reduce-scatter ring (GlooCommunicator): (size-1) x the chunk's bytes.
inline uint64_t ring_reduce_scatter(uint64_t chunk_bytes, int size) { return chunk_bytes * uint64_t(size - 1); }
// gloo::broadcast (binomial tree, gloo/broadcast.cc): the bytes once per child of `rank`.
uint64_t gloo_broadcast(uint64_t bytes, int size, int rank, int root);
}  // namespace wire

// Handle of an asynchronous operation. wait() blocks the host until it completed and
// rethrows its failure (RuntimeFault); after it, work the host issues may read the outputs.
// Operations of one communicator run in submission order.
class Work {
 public:
  virtual ~Work() = default;
  void wait() {
    wait_impl();
    mark_.host_wait();
  }
  bool done() {  // non-blocking; true: as wait() returned
    if (!done_impl()) return false;
    mark_.host_wait();
    return true;
  }
  // Payload bytes this rank sent for this operation (final once wait() returned).
  uint64_t bytes_sent() const { return bytes_.load(); }
  void add_bytes(uint64_t b) { bytes_ += b; }
  // Where the operation ends in its stream's order (set by the Communicator).
  void set_mark(StreamMark m) { mark_ = std::move(m); }

 protected:
  virtual void wait_impl() = 0;
  virtual bool done_impl() = 0;

 private:
  std::atomic<uint64_t> bytes_{0};
  StreamMark mark_;
};

// One operation of a point-to-point batch. `t` is a tensor of any dtype on the
// communicator's device; its bytes travel as they are. As NCCL's, point-to-point has no
// tags: the k-th send from rank a to rank b pairs with the k-th receive on b from a, and the
// two must have the same byte size. `what` names the message for errors (the same words on
// both sides: "activations of micro-batch 2 into stage 1"); the CPU communicator compares
// the two sides' names and sizes and fails naming both when a send and a receive that pair
// up by order disagree (NCCL would hand one message's bytes to the other).
struct P2POp {
  enum class Kind { Send, Recv };
  Kind kind = Kind::Send;
  Tensor t;
  int peer = 0;  // rank in this communicator
  std::string what;
};

class Communicator {
 public:
  virtual ~Communicator();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend_name() const = 0;  // "gloo" | "nccl"
  // Payload bytes this rank has sent so far (see the top of this file), per kind.
  virtual CommBytes bytes_sent() const = 0;

  // "world" for the root communicator, the name given to split() for a sub-group.
  virtual std::string group_name() const { return "world"; }
  // The global rank (rank in the root communicator) of each member, indexed by rank().
  virtual std::vector<int> global_ranks() const;

  // The stream this communicator's operations run on, and the one they are ordered after
  // (the backend's compute stream; null when made without a backend: tests of the transport).
  Stream& stream() { return *stream_; }
  Stream* producer() const { return producer_; }
  Backend* backend() const { return be_; }

  // A communicator over some of this one's ranks. Collective over EVERY rank of this
  // communicator, in the same order relative to its other splits: each rank passes the
  // member list of ITS group (ranks of this communicator, in the order that becomes the
  // new ranks: new rank = index in the list), or an empty list when it joins no group (it
  // gets nullptr). The members of one group pass the same list; different groups of one
  // split may share a name. `name`: 1-64 of [A-Za-z0-9_.-]; UserError for a bad name or
  // list. The Store this communicator was made with must outlive the new one (the new
  // group's rendezvous goes through it, under this group's keys + "grp/<name>/..."). The new
  // communicator has a stream of its own, ordered after the same producer.
  std::unique_ptr<Communicator> split(const std::string& name, const std::vector<int>& ranks) {
    return split_impl(name, ranks);
  }

  // Posts the sends and receives of `ops` as one group: they progress together (so two ranks
  // may exchange in both directions in one batch); wait() blocks until all completed, and
  // throws RuntimeFault naming the operation when one did not within the timeout (then the
  // communicator is broken). Not collective: p2p operations do not count in the collectives'
  // sequence numbers.
  std::shared_ptr<Work> p2p_async(const std::vector<P2POp>& ops);
  std::shared_ptr<Work> send_async(Tensor t, int peer, std::string what = "") {
    return p2p_async({P2POp{P2POp::Kind::Send, t, peer, std::move(what)}});
  }
  std::shared_ptr<Work> recv_async(Tensor t, int peer, std::string what = "") {
    return p2p_async({P2POp{P2POp::Kind::Recv, t, peer, std::move(what)}});
  }

  // In place; Avg divides the sum by size(); Max (f32 only) takes the largest. Gloo bf16
  // and f16: the reduce_scatter ring over size() chunks of ceil(n/size()) elements (zero
  // padded), then an allgather of the chunks.
  std::shared_ptr<Work> allreduce_async(Tensor t, ReduceOp op);
  // `in` has size()*n elements, `out_shard` n (same dtype): out_shard = reduction of every
  // rank's in[rank*n, (rank+1)*n). Gloo's order (f32 and bf16): rank r's chunk starts with
  // rank r+1's piece and adds those of ranks r+2, ..., r (mod size()), one add per step.
  std::shared_ptr<Work> reduce_scatter_async(Tensor in, Tensor out_shard, ReduceOp op);
  // `out` has size()*n elements, `shard` n (same dtype: f32, bf16 or f16); out[r*n, (r+1)*n)
  // = rank r's shard. `shard` may alias its own slot of `out`.
  std::shared_ptr<Work> allgather_async(Tensor shard, Tensor out);
  std::shared_ptr<Work> broadcast_async(Tensor t, int root);
  std::shared_ptr<Work> barrier_async();

  void allreduce(Tensor& t, ReduceOp op) { allreduce_async(t, op)->wait(); }
  void reduce_scatter(const Tensor& in, Tensor& out_shard, ReduceOp op) {
    reduce_scatter_async(in, out_shard, op)->wait();
  }
  void allgather(const Tensor& shard, Tensor& out) { allgather_async(shard, out)->wait(); }
  void broadcast(Tensor& t, int root) { broadcast_async(t, root)->wait(); }
  void barrier() { barrier_async()->wait(); }

 protected:
  // `be`: the backend whose compute stream produces this communicator's inputs (its stream
  // comes from be->make_stream); null: a logical stream and no producer. `stream_name`
  // names the stream in the checker's reports.
  Communicator(Backend* be, const std::string& stream_name);

  // The backends' operations, called in submission order after the stream ordering.
  virtual std::unique_ptr<Communicator> split_impl(const std::string& name, const std::vector<int>& ranks);
  virtual std::shared_ptr<Work> p2p_impl(const std::vector<P2POp>& ops);
  virtual std::shared_ptr<Work> allreduce_impl(Tensor t, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> reduce_scatter_impl(Tensor in, Tensor out_shard, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> allgather_impl(Tensor shard, Tensor out) = 0;
  virtual std::shared_ptr<Work> broadcast_impl(Tensor t, int root) = 0;
  virtual std::shared_ptr<Work> barrier_impl() = 0;

 private:
  // Orders the stream after the producer, declares `acc` on it, runs `launch`, and gives
  // the Work the stream's mark.
  template <typename F>
  std::shared_ptr<Work> ordered(const std::string& what, const std::vector<MemAccess>& acc, F&& launch);

  Backend* be_ = nullptr;
  std::unique_ptr<Stream> stream_;
  Stream* producer_ = nullptr;
};

// For the implementations of split() and of failure messages:
// Checks split()'s arguments on `parent` (UserError naming the group, the rank and what is
// wrong) and returns this rank's index in `ranks` (-1 when `ranks` is empty).
int split_index(const Communicator& parent, const std::string& name, const std::vector<int>& ranks);
// The store key component of the nth split of a communicator into group `name` with
// members `ranks`: "grp/<name>/<n>/<members>/" (members: the list, or its size and hash
// when long), so two groups of one split and two splits of one name never share keys.
std::string split_key(const std::string& name, uint64_t nth, const std::vector<int>& ranks);
// `global` as it is, or 0..size-1 when empty.
std::vector<int> global_or_identity(std::vector<int> global, int size);
// "gloo tp (global ranks 2,3)" ("gloo world" for the root): a communicator's stream.
std::string stream_label(const std::string& backend, const std::string& name, const std::vector<int>& global);
// "group 'tp' (global ranks 2,3)" ("group 'world'" for the root), for messages.
std::string group_label(const std::string& name, const std::vector<int>& global);
// After collective #seq failed on `rank`: records in the store that this rank reached it
// (key `prefix` + "fail/<rank>" = seq) and waits up to `grace` for every peer's record.
// Returns "; not arrived: rank 2 (global 6), ..." naming the peers without one (or whose
// record is older), or "; every peer arrived" ("; arrivals unknown: the store is
// unreachable: ..." when the store fails). Every store request ends within the grace too
// (StoreDeadline; 250 ms more for one begun just before its end), so a store that is cut off
// or gone costs no more than that. Global ranks from `global` (indexed by rank).
std::string report_arrivals(Store& store, const std::string& prefix, uint64_t seq, int rank,
                            const std::vector<int>& global, std::chrono::milliseconds grace);

// The network interface Gloo binds to: DTRAIN_GLOO_IFACE, else the first of PyTorch's
// GLOO_SOCKET_IFNAME (a comma-separated list there), else "" (by address instead).
// UserError naming the variable when this machine has no such interface.
std::string gloo_iface_from_env();

// Gloo for CPU devices, NCCL for CUDA (RuntimeFault/UserError when not built with CUDA).
// `store` must outlive the communicator and every communicator split from it: it carries
// the rendezvous of each split() and the arrival records of a failed collective. Keys are
// prefixed with the restart count so a restarted group never reads a stale address.
// `be`: the backend whose tensors the communicator moves (its device picks the backend; its
// compute stream is the producer of every operation, split groups included).
std::unique_ptr<Communicator> make_communicator(const DistEnv& env, Store& store, Backend& be, double timeout_s);

// What `dtrain info` prints of the collective backends this build has (Gloo; NCCL and its
// version when built with CUDA). One line each.
std::vector<std::string> describe_communicators();

}  // namespace dtrain::comm

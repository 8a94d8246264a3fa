#ifdef DTRAIN_WITH_CUDA
#include "comm/nccl_comm.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <initializer_list>
#include <thread>

#include "backend/backend.h"
#include "core/dtype.h"
#include "core/error.h"
#include "comm/store.h"

namespace dtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fault("nccl communicator: {}: {}", what, cudaGetErrorString(e));
}

class NcclWork : public Work {
 public:
  NcclWork(NcclCommunicator& c, std::string desc, int64_t seq) : c_(c), desc_(std::move(desc)), seq_(seq) {
    cuda_ok(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~NcclWork() override {
    if (ev_) cudaEventDestroy(ev_);
  }
  cudaEvent_t event() const { return ev_; }

 protected:
  void wait_impl() override {
    if (!waited_) c_.wait_ready(desc_, ev_, seq_);
    waited_ = true;
  }
  bool done_impl() override { return waited_ || cudaEventQuery(ev_) == cudaSuccess; }

 private:

 private:
  NcclCommunicator& c_;
  std::string desc_;
  int64_t seq_;
  cudaEvent_t ev_ = nullptr;
  bool waited_ = false;
};

}  // namespace

NcclCommunicator::NcclCommunicator(Store& store, int rank, int size, Backend& be, const std::string& key_prefix,
                                   double timeout_s, std::string group_name, std::vector<int> global_ranks)
    : Communicator(&be, stream_label("nccl", group_name, global_or_identity(global_ranks, size))),
      store_(store), key_prefix_(key_prefix), group_(std::move(group_name)),
      global_(global_or_identity(std::move(global_ranks), size)), rank_(rank), size_(size), device_(be.device().index),
      timeout_s_(timeout_s) {
  DTRAIN_CHECK(be.device().is_cuda() && stream().native(), "nccl: needs a CUDA backend, got {}", be.name());
  DTRAIN_CHECK(int(global_.size()) == size, "nccl: {} global ranks for a group of {}", global_.size(), size);
  cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
  ncclUniqueId id;
  const std::string key = key_prefix + "unique_id";
  if (rank_ == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      fault("nccl: ncclGetUniqueId failed: {}", ncclGetErrorString(r));
    std::vector<uint8_t> b(sizeof(id));
    std::memcpy(b.data(), &id, sizeof(id));
    store.set(key, b);
  } else {
    auto b = store.get(key, std::chrono::milliseconds(int64_t(timeout_s * 1000)));
    if (b.size() != sizeof(id)) fault("nccl: store key '{}' has {} bytes, expected {}", key, b.size(), sizeof(id));
    std::memcpy(&id, b.data(), sizeof(id));
  }
  cuda_ok(cudaMalloc(&barrier_word_, sizeof(float)), "cudaMalloc");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, id, rank_, &cfg);
  if (r != ncclSuccess && r != ncclInProgress)
    fault("nccl: ncclCommInitRankConfig (rank {} of {} of {}) failed: {}", rank_, size_,
          group_label(group_, global_), ncclGetErrorString(r));
  wait_ready(fmt::format("nccl init of rank {} of {} of {}", rank_, size_, group_label(group_, global_)), nullptr);
}

std::string NcclCommunicator::where() const {
  std::string me = fmt::format("rank {}", rank_);
  if (group_ != "world" || global_[size_t(rank_)] != rank_) me += fmt::format(" (global {})", global_[size_t(rank_)]);
  return fmt::format("in {} on {}", group_label(group_, global_), me);
}

std::unique_ptr<Communicator> NcclCommunicator::split_impl(const std::string& name, const std::vector<int>& ranks) {
  const int index = split_index(*this, name, ranks);
  const uint64_t nth = splits_++;
  if (index < 0) return nullptr;
  std::vector<int> global;
  for (int r : ranks) global.push_back(global_[size_t(r)]);
  return std::make_unique<NcclCommunicator>(store_, index, int(ranks.size()), *backend(),
                                            key_prefix_ + split_key(name, nth, ranks), timeout_s_, name,
                                            std::move(global));
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_) {
    if (broken_) ncclCommAbort(comm_);
    else {
      cudaStreamSynchronize(cuda_stream());
      ncclCommDestroy(comm_);
    }
  }
  if (barrier_word_) cudaFree(barrier_word_);
}

void NcclCommunicator::abort(const std::string& why) {
  if (!broken_ && comm_) ncclCommAbort(comm_);
  comm_ = nullptr;
  broken_ = true;
  broken_reason_ = why;
  fault("{}", why);
}

void NcclCommunicator::wait_ready(const std::string& what, cudaEvent_t done_event, int64_t seq) {
  if (broken_) fault("{}: the communicator failed earlier: {}", what, broken_reason_);
  const auto timeout = std::chrono::milliseconds(int64_t(timeout_s_ * 1000));
  auto deadline = Clock::now() + timeout;
  // Which peers did not arrive at collective #seq: NCCL's ranks time out each on its own
  // clock, so the grace covers their skew.
  auto arrivals = [&] {
    if (seq < 0) return std::string();
    auto grace = std::clamp(timeout / 4, std::chrono::milliseconds(100), std::chrono::milliseconds(5000));
    return report_arrivals(store_, key_prefix_, uint64_t(seq), rank_, global_, grace);
  };
  while (true) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
    if (r != ncclSuccess) st = r;
    if (st != ncclSuccess && st != ncclInProgress)
      abort(fmt::format("{} (peers 0-{}) failed: {}{}", what, size_ - 1, ncclGetErrorString(st), arrivals()));
    if (st == ncclSuccess) {
      if (!done_event) return;
      cudaError_t q = cudaEventQuery(done_event);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady)
        abort(fmt::format("{} failed: {}", what, cudaGetErrorString(q)));
    }
    if (Clock::now() > deadline)
      abort(fmt::format("{} (peers 0-{}) timed out after {} s{}", what, size_ - 1, timeout_s_, arrivals()));
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

template <typename F>
std::shared_ptr<Work> NcclCommunicator::launch(const std::string& desc, int64_t seq, F&& enqueue) {
  if (broken_) fault("{}: the communicator failed earlier: {}", desc, broken_reason_);
  cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
  ncclResult_t r = enqueue();
  if (r != ncclSuccess && r != ncclInProgress)
    abort(fmt::format("{} (peers 0-{}) failed to launch: {}", desc, size_ - 1, ncclGetErrorString(r)));
  auto w = std::make_shared<NcclWork>(*this, desc, seq);
  wait_ready(desc + " (enqueue)", nullptr, seq);  // non-blocking comms may still be enqueuing
  cuda_ok(cudaEventRecord(w->event(), cuda_stream()), "cudaEventRecord");
  return w;
}

template <typename F>
std::shared_ptr<Work> NcclCommunicator::launch_collective(const char* name, const std::string& detail,
                                                          uint64_t* counter, uint64_t bytes, F&& enqueue) {
  const uint64_t seq = seq_++;
  auto w = launch(fmt::format("nccl {} #{} ({}) {}", name, seq, detail, where()), int64_t(seq),
                  std::forward<F>(enqueue));
  if (counter) *counter += bytes;
  w->add_bytes(bytes);
  return w;
}

std::shared_ptr<Work> NcclCommunicator::p2p_impl(const std::vector<P2POp>& ops) {
  DTRAIN_CHECK(!ops.empty(), "nccl p2p: an empty batch");
  std::string detail;
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    const bool send = op.kind == P2POp::Kind::Send;
    DTRAIN_CHECK(op.t.device.is_cuda(), "nccl {}: expected a cuda tensor, got {}", send ? "send" : "recv",
                 op.t.str());
    DTRAIN_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_, "nccl {}: peer {} on rank {} of {}",
                 send ? "send" : "recv", op.peer, rank_, size_);
    if (i > 0 && i <= 4) detail += ", ";
    if (i < 4)
      detail += fmt::format("{} of {} bytes {} rank {} (global {}){}", send ? "send" : "recv", op.t.nbytes(),
                            send ? "to" : "from", op.peer, global_[size_t(op.peer)],
                            op.what.empty() ? "" : " '" + op.what + "'");
    else if (i == 4) detail += "...";
  }
  uint64_t sends = 0;
  for (const auto& op : ops)
    if (op.kind == P2POp::Kind::Send) sends += op.t.nbytes();
  sent_.p2p += sends;
  auto w = launch(fmt::format("nccl p2p #{} ({}) {}", p2p_seq_++, detail, where()), -1, [&] {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (const auto& op : ops) {
      r = op.kind == P2POp::Kind::Send
              ? ncclSend(op.t.data, op.t.nbytes(), ncclUint8, op.peer, comm_, cuda_stream())
              : ncclRecv(op.t.data, op.t.nbytes(), ncclUint8, op.peer, comm_, cuda_stream());
      if (r != ncclSuccess && r != ncclInProgress) {
        ncclGroupEnd();
        return r;
      }
    }
    return ncclGroupEnd();
  });
  w->add_bytes(sends);
  return w;
}

static ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::Avg ? ncclAvg : op == ReduceOp::Max ? ncclMax : ncclSum;
}

static void check_cuda_f32(const Tensor& t, const char* what) {
  DTRAIN_CHECK(t.dtype == DType::F32 && t.device.is_cuda(), "nccl {}: expected f32 cuda tensor, got {}",
               what, t.str());
}

// A cuda tensor of one of `ok`; its NCCL type (f32 ncclFloat32, bf16 ncclBfloat16, f16 ncclFloat16).
static ncclDataType_t nccl_type(const Tensor& t, const char* what, std::initializer_list<DType> ok) {
  DTRAIN_CHECK(t.device.is_cuda(), "nccl {}: expected a cuda tensor, got {}", what, t.str());
  std::string names;
  for (DType d : ok) {
    if (d == t.dtype) {
      if (d == DType::BF16) return ncclBfloat16;
      if (d == DType::F16) return ncclFloat16;
      return ncclFloat32;
    }
    names += (names.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  fault("nccl {}: {} tensors are not supported (only {}), got {}", what, dtype_name(t.dtype), names, t.str());
}

std::shared_ptr<Work> NcclCommunicator::allreduce_impl(Tensor t, ReduceOp op) {
  const ncclDataType_t ty = nccl_type(t, "allreduce", {DType::F32, DType::BF16, DType::F16});
  const uint64_t P = uint64_t(size_), bytes = t.nbytes() * 2 * (P - 1) / P;  // the ring's volume
  return launch_collective("allreduce", fmt::format("{} {}", t.numel(), dtype_name(t.dtype)), &sent_.allreduce,
                           bytes, [&] {
    return ncclAllReduce(t.data, t.data, size_t(t.numel()), ty, nccl_op(op), comm_, cuda_stream());
  });
}

std::shared_ptr<Work> NcclCommunicator::reduce_scatter_impl(Tensor in, Tensor out, ReduceOp op) {
  const ncclDataType_t ty = nccl_type(in, "reduce_scatter", {DType::F32, DType::BF16, DType::F16});
  nccl_type(out, "reduce_scatter", {in.dtype});
  DTRAIN_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: {} is not {} x {}", in.numel(), size_,
               out.numel());
  return launch_collective("reduce_scatter", fmt::format("{} x {} {}", size_, out.numel(), dtype_name(in.dtype)),
                           &sent_.reduce_scatter, out.nbytes() * uint64_t(size_ - 1), [&] {
    return ncclReduceScatter(in.data, out.data, size_t(out.numel()), ty, nccl_op(op),
                             comm_, cuda_stream());
  });
}

std::shared_ptr<Work> NcclCommunicator::allgather_impl(Tensor shard, Tensor out) {
  const ncclDataType_t ty = nccl_type(shard, "allgather", {DType::F32, DType::BF16, DType::F16});
  nccl_type(out, "allgather", {shard.dtype});
  DTRAIN_CHECK(out.numel() == shard.numel() * size_, "allgather: {} is not {} x {}", out.numel(), size_,
               shard.numel());
  return launch_collective("allgather", fmt::format("{} x {} {}", size_, shard.numel(), dtype_name(shard.dtype)),
                           &sent_.allgather, shard.nbytes() * uint64_t(size_ - 1), [&] {
    return ncclAllGather(shard.data, out.data, size_t(shard.numel()), ty, comm_, cuda_stream());
  });
}

std::shared_ptr<Work> NcclCommunicator::broadcast_impl(Tensor t, int root) {
  check_cuda_f32(t, "broadcast");
  // a chain from the root: every rank but the last one before the root forwards the bytes
  const uint64_t bytes = size_ > 1 && rank_ != (root + size_ - 1) % size_ ? t.nbytes() : 0;
  return launch_collective("broadcast", fmt::format("{} f32 from rank {}", t.numel(), root), &sent_.broadcast, bytes,
                           [&] {
    return ncclBroadcast(t.data, t.data, size_t(t.numel()), ncclFloat32, root, comm_, cuda_stream());
  });
}

std::shared_ptr<Work> NcclCommunicator::barrier_impl() {
  // NCCL has no barrier: an all-reduce of one float on a private device word.
  return launch_collective("barrier", "1 f32", nullptr, 0, [&] {
    return ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, cuda_stream());
  });
}

}  // namespace dtrain::comm
#endif  // DTRAIN_WITH_CUDA

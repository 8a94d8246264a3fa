#ifdef DTRAIN_WITH_CUDA
#include "comm/nccl_comm.h"

#include <chrono>
#include <cstring>
#include <thread>

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
  NcclWork(NcclCommunicator& c, std::string desc) : c_(c), desc_(std::move(desc)) {
    cuda_ok(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~NcclWork() override {
    if (ev_) cudaEventDestroy(ev_);
  }
  cudaEvent_t event() const { return ev_; }
  void wait() override {
    if (!waited_) c_.wait_ready(desc_, ev_);
    waited_ = true;
  }
  bool done() override { return waited_ || cudaEventQuery(ev_) == cudaSuccess; }

 private:
  NcclCommunicator& c_;
  std::string desc_;
  cudaEvent_t ev_ = nullptr;
  bool waited_ = false;
};

}  // namespace

NcclCommunicator::NcclCommunicator(Store& store, int rank, int size, int cuda_device,
                                   const std::string& key_prefix, double timeout_s)
    : rank_(rank), size_(size), device_(cuda_device), timeout_s_(timeout_s) {
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
  cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_ok(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
  cuda_ok(cudaMalloc(&barrier_word_, sizeof(float)), "cudaMalloc");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, id, rank_, &cfg);
  if (r != ncclSuccess && r != ncclInProgress)
    fault("nccl: ncclCommInitRankConfig (rank {} of {}) failed: {}", rank_, size_, ncclGetErrorString(r));
  wait_ready(fmt::format("nccl init of rank {} of {}", rank_, size_), nullptr);
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_) {
    if (broken_) ncclCommAbort(comm_);
    else {
      cudaStreamSynchronize(stream_);
      ncclCommDestroy(comm_);
    }
  }
  if (barrier_word_) cudaFree(barrier_word_);
  if (ready_) cudaEventDestroy(ready_);
  if (stream_) cudaStreamDestroy(stream_);
}

void NcclCommunicator::abort(const std::string& why) {
  if (!broken_ && comm_) ncclCommAbort(comm_);
  comm_ = nullptr;
  broken_ = true;
  broken_reason_ = why;
  fault("{}", why);
}

void NcclCommunicator::wait_ready(const std::string& what, cudaEvent_t done_event) {
  if (broken_) fault("{}: the communicator failed earlier: {}", what, broken_reason_);
  auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_s_ * 1000));
  while (true) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
    if (r != ncclSuccess) st = r;
    if (st != ncclSuccess && st != ncclInProgress)
      abort(fmt::format("{} (peers 0-{}) failed: {}", what, size_ - 1, ncclGetErrorString(st)));
    if (st == ncclSuccess) {
      if (!done_event) return;
      cudaError_t q = cudaEventQuery(done_event);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady)
        abort(fmt::format("{} failed: {}", what, cudaGetErrorString(q)));
    }
    if (Clock::now() > deadline)
      abort(fmt::format("{} (peers 0-{}) timed out after {} s", what, size_ - 1, timeout_s_));
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

template <typename F>
std::shared_ptr<Work> NcclCommunicator::launch(const char* name, const std::string& detail, F&& enqueue) {
  std::string desc = fmt::format("nccl {} #{} ({}) on rank {}", name, seq_++, detail, rank_);
  if (broken_) fault("{}: the communicator failed earlier: {}", desc, broken_reason_);
  cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
  cuda_ok(cudaEventRecord(ready_, producer_), "cudaEventRecord");
  cuda_ok(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
  ncclResult_t r = enqueue();
  if (r != ncclSuccess && r != ncclInProgress)
    abort(fmt::format("{} (peers 0-{}) failed to launch: {}", desc, size_ - 1, ncclGetErrorString(r)));
  auto w = std::make_shared<NcclWork>(*this, desc);
  wait_ready(desc + " (enqueue)", nullptr);  // non-blocking comms may still be enqueuing
  cuda_ok(cudaEventRecord(w->event(), stream_), "cudaEventRecord");
  return w;
}

static void check_cuda_f32(const Tensor& t, const char* what) {
  DTRAIN_CHECK(t.dtype == DType::F32 && t.device.is_cuda(), "nccl {}: expected f32 cuda tensor, got {}",
               what, t.str());
}

std::shared_ptr<Work> NcclCommunicator::allreduce_async(Tensor t, ReduceOp op) {
  check_cuda_f32(t, "allreduce");
  return launch("allreduce", fmt::format("{} f32", t.numel()), [&] {
    return ncclAllReduce(t.data, t.data, size_t(t.numel()), ncclFloat32,
                         op == ReduceOp::Avg ? ncclAvg : ncclSum, comm_, stream_);
  });
}

std::shared_ptr<Work> NcclCommunicator::reduce_scatter_async(Tensor in, Tensor out, ReduceOp op) {
  check_cuda_f32(in, "reduce_scatter");
  check_cuda_f32(out, "reduce_scatter");
  DTRAIN_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: {} is not {} x {}", in.numel(), size_,
               out.numel());
  return launch("reduce_scatter", fmt::format("{} x {} f32", size_, out.numel()), [&] {
    return ncclReduceScatter(in.data, out.data, size_t(out.numel()), ncclFloat32,
                             op == ReduceOp::Avg ? ncclAvg : ncclSum, comm_, stream_);
  });
}

std::shared_ptr<Work> NcclCommunicator::allgather_async(Tensor shard, Tensor out) {
  check_cuda_f32(shard, "allgather");
  check_cuda_f32(out, "allgather");
  DTRAIN_CHECK(out.numel() == shard.numel() * size_, "allgather: {} is not {} x {}", out.numel(), size_,
               shard.numel());
  return launch("allgather", fmt::format("{} x {} f32", size_, shard.numel()), [&] {
    return ncclAllGather(shard.data, out.data, size_t(shard.numel()), ncclFloat32, comm_, stream_);
  });
}

std::shared_ptr<Work> NcclCommunicator::broadcast_async(Tensor t, int root) {
  check_cuda_f32(t, "broadcast");
  return launch("broadcast", fmt::format("{} f32 from rank {}", t.numel(), root), [&] {
    return ncclBroadcast(t.data, t.data, size_t(t.numel()), ncclFloat32, root, comm_, stream_);
  });
}

std::shared_ptr<Work> NcclCommunicator::barrier_async() {
  // NCCL has no barrier: an all-reduce of one float on a private device word.
  return launch("barrier", "1 f32", [&] {
    return ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, stream_);
  });
}

}  // namespace dtrain::comm
#endif  // DTRAIN_WITH_CUDA

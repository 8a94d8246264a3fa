// CudaBackend: pinned host staging and asynchronous copies for the host-side optimizer
// (parallel.offload, optim/offload.h). Two non-blocking copy streams (device->host and
// host->device, so the two directions use both copy engines); every copy first waits for the
// compute work issued so far (an event recorded on the compute stream), then records its
// ticket's event. copy_join() makes the compute stream wait for both copy streams.
#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"

namespace dtrain {

void* CudaBackend::alloc_host(size_t bytes) {
  void* p = nullptr;
  DTRAIN_CUDA_CHECK(cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault),
                    fmt::format("alloc_host {} bytes (pinned host memory for parallel.offload)", bytes));
  host_allocs_++;
  return p;
}

void CudaBackend::free_host(void* p) {
  if (!p) return;
  cudaFreeHost(p);
  host_frees_++;
}

uint64_t CudaBackend::copy_async(void* dst, const void* src, size_t bytes, bool to_host) {
  const char* what = to_host ? "copy_to_host_async" : "copy_from_host_async";
  if (!copy_streams_[0]) {
    for (cudaStream_t& st : copy_streams_)
      DTRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), what);
    DTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&compute_ev_, cudaEventDisableTiming), what);
    for (cudaEvent_t& e : join_ev_) DTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what);
    copy_events_.resize(kCopyEvents, nullptr);
    for (cudaEvent_t& e : copy_events_) DTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what);
  }
  cudaStream_t st = copy_streams_[to_host ? 0 : 1];
  DTRAIN_CUDA_CHECK(cudaEventRecord(compute_ev_, stream_), what);
  DTRAIN_CUDA_CHECK(cudaStreamWaitEvent(st, compute_ev_, 0), what);
  if (bytes)
    DTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, st),
                      fmt::format("{} {} bytes", what, bytes));
  const uint64_t ticket = copies_issued_++;
  DTRAIN_CUDA_CHECK(cudaEventRecord(copy_events_[ticket % kCopyEvents], st), what);
  return ticket;
}

uint64_t CudaBackend::copy_to_host_async(void* dst, const void* src, size_t bytes) {
  return copy_async(dst, src, bytes, true);
}
uint64_t CudaBackend::copy_from_host_async(void* dst, const void* src, size_t bytes) {
  return copy_async(dst, src, bytes, false);
}

void CudaBackend::copy_wait(uint64_t ticket) {
  DTRAIN_CHECK(ticket < copies_issued_ && copies_issued_ - ticket <= uint64_t(kCopyEvents),
               "copy_wait: ticket {} is not one of the latest {} of {} copies", ticket, kCopyEvents, copies_issued_);
  DTRAIN_CUDA_CHECK(cudaEventSynchronize(copy_events_[ticket % kCopyEvents]), "copy_wait");
}

void CudaBackend::copy_join() {
  if (!copy_streams_[0]) return;
  for (int i = 0; i < 2; ++i) {
    DTRAIN_CUDA_CHECK(cudaEventRecord(join_ev_[i], copy_streams_[i]), "copy_join");
    DTRAIN_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_ev_[i], 0), "copy_join");
  }
}

void CudaBackend::release_copy_streams() {
  if (!copy_streams_[0]) return;
  for (cudaStream_t st : copy_streams_) {
    cudaStreamSynchronize(st);
    cudaStreamDestroy(st);
  }
  for (cudaEvent_t e : copy_events_) cudaEventDestroy(e);
  for (cudaEvent_t e : join_ev_) cudaEventDestroy(e);
  cudaEventDestroy(compute_ev_);
  copy_events_.clear();
  copy_streams_[0] = copy_streams_[1] = nullptr;
}

}  // namespace dtrain

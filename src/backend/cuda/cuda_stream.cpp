#include "backend/cuda/cuda_stream.h"

#include "backend/cuda/check.h"

namespace dtrain {

CudaStream::CudaStream(std::string name, std::shared_ptr<StreamChecker> checker, int device)
    : Stream(std::move(name), std::move(checker)), device_(device), owned_(true) {
  const std::string what = fmt::format("stream '{}' on cuda:{}", this->name(), device_);
  DTRAIN_CUDA_CHECK(cudaSetDevice(device_), what);
  DTRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), what);
  DTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), what);
}

CudaStream::CudaStream(std::string name, std::shared_ptr<StreamChecker> checker, int device, cudaStream_t s)
    : Stream(std::move(name), std::move(checker)), device_(device), stream_(s) {
  DTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming),
                    fmt::format("stream '{}' on cuda:{}", this->name(), device_));
}

CudaStream::~CudaStream() {
  if (ready_) cudaEventDestroy(ready_);
  if (owned_ && stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

void CudaStream::do_wait_for(Stream& producer) {
  auto* p = static_cast<cudaStream_t>(producer.native());
  const std::string what = fmt::format("stream '{}' waits for '{}'", name(), producer.name());
  DTRAIN_CUDA_CHECK(cudaSetDevice(device_), what);
  // a producer without a device stream (a logical one) has nothing queued on the device
  if (!p) return;
  DTRAIN_CUDA_CHECK(cudaEventRecord(ready_, p), what);
  DTRAIN_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0), what);
}

void CudaStream::do_synchronize() {
  DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream_), fmt::format("synchronize stream '{}'", name()));
}

}  // namespace dtrain

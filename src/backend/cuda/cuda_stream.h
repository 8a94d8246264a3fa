#pragma once
// CudaStream: a Stream (backend/stream.h) over a cudaStream_t of one device. wait_for() records
// an event on the producer's stream and makes this stream wait for it (cudaEventRecord +
// cudaStreamWaitEvent); synchronize() is cudaStreamSynchronize. Owned streams are created
// non-blocking (they never synchronise with the legacy default stream) and destroyed with the
// object; the backend's compute stream is wrapped without ownership.
#include <cuda_runtime.h>

#include "backend/stream.h"

namespace dtrain {

class CudaStream final : public Stream {
 public:
  // A new non-blocking stream on `device`.
  CudaStream(std::string name, std::shared_ptr<StreamChecker> checker, int device);
  // `s` as it is (not owned).
  CudaStream(std::string name, std::shared_ptr<StreamChecker> checker, int device, cudaStream_t s);
  ~CudaStream() override;
  void* native() const override { return stream_; }

 protected:
  void do_wait_for(Stream& producer) override;
  void do_synchronize() override;

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  bool owned_ = false;
  cudaEvent_t ready_ = nullptr;  // recorded on the producer, waited on here
};

}  // namespace dtrain

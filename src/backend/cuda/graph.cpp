// CUDA graphs for train.cuda_graph (session/step_graph.h): the compute stream is captured in
// thread-local mode (another thread's CUDA calls do not break the capture), the graph is
// instantiated once and launched on the same stream. Every launch reads and writes the
// addresses of the capture; keeping them valid is the caller's contract.
#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"

namespace dtrain {
namespace {

class CudaGraph final : public DeviceGraph {
 public:
  CudaGraph(cudaGraphExec_t exec, cudaStream_t stream) : exec_(exec), stream_(stream) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec_); }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  void launch() override { DTRAIN_CUDA_CHECK(cudaGraphLaunch(exec_, stream_), "DeviceGraph::launch"); }

 private:
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
};

}  // namespace

void CudaBackend::capture_begin() {
  DTRAIN_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "capture_begin");
  capturing_ = true;
}

std::unique_ptr<DeviceGraph> CudaBackend::capture_end() {
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  DTRAIN_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph), "capture_end (an op in the captured region "
                                                           "synchronised with the host or used another stream)");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  DTRAIN_CUDA_CHECK(e, "capture_end: instantiating the graph");
  return std::make_unique<CudaGraph>(exec, stream_);
}

void CudaBackend::capture_abort() {
  capturing_ = false;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream_, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream_, &graph);
    if (graph) cudaGraphDestroy(graph);
  }
  (void)cudaGetLastError();
}

}  // namespace dtrain

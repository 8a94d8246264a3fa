// The ordering contract on a real GPU (docs/distributed.md, "The ordering contract"), with the
// one GPU a check run has: a one-rank NCCL communicator's all-gather of a buffer that a fill
// queued behind a long chain of GEMMs writes. The all-gather runs on the communicator's own
// non-blocking stream; only the wait for the compute stream (the producer, wired in the
// Communicator constructor) keeps it from copying the buffer before the fill ran. Run by
// scripts/gpu_check.sh (the gpu tests); skipped without a CUDA device or NCCL.
#include <doctest/doctest.h>

#include <chrono>
#include <vector>

#include "skip.h"
#include "backend/backend.h"
#include "core/buffer.h"
#ifdef DTRAIN_WITH_CUDA
#include "comm/nccl_comm.h"
#include "comm/store.h"
#endif

using namespace dtrain;

TEST_SUITE("gpu") {

TEST_CASE("gpu: a one-rank NCCL all-gather holds the fill queued behind a long kernel") {
  GPU_OR_SKIP();
#ifdef DTRAIN_WITH_CUDA
  auto be = make_backend("cuda");
  comm::StoreServer server("127.0.0.1", 0, "gpu-order");
  comm::StoreClient store("127.0.0.1", server.port(), "gpu-order", std::chrono::seconds(30));
  comm::NcclCommunicator nccl(store, 0, 1, *be, "nccl/", 60);
  const int64_t n = 1 << 22, G = 4096;  // 16 MiB to gather; GEMMs of 4096^3 (137 GFLOP each in f32)
  Buffer xb(*be, size_t(n) * 4), outb(*be, size_t(n) * 4), ab(*be, size_t(G * G) * 4), cb(*be, size_t(G * G) * 4);
  Tensor x = xb.tensor(DType::F32, Shape{n}), out = outb.tensor(DType::F32, Shape{n});
  Tensor a = ab.tensor(DType::F32, Shape{G, G}), c = cb.tensor(DType::F32, Shape{G, G});
  be->fill(x, 0.f);
  be->fill(out, -1.f);
  be->fill(a, 1e-4f);
  be->synchronize();
  for (int i = 0; i < 40; ++i) be->gemm(false, false, 1.f, a, a, 0.f, c);  // tens of ms queued
  be->fill(x, 7.f);                                                          // behind them
  auto w = nccl.allgather_async(x, out);  // on the communicator's stream, after the producer
  w->wait();
  std::vector<float> host(static_cast<size_t>(n));
  be->copy_to_host(host.data(), out.data, host.size() * 4);
  int64_t stale = 0;
  for (float v : host) stale += v != 7.f;
  CHECK_MESSAGE(stale == 0, stale << " of " << n << " gathered values are not the fill's (the all-gather ran before "
                                         "the kernels queued on the compute stream)");
#endif
}

}  // TEST_SUITE

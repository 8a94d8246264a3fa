// Step phase timing on CUDA: the event timer measures the device's work in stream order
// without making the host wait, phases of a known kernel sequence add up to the step's
// total, and a real training step reports every phase. Skips visibly without a device.
#include <doctest/doctest.h>

#include <chrono>
#include <memory>

#include "skip.h"
#include "backend/backend.h"
#include "backend/event_timer.h"
#include "core/buffer.h"
#include "obs/step_timer.h"
#include "session/step.h"

using namespace dtrain;

namespace {

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Three n x n f32 matrices on the device and `k` GEMMs c = a @ b of them (2 n^3 FLOPs each).
struct GemmWork {
  static constexpr int64_t n = 4096;
  Backend& be;
  Buffer a, b, c;
  Tensor ta, tb, tc;
  explicit GemmWork(Backend& backend)
      : be(backend), a(be, size_t(n * n) * 4), b(be, size_t(n * n) * 4), c(be, size_t(n * n) * 4) {
    ta = a.tensor(DType::F32, Shape{n, n});
    tb = b.tensor(DType::F32, Shape{n, n});
    tc = c.tensor(DType::F32, Shape{n, n});
    be.fill(ta, 0.5f);
    be.fill(tb, 0.25f);
  }
  void run(int k) {
    for (int i = 0; i < k; ++i) be.gemm(false, false, 1.f, ta, tb, 0.f, tc);
  }
};

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("cuda event timer: marks do not wait and time the kernels between them") {
    GPU_OR_SKIP();
    auto be = make_backend("cuda");
    GemmWork w(*be);
    w.run(1);  // plan + workspace
    be->synchronize();
    std::unique_ptr<EventTimer> t = be->make_event_timer();
    auto h0 = std::chrono::steady_clock::now();
    const int a = t->mark();
    w.run(6);
    const int b = t->mark();
    const double host_s = since(h0);  // what recording and launching cost the host
    const double dev_s = t->elapsed(a, b);  // waits for b
    MESSAGE("6 GEMMs of 4096^3: device " << dev_s * 1e3 << " ms, host launch " << host_s * 1e3 << " ms");
    CHECK(dev_s > 0);
    // the host did not wait for the GEMMs: it was done launching long before the device
    CHECK(host_s < 0.5 * dev_s);
    // more than 500 FLOP/ns (500 TFLOP/s) would be impossible for f32 GEMMs on one GPU
    CHECK(dev_s > 6 * 2.0 * double(GemmWork::n * GemmWork::n * GemmWork::n) / 500e12);
    // events are reused after clear(): the same indices again
    t->clear();
    CHECK(t->mark() == 0);
    t->wait(0);
  }

  TEST_CASE("cuda step timer: phases of a known kernel sequence are in proportion and sum to the total") {
    GPU_OR_SKIP();
    auto be = make_backend("cuda");
    GemmWork w(*be);
    StepTimer tm(*be);
    for (int rep = 0; rep < 2; ++rep) {  // the first pass plans the GEMM and warms the clocks
      tm.start();
      tm.begin(Phase::Forward);
      w.run(4);
      tm.end(Phase::Forward);
      tm.begin(Phase::Backward);
      w.run(8);
      tm.end(Phase::Backward);
      tm.begin(Phase::Optimizer);
      w.run(2);
      tm.end(Phase::Optimizer);
      tm.finish();
    }
    const double f = tm.seconds(Phase::Forward), b = tm.seconds(Phase::Backward), o = tm.seconds(Phase::Optimizer);
    const double sum = f + b + o, total = tm.total_s();
    MESSAGE("forward " << f * 1e3 << " ms, backward " << b * 1e3 << " ms, optimizer " << o * 1e3 << " ms, total "
                       << total * 1e3 << " ms");
    CHECK(f > 0);
    CHECK(b > 0);
    CHECK(o > 0);
    // each phase measures its own GEMMs: 8 vs 4 vs 2 of the same shape
    CHECK(b / f > 1.6);
    CHECK(b / f < 2.5);
    CHECK(f / o > 1.6);
    CHECK(f / o < 2.5);
    // back-to-back on the stream, inside the step: the phases are the whole step but for
    // the host's few microseconds at its start and end (GPU timer vs host clock: 1%)
    CHECK(sum <= total * 1.01);
    CHECK(sum >= 0.9 * total);
  }

  TEST_CASE("cuda train step: every phase is timed and the phases fit in the total") {
    GPU_OR_SKIP();
    std::string text = R"(
[run]
seed = 1
device = "cuda"
[model]
kind = "resnet"
depth = 8
width = 8
stem = "cifar"
in_channels = 3
num_classes = 10
[data]
kind = "synthetic"
synthetic_height = 32
synthetic_width = 32
[train]
batch_size = 32
max_steps = 10
clip_grad_norm = 1.0
[optim]
name = "sgd"
lr = 0.05
momentum = 0.9
)";
    auto s = make_session(Config::parse(text, "gpu_timing_test.toml"), SessionOptions{});
    REQUIRE(s->be->device().is_cuda());
    for (int64_t step = 0; step < 4; ++step) {
      StepStats st = train_step(*s, step, 0.05);
      CAPTURE(step);
      CHECK(st.t.forward_s > 0);
      CHECK(st.t.backward_s > 0);
      CHECK(st.t.optimizer_s > 0);
      const double sum = st.t.data_s + st.t.forward_s + st.t.backward_s + st.t.optimizer_s;
      // disjoint intervals (grad_accum 1); data is host time, the rest GPU timer: 1%
      CHECK(sum <= st.t.total_s * 1.01);
      if (step == 3)
        MESSAGE("step: data " << st.t.data_s * 1e3 << " ms, forward " << st.t.forward_s * 1e3 << " ms, backward "
                              << st.t.backward_s * 1e3 << " ms, optimizer " << st.t.optimizer_s * 1e3
                              << " ms, total " << st.t.total_s * 1e3 << " ms");
    }
  }
}

// StepGraphs (train.cuda_graph) decides, per micro-batch index, whether to run the step's
// device work eagerly, capture it or replay the captured graph. Its rules are checked here
// on the CPU with a test double: a CPU backend whose "capture" only notes that the body ran
// inside it and whose graphs count their launches. (The real capture and replay on CUDA are
// checked by the gpu test in test_gpu_graph.cpp.)
#include <doctest/doctest.h>

#include <memory>
#include <stdexcept>

#include "backend/cpu/cpu_backend.h"
#include "core/buffer.h"
#include "core/error.h"
#include "obs/step_timer.h"
#include "session/step_graph.h"

using namespace dtrain;

namespace {

struct FakeGraph : DeviceGraph {
  int* launches;
  explicit FakeGraph(int* l) : launches(l) {}
  void launch() override { ++*launches; }
};

class CapturingCpu : public CpuBackend {
 public:
  CapturingCpu() : CpuBackend(1) {}
  bool can_capture() const override { return true; }
  void capture_begin() override {
    REQUIRE_FALSE(capturing);
    capturing = true;
  }
  std::unique_ptr<DeviceGraph> capture_end() override {
    REQUIRE(capturing);
    capturing = false;
    return std::make_unique<FakeGraph>(&launches);
  }
  void capture_abort() override {
    capturing = false;
    ++aborts;
  }
  bool capturing = false;
  int launches = 0, aborts = 0;
};

struct Rig {
  CapturingCpu be;
  StepTimer tm{be};
  ParamStore ps;
  int counter = -1;
  StepGraphs graphs;
  int eager = 0, captured = 0;  // body runs outside / inside a capture
  // two staged batches: "a" and "b" (other addresses)
  float bytes_a[4] = {}, bytes_b[4] = {};
  Tensor input(const std::string& which) {
    return Tensor(which == "a" ? bytes_a : bytes_b, DType::F32, Device::cpu(), Shape{4});
  }
  Rig() {
    counter = ps.declare_counter("bn.num_batches_tracked");
    ps.finalize(be);
  }
  // One "step" of micro-batch 0 whose body marks a forward interval and counts like a
  // batch norm; `alloc` makes the body allocate (an unsteady run).
  void step(const std::string& key, bool alloc = false) {  // key: which staged batch
    tm.start();
    graphs.run(be, tm, ps, 0, {input(key)}, [&] {
      (be.capturing ? captured : eager)++;
      if (alloc) Buffer tmp(be, 64);
      tm.begin(Phase::Forward);
      ps.counter(counter) += 1;
      tm.end(Phase::Forward);
    });
    tm.finish();
  }
};

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("step graphs: eager until steady then one capture then replays that count like the body") {
  Rig r;
  r.step("a", true);  // allocates: not steady
  r.step("a");        // steady
  CHECK(r.eager == 2);
  CHECK(r.graphs.captures() == 0);
  r.step("a");  // captured (and launched once: the capture ran nothing)
  CHECK(r.captured == 1);
  CHECK(r.graphs.captures() == 1);
  CHECK(r.be.launches == 1);
  for (int i = 0; i < 3; ++i) r.step("a");  // replays: the body does not run
  CHECK(r.eager == 2);
  CHECK(r.captured == 1);
  CHECK(r.graphs.replays() == 3);
  CHECK(r.be.launches == 4);
  // every step counted once, replayed ones included
  CHECK(r.ps.counter(r.counter) == 6);
  // the graph's marks must fall where the capture made them: a step that marked something
  // else first cannot account for them (that would time the wrong events)
  r.tm.start();
  r.tm.begin(Phase::Optimizer);
  r.tm.end(Phase::Optimizer);
  CHECK_THROWS_AS(r.graphs.run(r.be, r.tm, r.ps, 0, {r.input("a")}, [] {}), RuntimeFault);
}

TEST_CASE("step graphs: other staged inputs or freed memory mean eager again then a new capture") {
  Rig r;
  for (int i = 0; i < 3; ++i) r.step("a");  // eager (steady), capture, replay
  REQUIRE(r.graphs.captures() == 1);
  REQUIRE(r.graphs.replays() == 1);
  r.step("b");  // other inputs: the graph is dropped, eager (steady)
  CHECK(r.eager == 2);
  r.step("b");  // capture for "b"
  CHECK(r.graphs.captures() == 2);
  r.step("b");
  CHECK(r.graphs.replays() == 2);
  { Buffer tmp(r.be, 64); }  // memory given back: the graph may point into it
  r.step("b");  // eager
  CHECK(r.eager == 3);
  r.step("b");  // capture
  CHECK(r.graphs.captures() == 3);
  r.step("b");
  CHECK(r.graphs.replays() == 3);
  CHECK(r.ps.counter(r.counter) == 9);
}

TEST_CASE("step graphs: an error inside the capture aborts it and names train.cuda_graph") {
  Rig r;
  auto bad = [&] {
    r.tm.start();
    r.graphs.run(r.be, r.tm, r.ps, 0, {r.input("a")}, [&] {
      if (r.be.capturing) throw RuntimeFault("cudaStreamSynchronize not permitted while capturing");
    });
  };
  bad();  // eager, steady
  try {
    bad();
    FAIL("the capture should have failed");
  } catch (const RuntimeFault& e) {
    CHECK(std::string(e.what()).find("train.cuda_graph") != std::string::npos);
    CHECK(std::string(e.what()).find("cudaStreamSynchronize") != std::string::npos);
  }
  CHECK(r.be.aborts == 1);
  CHECK_FALSE(r.be.capturing);
}
}  // TEST_SUITE("unit")

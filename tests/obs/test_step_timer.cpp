// Step phase timing on the CPU: the backend's EventTimer (host steady clock), StepTimer's
// phase intervals, and train_step's phase times (disjoint, so they sum to at most the total).
// The CUDA event timer is tested in test_gpu_timing.cpp.
#include <doctest/doctest.h>

#include <chrono>
#include <thread>

#include "backend/event_timer.h"
#include "core/error.h"
#include "obs/step_timer.h"
#include "session/step.h"

using namespace dtrain;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<Session> synthetic_resnet(int64_t grad_accum) {
  std::string text = R"(
[run]
seed = 1
device = "cpu"
threads = 1
[model]
kind = "resnet"
depth = 8
width = 4
stem = "cifar"
in_channels = 1
num_classes = 10
[data]
kind = "synthetic"
synthetic_height = 12
synthetic_width = 12
[train]
batch_size = 8
max_steps = 10
clip_grad_norm = 1.0
grad_accum = )" + std::to_string(grad_accum) + R"(
[optim]
name = "sgd"
lr = 0.05
momentum = 0.9
)";
  return make_session(Config::parse(text, "step_timer_test.toml"), SessionOptions{});
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("cpu event timer: marks are monotonic and elapsed covers a known sleep") {
    auto be = make_backend("cpu");
    std::unique_ptr<EventTimer> t = be->make_event_timer();
    CHECK(t->count() == 0);
    const int a = t->mark();
    std::this_thread::sleep_for(20ms);
    const int b = t->mark();
    const int c = t->mark();
    CHECK(a == 0);
    CHECK(b == 1);
    CHECK(c == 2);
    CHECK(t->count() == 3);
    t->wait(c);  // nothing to wait for on the CPU
    CHECK(t->elapsed(a, b) >= 0.020);
    CHECK(t->elapsed(a, b) < 10.0);  // sane: a reading, not garbage
    CHECK(t->elapsed(b, c) >= 0.0);
    CHECK(t->elapsed(a, a) == 0.0);
    CHECK(t->elapsed(a, c) == doctest::Approx(t->elapsed(a, b) + t->elapsed(b, c)));
    CHECK_THROWS_AS(t->elapsed(b, a), RuntimeFault);  // a before b only
    CHECK_THROWS_AS(t->elapsed(a, 7), RuntimeFault);  // no such mark
    t->clear();
    CHECK(t->count() == 0);
    CHECK(t->mark() == 0);
  }

  TEST_CASE("step timer on the cpu: intervals of a phase add up and the phases fit in the total") {
    auto be = make_backend("cpu");
    StepTimer tm(*be);
    CHECK_THROWS_AS(tm.begin(Phase::Forward), RuntimeFault);  // outside a step
    tm.start();
    for (int micro = 0; micro < 2; ++micro) {
      tm.begin(Phase::Forward);
      std::this_thread::sleep_for(5ms);
      tm.end(Phase::Forward);
      tm.begin(Phase::Backward);
      std::this_thread::sleep_for(10ms);
      tm.end(Phase::Backward);
    }
    tm.begin(Phase::Optimizer);
    std::this_thread::sleep_for(3ms);
    tm.end(Phase::Optimizer);
    std::this_thread::sleep_for(4ms);  // "other": neither phase
    tm.finish();
    CHECK_FALSE(tm.in_step());
    const double f = tm.seconds(Phase::Forward), b = tm.seconds(Phase::Backward), o = tm.seconds(Phase::Optimizer);
    CHECK(f >= 0.010);
    CHECK(b >= 0.020);
    CHECK(o >= 0.003);
    CHECK(tm.total_s() >= 0.037);
    CHECK(f + b + o <= tm.total_s());
    CHECK(tm.total_s() - (f + b + o) >= 0.004);  // the sleep outside every phase

    // the next step starts from zero
    tm.start();
    tm.begin(Phase::Optimizer);
    tm.end(Phase::Optimizer);
    tm.finish();
    CHECK(tm.seconds(Phase::Forward) == 0.0);
    CHECK(tm.seconds(Phase::Backward) == 0.0);

    // misuse is a bug, named
    tm.start();
    CHECK_THROWS_WITH_AS(tm.end(Phase::Backward), doctest::Contains("without begin"), RuntimeFault);
    tm.begin(Phase::Forward);
    CHECK_THROWS_WITH_AS(tm.begin(Phase::Forward), doctest::Contains("open"), RuntimeFault);
    CHECK_THROWS_WITH_AS(tm.finish(), doctest::Contains("forward open"), RuntimeFault);
  }

  TEST_CASE("train step on the cpu: every phase is timed and data + forward + backward + optimizer <= total") {
    for (int64_t accum : {1, 2}) {
      CAPTURE(accum);
      auto s = synthetic_resnet(accum);
      for (int64_t step = 0; step < 3; ++step) {
        StepStats st = train_step(*s, step, 0.05);
        CAPTURE(step);
        CHECK(st.t.data_s >= 0.0);
        CHECK(st.t.forward_s > 0.0);
        CHECK(st.t.backward_s > 0.0);
        CHECK(st.t.optimizer_s > 0.0);
        CHECK(st.sync_s == 0.0);  // one process
        const double sum = st.t.data_s + st.t.forward_s + st.t.backward_s + st.t.optimizer_s;
        CHECK(sum <= st.t.total_s);
        CHECK(st.t.total_s < 60.0);
        CHECK_FALSE(s->timer->in_step());
      }
    }
  }
}

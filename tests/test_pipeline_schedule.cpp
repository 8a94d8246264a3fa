// Pipeline parallelism's schedules (parallel/pipeline_schedule.h), without processes: for
// several (P, M, V) each rank's action list is run through a small simulation of the
// pipeline (each rank runs its list in order, a forward waits for the previous virtual
// stage's forward of the micro-batch, a backward for the next one's backward; forwards
// take 1, backwards 2 time units per chunk, scaled by 1/V) which checks that
//  * every (micro-batch, chunk) runs once forward and once backward, the forward first;
//  * the forward of virtual stage k ends before that of k+1 starts, the backward of k+1
//    before that of k (and the schedule finishes: no rank waits forever);
//  * 1F1B keeps at most P - r micro-batches in flight on rank r (GPipe: M);
//  * the idle time of the simulated pipeline over its compute time is the theory's bubble
//    exactly: (P-1)/M, interleaved (P-1)/(V*M);
// and the interleaved ordering equals Megatron's for P=2, V=2, M=4.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "core/error.h"
#include "parallel/pipeline_schedule.h"

using namespace dtrain;
using namespace dtrain::parallel;

namespace {

struct SimResult {
  bool finished = false;
  double makespan = 0, busy = 0;  // busy: the compute of one rank
};

// Runs every rank's list; checks the orderings above. Returns the makespan.
SimResult simulate(PipeSchedule kind, int P, int M, int V) {
  std::vector<std::vector<PipeAction>> acts;
  for (int r = 0; r < P; ++r) acts.push_back(pipeline_actions(kind, P, r, M, V));
  const int S = P * V;
  // finish time of (fwd?, virtual stage, micro)
  std::map<std::tuple<int, int, int>, double> done;
  std::vector<size_t> next(size_t(P), 0);
  std::vector<double> t(size_t(P), 0);
  const double f = 1.0 / V, b = 2.0 / V;
  SimResult res;
  res.busy = M * V * (f + b);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      if (next[size_t(r)] == acts[size_t(r)].size()) continue;
      const PipeAction& a = acts[size_t(r)][next[size_t(r)]];
      const int k = a.chunk * P + r;
      const bool fwd = a.kind == PipeAction::Forward;
      double ready = 0;
      if (fwd && k > 0) {
        auto it = done.find({1, k - 1, a.micro});
        if (it == done.end()) continue;
        ready = it->second;
      }
      if (!fwd) {
        auto own = done.find({1, k, a.micro});
        REQUIRE_MESSAGE(own != done.end(), "rank " << r << ": backward of micro " << a.micro << " chunk " << a.chunk
                                                   << " before its forward");
        if (k < S - 1) {
          auto it = done.find({0, k + 1, a.micro});
          if (it == done.end()) continue;
          ready = it->second;
        }
      }
      const double start = std::max(t[size_t(r)], ready);
      t[size_t(r)] = start + (fwd ? f : b);
      REQUIRE_MESSAGE(done.emplace(std::tuple{fwd ? 1 : 0, k, a.micro}, t[size_t(r)]).second,
                      "rank " << r << " runs micro " << a.micro << " chunk " << a.chunk << " twice");
      ++next[size_t(r)];
      progress = true;
    }
  }
  res.finished = true;
  for (int r = 0; r < P; ++r) res.finished = res.finished && next[size_t(r)] == acts[size_t(r)].size();
  CHECK(int(done.size()) == 2 * S * M);
  res.makespan = *std::max_element(t.begin(), t.end());
  return res;
}

}  // namespace

TEST_CASE("pipeline schedules: 1F1B GPipe and interleaved orderings with in-flight bounds and bubble") {
  struct Shape {
    PipeSchedule kind;
    int P, M, V;
  };
  std::vector<Shape> shapes;
  for (int P : {2, 3, 4})
    for (int M : {1, 2, 4, 8}) {
      shapes.push_back({PipeSchedule::OneFOneB, P, M, 1});
      shapes.push_back({PipeSchedule::GPipe, P, M, 1});
    }
  for (int P : {2, 4})
    for (int V : {2, 3})
      for (int M : {P, 2 * P, 4 * P}) shapes.push_back({PipeSchedule::Interleaved, P, M, V});
  for (const Shape& s : shapes) {
    INFO("schedule " << int(s.kind) << " P " << s.P << " M " << s.M << " V " << s.V);
    for (int r = 0; r < s.P; ++r) {
      const auto acts = pipeline_actions(s.kind, s.P, r, s.M, s.V);
      REQUIRE(int(acts.size()) == 2 * s.M * s.V);
      int in_flight = 0, most = 0;
      for (const PipeAction& a : acts) {
        in_flight += a.kind == PipeAction::Forward ? 1 : -1;
        most = std::max(most, in_flight);
      }
      CHECK(in_flight == 0);
      if (s.kind == PipeSchedule::OneFOneB) CHECK(most == std::min(s.P - r, s.M));
      if (s.kind == PipeSchedule::GPipe) CHECK(most == s.M);
      if (s.kind == PipeSchedule::Interleaved)
        CHECK(most == std::min((s.P - r - 1) * 2 + (s.V - 1) * s.P + 1, s.M * s.V));
    }
    const SimResult sim = simulate(s.kind, s.P, s.M, s.V);
    REQUIRE_MESSAGE(sim.finished, "the schedule deadlocks");
    const double bubble = (sim.makespan - sim.busy) / sim.busy;
    CHECK(bubble == doctest::Approx(pipeline_bubble_theory(s.kind, s.P, s.M, s.V)).epsilon(1e-9));
  }
}

TEST_CASE("pipeline schedules: the interleaved order is Megatron's (P=2 V=2 M=4)") {
  using A = PipeAction;
  const auto F = A::Forward, B = A::Backward;
  // rank 0: 4 warm-up forwards ((P-1)*2 + (V-1)*P), then 1F1B over virtual micro-batches
  const std::vector<A> r0 = {{F, 0, 0}, {F, 1, 0}, {F, 0, 1}, {F, 1, 1}, {F, 2, 0}, {B, 0, 1}, {F, 3, 0}, {B, 1, 1},
                             {F, 2, 1}, {B, 0, 0}, {F, 3, 1}, {B, 1, 0}, {B, 2, 1}, {B, 3, 1}, {B, 2, 0}, {B, 3, 0}};
  CHECK(pipeline_actions(PipeSchedule::Interleaved, 2, 0, 4, 2) == r0);
  // rank 1: 2 warm-up forwards
  const std::vector<A> r1 = {{F, 0, 0}, {F, 1, 0}, {F, 0, 1}, {B, 0, 1}, {F, 1, 1}, {B, 1, 1}, {F, 2, 0}, {B, 0, 0},
                             {F, 3, 0}, {B, 1, 0}, {F, 2, 1}, {B, 2, 1}, {F, 3, 1}, {B, 3, 1}, {B, 2, 0}, {B, 3, 0}};
  CHECK(pipeline_actions(PipeSchedule::Interleaved, 2, 1, 4, 2) == r1);
}

TEST_CASE("pipeline schedules: stage layers balanced by cost or given and bad ones refused") {
  CHECK(pipeline_stage_layers(4, 2, {}, 0, 0) == std::vector<int>{2, 2});
  CHECK(pipeline_stage_layers(8, 4, {}, 0, 0) == std::vector<int>{2, 2, 2, 2});
  // a costly head moves blocks to the first stage
  CHECK(pipeline_stage_layers(6, 2, {}, 0, 2) == std::vector<int>{4, 2});
  CHECK(pipeline_stage_layers(5, 2, {3, 2}, 0, 0) == std::vector<int>{3, 2});
  CHECK_THROWS_WITH_AS(pipeline_stage_layers(5, 2, {3, 3}, 0, 0), doctest::Contains("sums to 6"), UserError);
  CHECK_THROWS_WITH_AS(pipeline_stage_layers(5, 2, {5}, 0, 0), doctest::Contains("1 entries"), UserError);
  CHECK_THROWS_WITH_AS(pipeline_stage_layers(1, 2, {}, 0, 0), doctest::Contains("model.n_layer = 1"), UserError);
  CHECK_THROWS_AS(parse_pipe_schedule("zigzag", 1), UserError);
  CHECK_THROWS_AS(parse_pipe_schedule("gpipe", 2), UserError);
  CHECK(parse_pipe_schedule("1f1b", 2) == PipeSchedule::Interleaved);
}

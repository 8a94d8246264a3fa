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
// and the interleaved ordering equals Megatron's for P=2, V=2, M=4. Each rank's point-to-point
// plan (pipeline_p2p_plan) is played by NCCL's rules - one group at a time per rank, the k-th
// send from a to b paired with the k-th receive on b from a - for every schedule, P <= 8 and
// M <= 16: none hangs or pairs two different messages, while the old way of posting every
// receive first hangs at once.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <tuple>

#include <fmt/format.h>

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

namespace {

// Plays every rank's groups by NCCL's rules: a rank's groups run one at a time, in order (its
// actions between them are instant); an operation completes when its partner - the k-th send
// from a to b for the k-th receive on b from a - is in the group its rank is running; a group
// ends when all its operations have. Returns "" when every rank finished, else what went wrong
// (a hang: the groups each rank is stuck in; a mis-pair: the two messages).
std::string play_nccl(const std::vector<std::vector<std::vector<PipeMessage>>>& ranks) {
  const int P = int(ranks.size());
  struct Op {
    PipeMessage m;
    int k = 0;  // index in its direction
    bool done = false;
  };
  std::vector<std::vector<std::vector<Op>>> g(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    std::map<std::pair<bool, int>, int> count;
    for (const auto& group : ranks[size_t(r)]) {
      std::vector<Op> ops;
      for (const auto& m : group) ops.push_back({m, count[{m.send, m.peer}]++, false});
      g[size_t(r)].push_back(std::move(ops));
    }
  }
  std::vector<size_t> cur(size_t(P), 0);
  auto settle = [&](int r) {
    while (cur[size_t(r)] < g[size_t(r)].size() &&
           std::all_of(g[size_t(r)][cur[size_t(r)]].begin(), g[size_t(r)][cur[size_t(r)]].end(),
                       [](const Op& o) { return o.done; }))
      ++cur[size_t(r)];
  };
  for (int r = 0; r < P; ++r) settle(r);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      if (cur[size_t(r)] == g[size_t(r)].size()) continue;
      for (Op& o : g[size_t(r)][cur[size_t(r)]]) {
        const int q = o.m.peer;
        if (o.done || cur[size_t(q)] == g[size_t(q)].size()) continue;
        for (Op& p : g[size_t(q)][cur[size_t(q)]]) {
          if (p.done || p.m.send == o.m.send || p.m.peer != r || p.k != o.k) continue;
          if (p.m.kind != o.m.kind || p.m.stage != o.m.stage || p.m.micro != o.m.micro)
            return fmt::format("mis-pair: rank {} '{}' with rank {} '{}'", r, o.m.what(), q, p.m.what());
          o.done = p.done = progress = true;
        }
      }
      settle(r);
    }
  }
  std::string stuck;
  for (int r = 0; r < P; ++r)
    if (cur[size_t(r)] < g[size_t(r)].size()) stuck += fmt::format(" rank {} in group {};", r, cur[size_t(r)]);
  return stuck.empty() ? "" : "hang:" + stuck;
}

}  // namespace

TEST_CASE("pipeline schedules: every p2p plan runs under NCCL's rules without a hang or a mis-pair") {
  int played = 0;
  for (PipeSchedule kind : {PipeSchedule::GPipe, PipeSchedule::OneFOneB, PipeSchedule::Interleaved})
    for (int P = 2; P <= 8; ++P)
      for (int V : kind == PipeSchedule::Interleaved ? std::vector<int>{2, 3, 4} : std::vector<int>{1})
        for (int M = 1; M <= 16; ++M) {
          if (kind == PipeSchedule::Interleaved && M % P != 0) continue;
          CAPTURE(int(kind));
          CAPTURE(P);
          CAPTURE(V);
          CAPTURE(M);
          std::vector<std::vector<std::vector<PipeMessage>>> ranks;
          for (int r = 0; r < P; ++r) {
            const auto plan = pipeline_p2p_plan(kind, P, r, M, V);
            const auto acts = pipeline_actions(kind, P, r, M, V);
            std::vector<int> seen;
            std::vector<std::vector<PipeMessage>> groups;
            for (const auto& st : plan) {
              groups.push_back(st.group);
              seen.insert(seen.end(), st.actions.begin(), st.actions.end());
            }
            std::vector<int> all(acts.size());
            for (size_t i = 0; i < all.size(); ++i) all[i] = int(i);
            REQUIRE(seen == all);  // every action once, in the schedule's order
            ranks.push_back(std::move(groups));
          }
          const std::string why = play_nccl(ranks);
          CHECK_MESSAGE(why.empty(), why);
          ++played;
        }
  CHECK(played > 300);
}

TEST_CASE("pipeline schedules: posting every receive of the step first hangs under NCCL's rules") {
  // What Pipeline::train did before: each receive its own group, all posted at the start of
  // the step in the order the actions need them, each send its own group after its action.
  const int P = 2, M = 4;
  std::vector<std::vector<std::vector<PipeMessage>>> ranks;
  for (int r = 0; r < P; ++r) {
    std::vector<std::vector<PipeMessage>> groups;
    const auto plan = pipeline_p2p_plan(PipeSchedule::OneFOneB, P, r, M, 1);
    for (const auto& st : plan)
      for (const auto& m : st.group)
        if (!m.send) groups.push_back({m});
    for (const auto& st : plan)
      for (const auto& m : st.group)
        if (m.send) groups.push_back({m});
    ranks.push_back(std::move(groups));
  }
  const std::string why = play_nccl(ranks);
  CAPTURE(why);
  CHECK(why == "hang: rank 0 in group 0; rank 1 in group 0;");
}

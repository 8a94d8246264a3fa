#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace dtrain::parallel {

PipeSchedule parse_pipe_schedule(const std::string& name, int virtual_stages) {
  if (name == "gpipe") {
    if (virtual_stages > 1)
      user_error("parallel.schedule = \"gpipe\" does not interleave: parallel.virtual_stages = {} needs "
                 "parallel.schedule = \"1f1b\"", virtual_stages);
    return PipeSchedule::GPipe;
  }
  if (name == "1f1b") return virtual_stages > 1 ? PipeSchedule::Interleaved : PipeSchedule::OneFOneB;
  user_error("parallel.schedule: expected \"1f1b\" or \"gpipe\", got \"{}\"", name);
}

int pipeline_warmup(PipeSchedule kind, int P, int rank, int M, int V) {
  if (kind == PipeSchedule::GPipe) return M;
  if (kind == PipeSchedule::OneFOneB && V == 1) return std::min(P - rank - 1, M);
  return std::min((P - rank - 1) * 2 + (V - 1) * P, M * V);
}

std::vector<PipeAction> pipeline_actions(PipeSchedule kind, int P, int rank, int M, int V) {
  DTRAIN_CHECK(P >= 1 && rank >= 0 && rank < P && M >= 1 && V >= 1, "pipeline_actions: P {} rank {} M {} V {}", P,
               rank, M, V);
  std::vector<PipeAction> out;
  if (kind == PipeSchedule::GPipe || (kind == PipeSchedule::OneFOneB && V == 1)) {
    DTRAIN_CHECK(V == 1, "pipeline_actions: {} chunks without interleaving", V);
    const int warm = pipeline_warmup(kind, P, rank, M, V);
    int f = 0, b = 0;
    for (; f < warm; ++f) out.push_back({PipeAction::Forward, f, 0});
    while (f < M) {  // steady state: one forward, one backward
      out.push_back({PipeAction::Forward, f++, 0});
      out.push_back({PipeAction::Backward, b++, 0});
    }
    while (b < M) out.push_back({PipeAction::Backward, b++, 0});
    return out;
  }
  DTRAIN_CHECK(M % P == 0, "pipeline_actions: interleaved needs M {} divisible by P {}", M, P);
  const int total = M * V, group = P * V;
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % group) / P;
    return forward ? c : V - 1 - c;
  };
  auto micro_of = [&](int k) { return (k / group) * P + k % P; };
  const int warm = pipeline_warmup(kind, P, rank, M, V);
  int f = 0, b = 0;
  for (; f < warm; ++f) out.push_back({PipeAction::Forward, micro_of(f), chunk_of(f, true)});
  while (f < total) {
    out.push_back({PipeAction::Forward, micro_of(f), chunk_of(f, true)});
    ++f;
    out.push_back({PipeAction::Backward, micro_of(b), chunk_of(b, false)});
    ++b;
  }
  for (; b < total; ++b) out.push_back({PipeAction::Backward, micro_of(b), chunk_of(b, false)});
  return out;
}

std::string PipeMessage::what() const {
  return fmt::format("{} of micro-batch {} for virtual stage {}", kind == Activations ? "activations" : "gradients", micro,
                     stage);
}

std::vector<PipeStep> pipeline_p2p_plan(PipeSchedule kind, int P, int rank, int M, int V) {
  const std::vector<PipeAction> acts = pipeline_actions(kind, P, rank, M, V);
  const int S = P * V, prev = (rank + P - 1) % P, next = (rank + 1) % P;
  using K = PipeMessage::Kind;
  auto input = [&](const PipeAction& a, std::vector<PipeMessage>& g) {  // what the action receives
    const int k = a.chunk * P + rank;
    if (a.kind == PipeAction::Forward && k > 0) g.push_back({false, prev, K::Activations, k, a.micro});
    if (a.kind == PipeAction::Backward && k < S - 1) g.push_back({false, next, K::Gradients, k, a.micro});
  };
  auto output = [&](const PipeAction& a, std::vector<PipeMessage>& g) {  // what it sends
    const int k = a.chunk * P + rank;
    if (a.kind == PipeAction::Forward && k < S - 1) g.push_back({true, next, K::Activations, k + 1, a.micro});
    if (a.kind == PipeAction::Backward && k > 0) g.push_back({true, prev, K::Gradients, k - 1, a.micro});
  };
  // the steps: warm-up forwards alone, then each forward with the backward after it, then the rest alone
  std::vector<std::vector<int>> steps;
  const int warm = pipeline_warmup(kind, P, rank, M, V), n = int(acts.size());
  for (int i = 0; i < n;) {
    const bool pair = i >= warm && i + 1 < n && acts[size_t(i)].kind == PipeAction::Forward &&
                      acts[size_t(i + 1)].kind == PipeAction::Backward;
    steps.push_back(pair ? std::vector<int>{i, i + 1} : std::vector<int>{i});
    i += pair ? 2 : 1;
  }
  std::vector<PipeStep> plan;
  for (size_t j = 0; j <= steps.size(); ++j) {
    PipeStep st;
    if (j > 0)
      for (int i : steps[j - 1]) output(acts[size_t(i)], st.group);
    if (j < steps.size()) {
      for (int i : steps[j]) input(acts[size_t(i)], st.group);
      st.actions = steps[j];
    }
    plan.push_back(std::move(st));
  }
  return plan;
}

double pipeline_bubble_theory(PipeSchedule kind, int P, int M, int V) {
  return double(P - 1) / (double(M) * (kind == PipeSchedule::Interleaved ? V : 1));
}

std::vector<int> pipeline_stage_layers(int n_layer, int S, const std::vector<int64_t>& given, double embed_cost,
                                       double head_cost) {
  if (!given.empty()) {
    if (int(given.size()) != S)
      user_error("parallel.stage_layers has {} entries, but parallel.pipeline x parallel.virtual_stages = {} stages",
                 given.size(), S);
    int64_t sum = 0;
    for (int64_t v : given) {
      if (v < 1) user_error("parallel.stage_layers: every stage needs at least one block, got {}", v);
      sum += v;
    }
    if (sum != n_layer)
      user_error("parallel.stage_layers sums to {}, but model.n_layer = {}", sum, n_layer);
    return std::vector<int>(given.begin(), given.end());
  }
  if (n_layer < S)
    user_error("model.n_layer = {} is below the {} pipeline stages (parallel.pipeline x parallel.virtual_stages): "
               "every stage needs at least one block", n_layer, S);
  // best[s][l]: the smallest possible largest cost of stages 0..s holding blocks [0, l)
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(S), std::vector<double>(size_t(n_layer + 1), inf));
  std::vector<std::vector<int>> cut(size_t(S), std::vector<int>(size_t(n_layer + 1), 0));
  auto cost = [&](int s, int n) { return double(n) + (s == 0 ? embed_cost : 0) + (s == S - 1 ? head_cost : 0); };
  for (int l = 1; l <= n_layer; ++l) best[0][size_t(l)] = cost(0, l);
  for (int s = 1; s < S; ++s)
    for (int l = s + 1; l <= n_layer; ++l)
      for (int k = s; k < l; ++k) {  // stages 0..s-1 hold [0, k), stage s holds [k, l)
        const double v = std::max(best[size_t(s - 1)][size_t(k)], cost(s, l - k));
        if (v < best[size_t(s)][size_t(l)]) {
          best[size_t(s)][size_t(l)] = v;
          cut[size_t(s)][size_t(l)] = k;
        }
      }
  std::vector<int> out(static_cast<size_t>(S));
  int l = n_layer;
  for (int s = S - 1; s > 0; --s) {
    const int k = cut[size_t(s)][size_t(l)];
    out[size_t(s)] = l - k;
    l = k;
  }
  out[0] = l;
  return out;
}

}  // namespace dtrain::parallel

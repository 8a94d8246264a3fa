#include "session/step_graph.h"

#include "core/error.h"

namespace dtrain {
namespace {

bool same_inputs(const std::vector<Tensor>& had, std::initializer_list<Tensor> now) {
  if (had.size() != now.size()) return false;
  auto it = had.begin();
  for (const Tensor& t : now) {
    if (t.data != it->data || t.dtype != it->dtype || !(t.shape == it->shape)) return false;
    ++it;
  }
  return true;
}

// Device memory a graph may point into was given back (or a workspace re-allocated).
bool freed_since(const AllocCounts& then, const AllocCounts& now) {
  return now.frees != then.frees || now.internal != then.internal || now.system_frees != then.system_frees;
}

}  // namespace

void StepGraphs::run(Backend& be, StepTimer& tm, ParamStore& ps, int64_t micro, std::initializer_list<Tensor> inputs,
                     const std::function<void()>& body) {
  Entry& e = entries_[micro];
  const AllocCounts before = be.alloc_counts();
  const bool same = same_inputs(e.inputs, inputs);
  if (e.graph && (!same || freed_since(e.at_capture, before))) {
    e.graph.reset();
    e.steady = false;
  }
  if (e.graph) {
    tm.replayed(e.marks);
    e.graph->launch();
    ps.add_counters(e.counter_delta);
    ++replays_;
    return;
  }
  if (!e.steady || !same) {
    body();
    e.inputs.assign(inputs);
    e.steady = be.alloc_counts() == before;
    return;
  }
  const std::vector<int64_t> counters = ps.counter_values();
  const StepTimer::Position pos = tm.position();
  be.capture_begin();
  try {
    body();
    e.graph = be.capture_end();
  } catch (const std::exception& ex) {
    be.capture_abort();
    fault("train.cuda_graph: capturing micro-batch {} failed: {} (set train.cuda_graph = false to run without "
          "graphs)",
          micro, ex.what());
  }
  e.marks = tm.recorded_since(pos);
  e.counter_delta = ps.counter_values();
  for (size_t i = 0; i < counters.size(); ++i) e.counter_delta[i] -= counters[i];
  e.at_capture = be.alloc_counts();
  e.graph->launch();  // the capture recorded the work without running it
  ++captures_;
}

}  // namespace dtrain

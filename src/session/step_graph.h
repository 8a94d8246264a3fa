#pragma once
// train.cuda_graph = true: the forward, loss and backward of each micro-batch index are
// captured once in a CUDA graph (Backend::capture_begin/end) and replayed in later steps,
// so the host no longer launches some thousand kernels per step and the device does not
// wait between them. What stays outside the graph, launched as before: loading and staging
// the batch, the compute-weight cast, zeroing the gradients, clipping and the optimizer
// (their scalars change every step: learning rate, bias corrections).
//
// A micro-batch index runs eagerly until one eager run of it allocated and freed no device
// memory (the first step plans the arena; the second is steady), is captured in the next
// step, and is replayed from then on while
//  * its staged inputs have the same addresses, dtypes and shapes (StagedBatch), and
//  * no device memory was freed or re-allocated since the capture (Backend::alloc_counts:
//    frees, internal): an evaluation or a grown workspace makes it capture again.
// Host effects the graph cannot replay are carried over: the batch-norm counters
// (num_batches_tracked) get the capture's increments, and the step timer the capture's
// marks (the graph's event nodes record the same events).
// Refused (exit 2, session/session.cpp) where replaying would be wrong: CPU, data parallel
// (collectives and their hooks run inside backward), fp16 (the loss scale changes).
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "nn/params.h"
#include "obs/step_timer.h"

namespace dtrain {

class StepGraphs {
 public:
  // Runs `body` (device work only: forward, loss, backward of micro-batch `micro`, which
  // reads the staged device tensors `inputs`) eagerly, by capturing it and launching the
  // graph, or by replaying the graph. be, tm, ps: the session's backend, step timer and
  // parameter store (its counters).
  void run(Backend& be, StepTimer& tm, ParamStore& ps, int64_t micro, std::initializer_list<Tensor> inputs,
           const std::function<void()>& body);
  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }

 private:
  struct Entry {
    std::vector<Tensor> inputs;  // of the last run: address, dtype and shape matter
    bool steady = false;  // the last eager run allocated and freed nothing
    std::unique_ptr<DeviceGraph> graph;
    AllocCounts at_capture;
    StepTimer::Recorded marks;
    std::vector<int64_t> counter_delta;
  };
  std::map<int64_t, Entry> entries_;
  int64_t captures_ = 0, replays_ = 0;
};

}  // namespace dtrain

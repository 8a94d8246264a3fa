#pragma once
// Checkpoints under pipeline parallelism in the universal layout (the one-process model's),
// so a run under any (data, tensor, pipeline) layout resumes under any other and on one
// process, and sample / eval / init_from read it as it is.
#include <vector>

#include "comm/communicator.h"
#include "nn/params.h"
#include "optim/optimizer.h"
#include "parallel/data_parallel.h"
#include "session/runtime.h"

namespace dtrain {

struct PipelineCheckpoint {
  const ParamStore* layout = nullptr;            // the full model's (declared only); null off rank 0
  std::vector<ParamStore::Exported> model;        // model.safetensors' tensors
  std::vector<ParamStore::Exported> optim;        // the optimizer state, universal flat layout
};

// The optimizer's state over this rank's whole local layout (ps.num_params() values per f32
// state): under ZeRO its pieces (ZeRO-1/2: a range; ZeRO-3: the unit shards), the other data
// ranks' added in (one all-reduce of each zero-filled state over `dp`, the group whose pieces
// make up the whole: DataParallel::state_comm); "step" as it is. Collective over dp under ZeRO.
std::vector<ParamStore::Exported> local_optimizer_state(Optimizer& opt, const ParamStore& ps, comm::Communicator& dp);

// Every stage's parameters and optimizer state (ZeRO: the data ranks' pieces put together;
// tensor parallel: the parts assembled) gathered on global rank 0, which gets them in the full
// model's layout; the other ranks get an empty result. Collective over every rank.
PipelineCheckpoint pipeline_gather_checkpoint(Runtime& s, Optimizer* opt, parallel::DataParallel& dp,
                                              comm::Communicator* tp);

}  // namespace dtrain

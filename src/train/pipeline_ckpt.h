#pragma once
// Checkpoints under pipeline parallelism in the universal layout (the one-process model's),
// so a run under any (data, tensor, pipeline) layout resumes under any other and on one
// process, and sample / eval / init_from read it as it is.
#include <vector>

#include "comm/communicator.h"
#include "nn/params.h"
#include "optim/optimizer.h"
#include "train/runtime.h"

namespace dtrain {

struct PipelineCheckpoint {
  const ParamStore* layout = nullptr;            // the full model's (declared only); null off rank 0
  std::vector<ParamStore::Exported> model;        // model.safetensors' tensors
  std::vector<ParamStore::Exported> optim;        // the optimizer state, universal flat layout
};

// Every stage's parameters and optimizer state (ZeRO-1: the data ranks' ranges put together;
// tensor parallel: the parts assembled) gathered on global rank 0, which gets them in the full
// model's layout; the other ranks get an empty result. Collective over every rank.
PipelineCheckpoint pipeline_gather_checkpoint(Runtime& s, Optimizer* opt, comm::Communicator& dp,
                                              comm::Communicator* tp);

}  // namespace dtrain

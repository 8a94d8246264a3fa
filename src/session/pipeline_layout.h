#pragma once
// The pipeline shape of a run (ParallelLayout::pipe, checked by check_pipeline in
// session/layout.h): stages, virtual stages, schedule, the blocks of each virtual stage and
// the tied parameter. P = 1: an empty layout (stages 1).
#include <string>
#include <vector>

#include "parallel/pipeline_schedule.h"

namespace dtrain {

struct PipelineLayout {
  int stages = 1;   // P
  int virtual_stages = 1;  // V
  parallel::PipeSchedule schedule = parallel::PipeSchedule::OneFOneB;
  std::vector<int> layers;  // blocks of each of the P*V virtual stages
  std::string tied;         // the parameter the first and last stage share (gpt_tied_param), or ""
};

}  // namespace dtrain

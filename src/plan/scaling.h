#pragma once
// `dtrain bench --predict-scaling`: an alpha-beta model of data-parallel step time.
//
//   ring allreduce over n GPUs on one link:  2(n-1) alpha + 2(n-1)/n * bytes / beta
//   n > gpus_per_node (hierarchical): reduce-scatter inside each node over the intra link
//     ((g-1) alpha + (g-1)/g * bytes / beta), ring allreduce of the 1/g shard across the
//     n/g nodes over the inter link, allgather inside the node (same cost as the
//     reduce-scatter).
//   backward = backward_share * step_compute, exposed comm = max(0, comm - overlap_fraction *
//   backward), step = step_compute + exposed, efficiency = step_compute / step.
// Weak scaling: the per-GPU batch, hence step_compute, stays the same at every size.
// beta is the per-GPU bus bandwidth (what nccl-tests calls busbw), in bytes/s.
#include <string>
#include <vector>

#include "comm/collective_bench.h"

namespace dtrain::parallel {

using comm::CollectiveRow;

struct ScalingInputs {
  std::string name;
  double step_compute_s = 0;     // one GPU's step, no communication
  double grad_bytes = 0;         // bytes allreduced per step
  double overlap_fraction = 0.6; // share of backward that can hide communication
  double backward_share = 0.6;   // backward's share of step_compute
};

struct LinkModel {
  std::string name;
  double alpha_s = 0;            // per-message latency
  double beta_bytes_per_s = 0;   // per-GPU bus bandwidth
};

LinkModel nvlink_h100();  // NVSwitch inside an H100 node: 450 GB/s, 5 us (spec-sheet values)
LinkModel ib_400g();      // 400 Gb/s InfiniBand, one NIC per GPU: 50 GB/s, 10 us (spec)

double ring_allreduce_s(double bytes, int n, const LinkModel& link);
// Flat ring over `link` for n <= gpus_per_node; hierarchical (intra inside nodes, `link`
// across nodes) above. UserError when n > gpus_per_node is not a multiple of it.
double allreduce_s(double bytes, int n, const LinkModel& link, const LinkModel& intra, int gpus_per_node = 8);

struct ScalingPoint {
  int gpus = 0;
  double comm_s = 0, exposed_s = 0, step_s = 0, efficiency = 1;
};
ScalingPoint predict_point(const ScalingInputs& in, int gpus, const LinkModel& link, const LinkModel& intra,
                           int gpus_per_node = 8);

// Least-squares fit of alpha and beta to measured ring-allreduce times (bytes, seconds)
// of an n-rank job: t = a + b * bytes, alpha = a / (2(n-1)), beta = 2(n-1)/n / b.
// alpha is clamped at 0 if the intercept comes out negative. UserError (naming `what`)
// with fewer than two distinct sizes, n < 2, or a non-positive slope.
LinkModel fit_link(const std::vector<std::pair<double, double>>& bytes_seconds, int n, const std::string& name,
                   const std::string& what = "measurements");
// Uses the allreduce rows of a collective-benchmark output.
LinkModel fit_link_from_rows(const std::vector<CollectiveRow>& rows, int n, const std::string& name,
                             const std::string& what);

// One block per recipe: per link, step time / exposed comm / efficiency at each GPU count.
std::string predict_scaling_table(const std::vector<ScalingInputs>& inputs, const std::vector<LinkModel>& links,
                                  const std::vector<int>& gpus = {8, 64, 512});

// The measured default recipe: ResNet-50, batch 128, fp32/TF32 on one H100 (docs/benchmarks.md).
ScalingInputs resnet50_h100_measured();

// "name:step_s:grad_bytes[:backward_share[:overlap_fraction]]"; UserError naming the entry.
ScalingInputs parse_scaling_entry(const std::string& entry);

}  // namespace dtrain::parallel

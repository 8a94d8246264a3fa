#pragma once
// Sequence parallelism (parallel.sequence = true, on top of parallel.tensor = T; Megatron-LM,
// Korthikanti et al. 2022). Between the tensor-parallel regions (the layer norms and the
// residual adds) each rank holds only its block of the activation rows: the [B, T, C]
// activations flattened to [B*T, C] rows, rank r holding the contiguous rows
// [r*N/T, (r+1)*N/T) of N = B*T (blocks of the flattened batch, not a slice of every
// sequence: attention runs inside the tensor-parallel region on the gathered full rows, so
// only row-wise ops ever see a block). A column-parallel layer all-gathers its input rows
// (backward: reduce-scatter of the input gradient), a row-parallel layer reduce-scatters its
// partial products (backward: all-gather of the output gradient): the all-reduce of plain
// tensor parallelism split into its two halves, the same bytes on the wire.
#include "nn/module.h"

namespace dtrain {

// rows [n, C...] of every rank concatenated in rank order: [T*n, C...] (f32, bf16 or f16)
Tensor sp_gather_rows(Ctx& ctx, const Tensor& shard);
// full [N, C...] partial sums of every rank -> this rank's block [N/T, C...] of their sum (f32, bf16 or f16), in
// `out` (default: ctx.arena)
Tensor sp_scatter_rows(Ctx& ctx, const Tensor& full, Arena* out = nullptr);

}  // namespace dtrain

#pragma once
// The fixed chunk partition of the CPU backend's column reductions (cpu::chunk_rows), for its
// sources built with OpenMP: the chunks' partial sums run in parallel and the caller combines
// them serially in chunk order, so results do not depend on the thread count.
#include <algorithm>
#include <cstdint>

#include "backend/cpu/cpu_backend.h"

namespace dtrain::cpu {

// Partial column sums of M rows over the partition of rows of C values: chunk c's W partials
// part[c * W, (c + 1) * W) are zeroed, then add_row(r, partials) adds each of its rows r in
// order. part holds (number of chunks) * W doubles; returns the number of chunks.
template <typename AddRow>
int64_t chunk_partials(int64_t M, int64_t C, int64_t W, double* part, AddRow add_row) {
  const int64_t R = chunk_rows(C), nchunks = (M + R - 1) / R;
#pragma omp parallel for schedule(static) if (nchunks > 1)
  for (int64_t c = 0; c < nchunks; ++c) {
    double* acc = part + c * W;
    for (int64_t j = 0; j < W; ++j) acc[j] = 0;
    const int64_t e = std::min(M, (c + 1) * R);
    for (int64_t r = c * R; r < e; ++r) add_row(r, acc);
  }
  return nchunks;
}

}  // namespace dtrain::cpu

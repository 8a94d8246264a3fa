#pragma once
// `dtrain bench --collectives`: an nccl-tests-style sweep of allreduce, reduce_scatter and
// allgather over the job's Communicator (Gloo on CPU, NCCL on CUDA).
//
// Sizes run from min_bytes to max_bytes, multiplying by step_factor; elements are f32.
// As in nccl-tests, `size` is the full buffer of one rank: the allreduce buffer, the
// reduce_scatter input (n shards) and the allgather output (n shards).
//   algbw = size / time
//   busbw = algbw * factor, factor = 2(n-1)/n for allreduce, (n-1)/n for reduce_scatter
//           and allgather (0 in a one-process world)
// Each (op, size) runs `warmup` untimed calls, a barrier, then `iters` timed calls enqueued
// back to back (async) and waited for together; time is the mean per call. #wrong counts the elements (summed over ranks) that differ from the
// exact expected result of a separate checked call: inputs are small integers that depend
// on rank and index, so every correct sum is exact in f32. allreduce and allgather run in
// place; reduce_scatter writes a separate shard buffer.
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {
class Backend;
}

namespace dtrain::comm {

class Communicator;

struct CollectiveBenchArgs {
  std::string device = "cpu";  // "cpu" (Gloo) | "cuda" (NCCL; the worker's LOCAL_RANK GPU)
  int64_t min_bytes = 8, max_bytes = 64 << 20;
  int step_factor = 2;
  int iters = 20, warmup = 5;
  std::vector<std::string> ops = {"allreduce", "reduce_scatter", "allgather"};
  double timeout_s = 60;
  int nproc_per_node = 1;  // > 1 outside a launched job: launch that many workers
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string csv;  // when set, rank 0 also writes the rows as CSV here
};

struct CollectiveRow {
  int64_t bytes = 0, count = 0;  // full buffer size in bytes and f32 elements
  std::string op;
  double time_us = 0, algbw_gbs = 0, busbw_gbs = 0;
  int64_t wrong = 0;
};

// nccl-tests' bus-bandwidth factor of `op` for n ranks (0 when n <= 1).
double busbw_factor(const std::string& op, int n);

// The element counts swept, as nccl-tests does: count = bytes / 4 rounded down to a
// multiple of n (so shards are equal), at least n; duplicates removed.
std::vector<int64_t> sweep_counts(int64_t min_bytes, int64_t max_bytes, int step_factor, int n);

// Runs the sweep on an existing communicator (every rank must call it with the same
// args). `be` owns the buffers (CPU or the communicator's CUDA device). Every rank gets the
// rows; #wrong is summed over ranks.
std::vector<CollectiveRow> run_collective_bench(const CollectiveBenchArgs& a, Communicator& comm,
                                                Backend& be);

// The nccl-tests-like table (a "#" header naming backend and ranks, then one row per line:
// size count type op time_us algbw busbw #wrong).
std::string format_collective_table(const std::vector<CollectiveRow>& rows, int nranks,
                                    const std::string& backend);
std::string format_collective_csv(const std::vector<CollectiveRow>& rows, int nranks,
                                  const std::string& backend);

// Parses the table or the CSV above (rows whose first field is an integer; "# nranks N"
// or the CSV's nranks column gives the world size). UserError naming `source` on rows
// that do not parse.
std::vector<CollectiveRow> parse_collective_output(const std::string& text, const std::string& source,
                                                   int* nranks);

// UserError for a device, launcher size, sweep or op that the benchmark cannot run.
void validate_collective_args(const CollectiveBenchArgs& a);

// One rank of the benchmark: joins the job of its environment (or forms a one-process world
// with a private store), runs the sweep, and rank 0 prints the table to stdout (and the CSV
// to a.csv). Returns 0, or 1 when any row has #wrong > 0.
int collective_bench_job(const CollectiveBenchArgs& a);

}  // namespace dtrain::comm

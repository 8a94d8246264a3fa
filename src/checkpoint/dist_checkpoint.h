#pragma once
// A checkpoint written by every rank of a data-parallel run into one directory. Collective:
// every rank calls it at the same step.
//   1. rank 0 creates the temporary directory (CheckpointManager::begin) and shares its
//      path through the store;
//   2. every rank writes its own files into it (with ZeRO: its optimizer shard; with ZeRO-3
//      also its model shard, and with hybrid sharding only the first shard group's ranks
//      write, the others nothing), fsynced;
//   3. every rank reports success or its error through the store and rank 0 waits for all
//      of them: one failure fails the checkpoint on EVERY rank with the same one-line
//      RuntimeFault naming the rank and the file; the temporary directory is removed and the
//      checkpoints already saved are not touched;
//   4. rank 0 writes its files (state.json, model.safetensors unless ZeRO-3, ...) and commits: SHA256SUMS
//      over all files of all ranks, fsync, rename into place, `latest` (checkpoint.h);
//   5. rank 0 shares the outcome; the other ranks return only then (or throw its error), and
//      rank 0 returns once every rank has read it (outside dtrain's launcher rank 0 hosts
//      the store, so it must not exit while another rank still waits on it).
// The store waits use parallel.timeout_s: it must cover writing one checkpoint.
// The run directory must be on a file system every rank sees (one machine, or a shared
// file system across nodes), as torch.distributed.checkpoint and DeepSpeed require.
#include <cstdint>
#include <functional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "session/dist_setup.h"

namespace dtrain {

struct DistSaveResult {
  std::string path;    // the committed checkpoint directory (every rank)
  uint64_t bytes = 0;  // bytes written by all ranks together
};

// `my_file`: the names of the files this rank writes with `write_mine`, for messages ("a and
// b"; empty and write_mine null when it writes nothing); `write_lead`: rank 0's files, written once every
// rank succeeded. Both return the bytes they wrote. keep_last as CheckpointManager::save.
// Failpoint checkpoint.write_fail=RANK:STEP makes that rank's write fail (a directory is put
// where its file should go), exercising the failure path with a real I/O error.
// commit_later (checkpoint.async; rank 0's matters): instead of committing in step 4, rank 0
// hands the temporary directory, every rank's files written and fsynced, to it (which starts
// the commit on a background thread) and every rank returns with an empty path. A commit
// that then fails stops rank 0 at its next save or at the end; the other ranks see it gone.
DistSaveResult save_checkpoint_collective(
    DistRuntime& d, CheckpointManager& cm, int64_t step, int keep_last, const std::string& my_file,
    const std::function<uint64_t(const std::string& tmpdir)>& write_mine,
    const std::function<uint64_t(const std::string& tmpdir)>& write_lead,
    const std::function<void(const std::string& tmpdir, uint64_t bytes)>& commit_later = nullptr);

}  // namespace dtrain

#include "checkpoint/dist_checkpoint.h"

#include <cstdlib>
#include <vector>

#include "core/error.h"
#include "core/failpoint.h"
#include "core/fsutil.h"

namespace dtrain {

namespace {

// Store values: "ok:<payload>" or "error:<one-line message>".
std::string ok(const std::string& payload) { return "ok:" + payload; }
std::string err(const std::string& message) { return "error:" + message; }
bool is_ok(const std::string& v) { return v.rfind("ok:", 0) == 0; }
std::string payload(const std::string& v) { return v.substr(v.find(':') + 1); }

// failpoint checkpoint.write_fail=RANK:STEP
bool injected_failure(int rank, int64_t step) {
  return failpoint::hits(failpoint::Point::CheckpointWrite, rank, step);
}

// A failed checkpoint's temporary directory: removed if possible (a leftover is harmless:
// readers ignore .tmp-* and the next save of a later process deletes it).
void discard(const std::string& tmp) {
  try {
    fs::remove_tree(tmp);
  } catch (const Error&) {
  }
}

}  // namespace

DistSaveResult save_checkpoint_collective(DistRuntime& d, CheckpointManager& cm, int64_t step, int keep_last,
                                          const std::string& my_file,
                                          const std::function<uint64_t(const std::string&)>& write_mine,
                                          const std::function<uint64_t(const std::string&)>& write_lead,
                                          const std::function<void(const std::string&, uint64_t)>& commit_later) {
  const int rank = d.env.rank, world = d.env.world_size;
  const std::string base = "ckpt/" + std::to_string(d.saves++) + "/";
  const std::string what = fmt::format("checkpoint {}", CheckpointManager::dir_name(step));

  // Rank 0's verdicts: every other rank acknowledges having read one, and rank 0 waits for
  // that before it goes on (or exits), since outside dtrain's launcher rank 0 hosts the store.
  auto read_verdict = [&](const std::string& stage) {
    std::string v = d.store->get_string(d.key(base + stage));
    d.store->set(d.key(base + stage + "/ack/" + std::to_string(rank)), "1");
    return v;
  };
  auto wait_acks = [&](const std::string& stage) {
    std::vector<std::string> keys;
    for (int r = 1; r < world; ++r) keys.push_back(d.key(base + stage + "/ack/" + std::to_string(r)));
    d.store->wait(keys);
  };
  // A failure known to rank 0: published, acknowledged (as far as the others are alive), thrown.
  auto fail = [&](const std::string& stage, const std::string& message) {
    d.store->set(d.key(base + stage), err(message));
    try {
      wait_acks(stage);
    } catch (const Error&) {
      // a rank that is gone cannot acknowledge: the failure itself is what to report
    }
    throw RuntimeFault(message);
  };

  // 1. the temporary directory, named by rank 0 (its pid marks it as in use)
  std::string tmp;
  if (rank == 0) {
    try {
      tmp = cm.begin(step);
    } catch (const Error& e) {
      fail("tmp", fmt::format("{} failed: rank 0 could not create its directory: {}", what, e.what()));
    }
    d.store->set(d.key(base + "tmp"), ok(tmp));
  } else {
    std::string v = read_verdict("tmp");
    if (!is_ok(v)) throw RuntimeFault(payload(v));
    tmp = payload(v);
  }

  // 2. this rank's own file, fsynced by its writer; 3. its outcome into the store
  uint64_t bytes = 0;
  std::string mine = ok("0");
  if (write_mine) {
    try {
      // the open of its (first) file fails (EISDIR); my_file may name several ("a and b")
      if (injected_failure(rank, step)) fs::mkdirs(tmp + "/" + my_file.substr(0, my_file.find(" and ")));
      bytes = write_mine(tmp);
      mine = ok(std::to_string(bytes));
    } catch (const Error& e) {
      mine = err(fmt::format("{} failed: rank {} could not write {}: {}", what, rank, my_file, e.what()));
    }
  }
  d.store->set(d.key(base + "part/" + std::to_string(rank)), mine);

  if (rank != 0) {
    // 5. rank 0's verdict (it waited for every rank and committed)
    std::string v = read_verdict("done");
    if (!is_ok(v)) throw RuntimeFault(payload(v));
    return DistSaveResult{payload(v), 0};
  }

  std::string failure;
  bytes = 0;  // every rank's count, rank 0's own included, comes from the store
  for (int r = 0; r < world; ++r) {
    std::string v = d.store->get_string(d.key(base + "part/" + std::to_string(r)));
    if (!is_ok(v)) {
      if (failure.empty()) failure = payload(v);
    } else {
      bytes += std::strtoull(payload(v).c_str(), nullptr, 10);
    }
  }
  if (!failure.empty()) discard(tmp);  // nothing of it was committed
  DistSaveResult res;
  if (failure.empty()) {
    // 4. rank 0's files, then the commit over every rank's files
    try {
      bytes += write_lead(tmp);
    } catch (const Error& e) {
      failure = fmt::format("{} failed: rank 0 could not write its files: {}", what, e.what());
      discard(tmp);
    }
  }
  if (failure.empty()) {
    try {
      if (commit_later)
        commit_later(tmp, bytes);  // res.path stays empty: committed on another thread
      else
        res.path = cm.commit(step, tmp, keep_last);
      res.bytes = bytes;
    } catch (const Error& e) {
      failure = fmt::format("{} failed: rank 0 could not commit it: {}", what, e.what());
    }
  }
  if (!failure.empty()) fail("done", failure);
  d.store->set(d.key(base + "done"), ok(res.path));
  wait_acks("done");  // nobody runs ahead, and the store outlives every read
  return res;
}

}  // namespace dtrain

#pragma once
// Failpoints: named places in the product where a test (or a user reproducing a fault) makes
// dtrain misbehave on purpose, in the manner of etcd's gofail and TiKV's fail-rs. They are a
// documented feature (docs/failpoints.md), armed only through one environment variable:
//
//   DTRAIN_FAILPOINTS="name=ARG;name=ARG"      e.g. DTRAIN_FAILPOINTS="train.stop_at_step=5"
//
// Every failpoint is listed once, in kFailpoints (failpoint.cpp), with its argument form and
// what it does; `dtrain info --failpoints` prints the list. An unknown name or a malformed
// argument is a user error (exit 2) naming the variable. Cost when unarmed: one load of a
// bool that is false (the variable is parsed once, at the first query).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::failpoint {

enum class Point {
  StopAtStep,      // train.stop_at_step=N: the trainer acts as on SIGTERM after step N
  SlowStep,        // train.slow_step=RANK:MS: that rank sleeps MS in every step
  CheckpointWrite, // checkpoint.write_fail=RANK:STEP: that rank's checkpoint write fails
  GradOverflow,    // step.grad_overflow=RANK:STEP: inf in that rank's reduced gradients
  TokenizePiece,   // tokenize.piece_bytes=N: the tokenizer reads its input N bytes at a time
  KillInGather,    // zero3.kill_in_gather=RANK:PASS: SIGKILL with a ZeRO-3 all-gather in flight
  WorkerExit,      // train.worker_exit=RANK:RESTARTS: that rank's worker exits 1 at start while its restart count < RESTARTS
  KillStage,       // pp.kill_stage=STAGE:STEP: the ranks of pipeline stage STAGE SIGKILL themselves mid-step STEP
};

struct Spec {
  Point point;
  const char* name;
  const char* arg;   // the argument's form, e.g. "RANK:STEP"
  const char* what;  // one line for --failpoints and the docs
};
const std::vector<Spec>& all();

namespace detail {
extern bool g_armed;  // any failpoint set (after the first query)
bool load();          // parses DTRAIN_FAILPOINTS once; returns g_armed
const std::vector<int64_t>* args(Point p);
}  // namespace detail

// The integer arguments of point `p` when armed (e.g. {rank, step}), else nullptr.
inline const std::vector<int64_t>* get(Point p) {
  static const bool armed = detail::load();
  if (!armed) return nullptr;
  return detail::args(p);
}

// True when `p` is armed with exactly these leading arguments (e.g. rank, step).
inline bool hits(Point p, int64_t a) {
  const auto* v = get(p);
  return v && !v->empty() && (*v)[0] == a;
}
inline bool hits(Point p, int64_t a, int64_t b) {
  const auto* v = get(p);
  return v && v->size() >= 2 && (*v)[0] == a && (*v)[1] == b;
}

// Parses a DTRAIN_FAILPOINTS value into per-point arguments (UserError on bad input); what
// load() uses, exposed for tests.
std::vector<std::pair<Point, std::vector<int64_t>>> parse(const std::string& text);

}  // namespace dtrain::failpoint

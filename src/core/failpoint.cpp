#include "core/failpoint.h"

#include <cstdlib>
#include <map>

#include "core/error.h"

namespace dtrain::failpoint {

const std::vector<Spec>& all() {
  static const std::vector<Spec> kFailpoints = {
      {Point::StopAtStep, "train.stop_at_step", "N",
       "the trainer stops as on SIGTERM after step N (checkpoint, exit 0): a preemption at a known step"},
      {Point::SlowStep, "train.slow_step", "RANK:MS", "rank RANK sleeps MS milliseconds in every step (a straggler)"},
      {Point::CheckpointWrite, "checkpoint.write_fail", "RANK:STEP",
       "rank RANK fails to write its files of the checkpoint at step STEP"},
      {Point::GradOverflow, "step.grad_overflow", "RANK:STEP",
       "rank RANK's reduced gradients hold an inf at step STEP (an fp16 overflow on that rank alone)"},
      {Point::TokenizePiece, "tokenize.piece_bytes", "N",
       "`dtrain data tokenize` reads its input N bytes at a time (documents split across reads)"},
      {Point::KillInGather, "zero3.kill_in_gather", "RANK:PASS",
       "rank RANK kills itself (SIGKILL) right after launching the all-gather of the first unit of its "
       "PASS-th training micro-batch under ZeRO-3 (a peer lost in the middle of a collective)"},
      {Point::WorkerExit, "train.worker_exit", "RANK:RESTARTS",
       "the worker of rank RANK exits 1 as it starts, before any rendezvous, while its restart count "
       "(TORCHELASTIC_RESTART_COUNT) is below RESTARTS (a node whose workers fail fast and often)"},
      {Point::KillStage, "pp.kill_stage", "STAGE:STEP",
       "under pipeline parallelism the ranks of pipeline stage STAGE kill themselves (SIGKILL) after their first "
       "forward of step STEP, with activations in flight (a stage lost mid-step)"},
  };
  return kFailpoints;
}

namespace detail {
bool g_armed = false;
namespace {
std::map<Point, std::vector<int64_t>>& table() {
  static std::map<Point, std::vector<int64_t>> t;
  return t;
}
}  // namespace

bool load() {
  const char* e = std::getenv("DTRAIN_FAILPOINTS");
  if (!e || !*e) return false;
  for (auto& [p, v] : parse(e)) table()[p] = v;
  g_armed = !table().empty();
  return g_armed;
}

const std::vector<int64_t>* args(Point p) {
  auto it = table().find(p);
  return it == table().end() ? nullptr : &it->second;
}
}  // namespace detail

std::vector<std::pair<Point, std::vector<int64_t>>> parse(const std::string& text) {
  std::vector<std::pair<Point, std::vector<int64_t>>> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(';', pos);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string name = item.substr(0, eq);
    const Spec* spec = nullptr;
    std::string names;
    for (const Spec& s : all()) {
      if (name == s.name) spec = &s;
      names += std::string(names.empty() ? "" : ", ") + s.name;
    }
    if (!spec) user_error("DTRAIN_FAILPOINTS: unknown failpoint '{}' (known: {})", name, names);
    if (eq == std::string::npos)
      user_error("DTRAIN_FAILPOINTS: {} needs an argument: {}={}", name, name, spec->arg);
    std::vector<int64_t> args;
    const std::string rest = item.substr(eq + 1);
    size_t p = 0;
    while (p <= rest.size()) {
      size_t q = rest.find(':', p);
      if (q == std::string::npos) q = rest.size();
      const std::string tok = rest.substr(p, q - p);
      char* stop = nullptr;
      const long long v = std::strtoll(tok.c_str(), &stop, 10);
      if (tok.empty() || *stop != '\0' || v < 0)
        user_error("DTRAIN_FAILPOINTS: {}={}: expected {} (non-negative integers)", name, rest, spec->arg);
      args.push_back(v);
      p = q + 1;
    }
    size_t want = 1;
    for (const char* c = spec->arg; *c; ++c) want += *c == ':';
    if (args.size() != want)
      user_error("DTRAIN_FAILPOINTS: {}={}: expected {}", name, rest, spec->arg);
    out.emplace_back(spec->point, std::move(args));
  }
  return out;
}

}  // namespace dtrain::failpoint

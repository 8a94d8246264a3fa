// checkpoint.keep_best: the checkpoint of the best evaluation survives pruning, is named by
// checkpoints/best.json, continues across a resume, and loads with --checkpoint RUN/checkpoints/best.
#include <doctest/doctest.h>

#include <cmath>
#include <fmt/format.h>
#include <algorithm>

#include "train_fixtures.h"

namespace {

// (step, accuracy) of every evaluation in the run's metrics.jsonl
std::vector<std::pair<int64_t, double>> evals(const std::string& name) {
  std::vector<std::pair<int64_t, double>> out;
  for (auto& r : jsonl(run_dir(name) + "/metrics.jsonl"))
    if (r["kind"] == "eval") out.emplace_back(r["step"].get<int64_t>(), r["eval_accuracy"].get<double>());
  return out;
}

// the step of the checkpoint `latest` names
int64_t latest_step(const std::string& name) {
  std::string l = slurp(run_dir(name) + "/checkpoints/latest");
  while (!l.empty() && (l.back() == '\n' || l.back() == ' ')) l.pop_back();
  return std::stoll(l.substr(5));
}

const std::string kBest =
    " --set checkpoint.every_steps=0 --set checkpoint.keep_last=1 --set checkpoint.keep_best=true"
    " --set eval.every_steps=2 --set eval.max_batches=1";

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("checkpoint.keep_best keeps the best-evaluated checkpoint beside the newest and resumes it") {
  clean("best");
  auto t = run_cmd(kBin + " train " + recipe("best") + kBest + " --set train.max_steps=16 --set optim.lr=0.2");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  auto ev = evals("best");
  REQUIRE(ev.size() == 8);  // steps 2, 4, ..., 14 and the final one at 16
  // the first evaluation with the highest accuracy (a later tie does not replace it)
  auto want = ev[0];
  for (auto& e : ev)
    if (e.second > want.second) want = e;
  const auto best = nlohmann::json::parse(slurp(run_dir("best") + "/checkpoints/best.json"));
  CHECK(best["step"].get<int64_t>() == want.first);
  CHECK(best["value"].get<double>() == want.second);
  CHECK(best["metric"] == "eval_accuracy");
  CHECK(best["mode"] == "max");
  CHECK(best["checkpoint"] == fmt::format("step_{:08d}", want.first));
  // keep_last = 1: the newest, and the best when it is another one
  std::vector<std::string> expect{best["checkpoint"].get<std::string>(), "step_00000016"};
  expect.erase(std::unique(expect.begin(), expect.end()), expect.end());
  CHECK(entries_with_prefix(run_dir("best") + "/checkpoints", "step_") == expect);
  CHECK(entries_with_prefix(run_dir("best") + "/checkpoints", ".").empty());  // no leftover .tmp-* directory
  // dtrain report names it
  auto rep = run_cmd(kBin + " report " + run_dir("best") + " --format json");
  REQUIRE_MESSAGE(rep.code == 0, rep.all());
  const auto rj = nlohmann::json::parse(rep.out)[0]["best"];
  CHECK(rj["step"].get<int64_t>() == want.first);
  CHECK(rj["value"].get<double>() == want.second);
  CHECK(rj["metric"] == "eval_accuracy");
  // the best checkpoint evaluates to its recorded accuracy
  auto e = run_cmd(kBin + " eval " + recipe("best") + " --set eval.max_batches=1 --checkpoint " + run_dir("best") +
                   "/checkpoints/best");
  REQUIRE_MESSAGE(e.code == 0, e.all());
  CHECK_MESSAGE(e.out.find(fmt::format("test accuracy {:.2f}%", 100 * want.second)) != std::string::npos, e.out);
  // a run preempted at step 7 and resumed keeps track of the best across the two segments
  clean("best_r");
  auto a = run_cmd("DTRAIN_FAILPOINTS=train.stop_at_step=7 " + kBin + " train " + recipe("best_r") + kBest +
                   " --set train.max_steps=16 --set optim.lr=0.2");
  REQUIRE_MESSAGE(a.code == 0, a.all());
  auto b = run_cmd(kBin + " train --resume " + run_dir("best_r"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  CHECK(evals("best_r") == ev);  // bit-identical continuation, evaluations included
  const auto best_r = nlohmann::json::parse(slurp(run_dir("best_r") + "/checkpoints/best.json"));
  CHECK(best_r == best);
  // data parallel: rank 0 evaluates, every rank joins the save its verdict calls for
  clean("best_dp");
  auto dp = run_cmd(kBin + " train " + recipe("best_dp") + kBest +
                    " --set train.max_steps=8 --set optim.lr=0.2 --nproc-per-node 2 --master-port 29781");
  REQUIRE_MESSAGE(dp.code == 0, dp.all());
  const auto best_dp = nlohmann::json::parse(slurp(run_dir("best_dp") + "/checkpoints/best.json"));
  CHECK(stdfs::exists(run_dir("best_dp") + "/checkpoints/" + best_dp["checkpoint"].get<std::string>() + "/SHA256SUMS"));
  // without an evaluation split there is nothing to rank
  clean("best_noeval");
  auto n = run_cmd(kBin + " train " + recipe("best_noeval") + kBest + " --set data.kind=synthetic");
  CHECK(n.code == 2);
  CHECK_MESSAGE(n.err.find("checkpoint.keep_best needs an evaluation split") != std::string::npos, n.err);
  CHECK_FALSE(stdfs::exists(run_dir("best_noeval")));  // refused before the run directory was made
}

// train.early_stop_patience: the run ends at the evaluation that makes `patience` in a row
// without improving on the best; a resumed early-stopped run does not train on.
TEST_CASE("train.early_stop_patience ends the run after that many evaluations without improvement") {
  clean("early");
  auto t = run_cmd(kBin + " train " + recipe("early") + kBest +
                   " --set train.max_steps=40 --set optim.lr=0.2 --set train.early_stop_patience=2");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  auto ev = evals("early");
  REQUIRE(ev.size() >= 3);
  ev.pop_back();  // the final evaluation repeats the last step's
  // replay the rule on the recorded evaluations (steps 2, 4, ...)
  double best = -1;
  int64_t best_step = 0, stop = -1;
  for (auto& [step, acc] : ev) {
    if (acc > best) {
      best = acc, best_step = step;
    } else if (step / 2 - best_step / 2 >= 2) {
      stop = step;
      break;
    }
  }
  REQUIRE_MESSAGE(stop > 0, "the run never had 2 evaluations without improvement; pick another lr");
  CHECK(stop < 40);
  CHECK(ev.back().first == stop);  // no evaluation after the stop
  CHECK(latest_step("early") == stop);
  const auto b = nlohmann::json::parse(slurp(run_dir("early") + "/checkpoints/best.json"));
  CHECK(b["step"].get<int64_t>() == best_step);
  auto events = slurp(run_dir("early") + "/events.jsonl");
  CHECK(events.find("\"early_stop\"") != std::string::npos);
  CHECK(events.find("\"early_stopped\":true") != std::string::npos);
  // resumed, it has nothing left to do
  auto r = run_cmd(kBin + " train --resume " + run_dir("early"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  CHECK(latest_step("early") == stop);
  CHECK(r.out.find("| lr ") == std::string::npos);  // no training step ran
  // without keep_best there is no ranking to stop by
  clean("early_bad");
  auto bad = run_cmd(kBin + " train " + recipe("early_bad") + " --set train.early_stop_patience=2");
  CHECK(bad.code == 2);
  CHECK_MESSAGE(bad.err.find("train.early_stop_patience: 2 needs checkpoint.keep_best = true") != std::string::npos,
                bad.err);
}

}  // TEST_SUITE

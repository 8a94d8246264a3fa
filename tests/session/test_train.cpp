// End-to-end training tests: the real binary on a tiny recipe and a small slice of the
// real Fashion-MNIST (prepared once into the build directory).
#include <algorithm>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <fcntl.h>
#include <sys/file.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "train_fixtures.h"


TEST_SUITE("integration") {

TEST_CASE("train: run directory / logs / checkpoints and a final evaluation") {
  clean("basic");
  auto r = run_cmd(kBin + " train " + recipe("basic"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  std::string d = run_dir("basic");
  CHECK(stdfs::exists(d + "/config.toml"));
  CHECK(stdfs::exists(d + "/train.log"));
  CHECK(losses("basic").size() == 12);
  auto ev = jsonl(d + "/events.jsonl");
  CHECK(ev.front()["event"] == "run_start");
  CHECK(ev.back()["event"] == "run_end");
  CHECK(ev.back()["status"] == "completed");
  CHECK(r.all().find("test accuracy") != std::string::npos);
  // every 4 steps + final; keep_last 5 keeps 3 of them (4, 8, 12)
  CHECK(stdfs::exists(d + "/checkpoints/step_00000004/model.safetensors"));
  CHECK(stdfs::exists(d + "/checkpoints/step_00000012/SHA256SUMS"));
  CHECK(slurp(d + "/checkpoints/latest").find("step_00000012") != std::string::npos);
  bool tb = false;
  for (auto& e : stdfs::directory_iterator(d)) tb |= e.path().filename().string().rfind("events.out.tfevents", 0) == 0;
  CHECK(tb);
  // the same recipe again: the run directory exists -> exit 2, nothing touched
  auto before = slurp(d + "/metrics.jsonl");
  auto again = run_cmd(kBin + " train " + recipe("basic"));
  CHECK(again.code == 2);
  CHECK(again.all().find("already exists") != std::string::npos);
  CHECK(slurp(d + "/metrics.jsonl") == before);
  // inspect and eval of the saved checkpoint
  auto ins = run_cmd(kBin + " inspect " + d);
  CHECK_MESSAGE(ins.code == 0, ins.all());
  CHECK(ins.all().find("layer1.0.conv1.weight") != std::string::npos);
  auto evr = run_cmd(kBin + " eval " + recipe("basic") + " --checkpoint " + d);
  CHECK_MESSAGE(evr.code == 0, evr.all());
  CHECK(evr.all().find("test accuracy") != std::string::npos);
}

TEST_CASE("train: same recipe and seed give bit-identical losses - resume continues bit-identically") {
  clean("det_a");
  clean("det_b");
  clean("det_c");
  auto a = run_cmd(kBin + " train " + recipe("det_a"));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  auto b = run_cmd(kBin + " train " + recipe("det_b"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  auto la = losses("det_a"), lb = losses("det_b");
  REQUIRE(la.size() == 12);
  CHECK(la == lb);  // exact
  CHECK(final_weights("det_a") == final_weights("det_b"));
  // preempted after step 5 (the test hook acts like SIGTERM there), then resumed to 12
  auto c1 = run_cmd("DTRAIN_FAILPOINTS=train.stop_at_step=5 " + kBin + " train " + recipe("det_c"));
  REQUIRE_MESSAGE(c1.code == 0, c1.all());
  CHECK(losses("det_c").size() == 5);
  CHECK(stdfs::exists(run_dir("det_c") + "/checkpoints/step_00000005/model.safetensors"));
  auto c2 = run_cmd(kBin + " train --resume " + run_dir("det_c"));
  REQUIRE_MESSAGE(c2.code == 0, c2.all());
  auto lc = losses("det_c");
  REQUIRE(lc.size() == 12);
  CHECK(lc == la);
  CHECK(final_weights("det_c") == final_weights("det_a"));
}

TEST_CASE("train: SIGTERM finishes the step / writes a checkpoint and exits 0") {
  clean("sig");
  std::string cmd = kBin + " train " + recipe("sig", "") + " --set train.max_steps=100000 --set checkpoint.every_steps=0";
  pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + cmd + " >/dev/null 2>&1").c_str(), (char*)nullptr);
    _exit(127);
  }
  // wait until some steps were logged
  std::string metrics = run_dir("sig") + "/metrics.jsonl";
  for (int i = 0; i < 300 && (!stdfs::exists(metrics) || jsonl(metrics).size() < 3); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  auto ev = jsonl(run_dir("sig") + "/events.jsonl");
  CHECK(ev.back()["status"] == "preempted");
  int64_t step = ev.back()["step"].get<int64_t>();
  CHECK(stdfs::exists(run_dir("sig") + fmt::format("/checkpoints/step_{:08d}/model.safetensors", step)));
}

TEST_CASE("train: SIGKILL at any moment leaves the newest complete checkpoint loadable") {
  clean("kill");
  std::string rec = recipe("kill", "");
  std::string cmd = kBin + " train " + rec +
                    " --resume --set train.max_steps=100000 --set checkpoint.every_steps=1 --set log.every_steps=50";
  std::string events = run_dir("kill") + "/events.jsonl";
  for (int i = 0; i < 8; ++i) {
    size_t before = stdfs::exists(events) ? jsonl(events).size() : 0;
    pid_t pid = fork();
    if (pid == 0) {  // odd rounds commit in the background (checkpoint.async)
      const std::string c = cmd + (i % 2 ? " --set checkpoint.async=true" : "");
      execl("/bin/sh", "sh", "-c", ("exec " + c + " >/dev/null 2>&1").c_str(), (char*)nullptr);
      _exit(127);
    }
    // wait until this process has written a checkpoint, then kill it a few ms later: with a
    // checkpoint every step, the kill lands in a step or in a checkpoint write or commit
    for (int w = 0; w < 600; ++w) {
      if (stdfs::exists(events) && jsonl(events).size() >= before + 3) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(3 * i));
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    auto ins = run_cmd(kBin + " inspect " + run_dir("kill"));
    REQUIRE_MESSAGE(ins.code == 0, ins.all());
  }
  // and the run resumes from it: two more steps
  auto ins = run_cmd(kBin + " inspect " + run_dir("kill"));
  auto pos = ins.out.find("\nstep ");
  REQUIRE(pos != std::string::npos);
  int64_t step = std::atoll(ins.out.c_str() + pos + 6);
  CHECK(step >= 1);
  auto r = run_cmd(kBin + " train --resume " + run_dir("kill") + " --set train.max_steps=" + std::to_string(step + 2));
  CHECK_MESSAGE(r.code == 0, r.all());
  CHECK(r.all().find("resumed from") != std::string::npos);
}

TEST_CASE("train: checkpoint.async commits in the background with the files and losses of synchronous saves") {
  struct Setup {
    std::string tag, args;
    std::vector<std::string> files;
  };
  // one process; and 2 data-parallel ranks with ZeRO-1, each writing its optimizer shard
  const Setup setups[] = {
      {"", "", {"model.safetensors", "optim-00000-of-00001.safetensors"}},
      {"_dp", " --nproc-per-node 2 --master-port 29787 --set parallel.zero=1",
       {"model.safetensors", "optim-00000-of-00002.safetensors", "optim-00001-of-00002.safetensors"}}};
  for (const Setup& su : setups) {
    CAPTURE(su.tag);
    const std::string sync = "sync_ck" + su.tag, async = "async_ck" + su.tag;
    clean(sync);
    clean(async);
    const std::string common = " --set checkpoint.every_steps=2 --set checkpoint.keep_last=3" + su.args;
    auto a = run_cmd(kBin + " train " + recipe(sync) + common);
    REQUIRE_MESSAGE(a.code == 0, a.all());
    auto b = run_cmd(kBin + " train " + recipe(async) + common + " --set checkpoint.async=true");
    REQUIRE_MESSAGE(b.code == 0, b.all());
    CHECK(losses(async) == losses(sync));
    // the same checkpoints survive pruning, each one verified and equal to its synchronous twin
    auto dirs = [](const std::string& name) { return entries_with_prefix(run_dir(name) + "/checkpoints", "step_"); };
    REQUIRE(dirs(async) == dirs(sync));
    CHECK(dirs(async).size() == 3);
    for (const auto& dname : dirs(async))
      for (const std::string& f : su.files) {  // not state.json: the recipes differ
        CAPTURE(dname);
        CAPTURE(f);
        REQUIRE(stdfs::exists(run_dir(sync) + "/checkpoints/" + dname + "/" + f));
        CHECK(slurp(run_dir(async) + "/checkpoints/" + dname + "/" + f) ==
              slurp(run_dir(sync) + "/checkpoints/" + dname + "/" + f));
      }
    CHECK(slurp(run_dir(async) + "/checkpoints/latest") == slurp(run_dir(sync) + "/checkpoints/latest"));
    int async_events = 0, periodic = 0;
    for (auto& e : jsonl(run_dir(async) + "/events.jsonl")) {
      if (e.value("event", "") != "checkpoint") continue;
      periodic += e["reason"] == "periodic";
      async_events += e.value("async", false);
      if (e["reason"] == "periodic") CHECK(e["blocked_seconds"].get<double>() <= e["seconds"].get<double>());
    }
    CHECK(periodic == 5);  // steps 2, 4, 6, 8, 10 of 12
    CHECK(async_events == 5);
    for (auto& e : stdfs::directory_iterator(run_dir(async) + "/checkpoints"))
      CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
    for (const auto& dname : dirs(async))
      CHECK(dtrain::CheckpointManager::verify(run_dir(async) + "/checkpoints/" + dname).empty());
    // and resume continues from the newest of them
    auto c = run_cmd(kBin + " train --resume " + run_dir(async) + " --set train.max_steps=14" + su.args);
    REQUIRE_MESSAGE(c.code == 0, c.all());
    CHECK(c.all().find("resumed from") != std::string::npos);
  }
}

TEST_CASE("train: log.level warn shows the step lines but not the checkpoint lines - debug and info do") {
  for (const std::string level : {"warn", "info", "debug"}) {
    clean("level");
    auto r = run_cmd(kBin + " train " + recipe("level") + " --set train.max_steps=4 --set log.level='\"" + level + "\"'");
    REQUIRE_MESSAGE(r.code == 0, r.all());
    CAPTURE(level);
    CHECK(r.out.find("step      4/4") != std::string::npos);
    CHECK((r.all().find("checkpoint ") == std::string::npos) == (level == "warn"));
  }
}

TEST_CASE("train: bad input exits 2 with one line naming the problem") {
  // missing dataset: the message says which command creates it
  auto r = run_cmd(kBin + " train " + recipe("nodata", "") + " --set data.path=\"" + kWork + "/no/such/dir\"");
  CHECK(r.code == 2);
  CHECK(r.all().find("dataset not found (create it with: dtrain data") != std::string::npos);
  // a checkpoint from a different model
  clean("other");
  auto t = run_cmd(kBin + " train " + recipe("other") + " --set train.max_steps=2 --set schedule.warmup_steps=0");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  auto e = run_cmd(kBin + " eval " + recipe("other") + " --set model.width=8 --checkpoint " + run_dir("other"));
  CHECK(e.code == 2);
  CHECK(e.all().find("model.safetensors") != std::string::npos);
  // resume of a run that does not exist
  auto n = run_cmd(kBin + " train --resume " + kWork + "/runs/does-not-exist");
  CHECK(n.code == 2);
  // CUDA graphs on the CPU are refused, never silently ignored
  clean("graph");
  auto g = run_cmd(kBin + " train " + recipe("graph") + " --set train.cuda_graph=true --device cpu");
  CHECK(g.code == 2);
  CHECK(g.all().find("train.cuda_graph = true needs a CUDA device") != std::string::npos);
  CHECK_FALSE(stdfs::exists(run_dir("graph") + "/checkpoints"));
}


TEST_CASE("train: metrics port in use or bad bind address exits 2 before the run directory exists") {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(listen(fd, 1) == 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  clean("busyport");
  auto r = run_cmd(kBin + " train " + recipe("busyport") + " --metrics-port " + std::to_string(port));
  CHECK(r.code == 2);
  CHECK(r.err.find("observability.prometheus_port") != std::string::npos);
  CHECK(r.err_lines() == 1);
  CHECK_FALSE(stdfs::exists(run_dir("busyport")));
  close(fd);
  auto b = run_cmd(kBin + " train " + recipe("busyport") + " --set observability.prometheus_port=9 --set observability.bind=not-an-address");
  CHECK(b.code == 2);
  CHECK(b.err.find("observability.bind") != std::string::npos);
  CHECK_FALSE(stdfs::exists(run_dir("busyport")));
}

TEST_CASE("train: the Prometheus endpoint serves the trainer's metrics while it runs") {
  clean("prom");
  // port 0 in the recipe means off, so pick a free port first
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  std::string cmd = kBin + " train " + recipe("prom") + " --metrics-port " + std::to_string(port) +
                    " --set train.max_steps=100000 --set checkpoint.every_steps=0 --set eval.every_steps=1"
                    " --set eval.max_batches=1";
  pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + cmd + " >/dev/null 2>&1").c_str(), (char*)nullptr);
    _exit(127);
  }
  std::string metrics = run_dir("prom") + "/metrics.jsonl";
  // a few train and eval rows (eval.every_steps = 1), then a scrape
  for (int i = 0; i < 300 && (!stdfs::exists(metrics) || jsonl(metrics).size() < 4); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::string py = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python";
  auto r = run_cmd(py + " -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:" + std::to_string(port) +
                   "/metrics', timeout=5).read().decode())\"");
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  CHECK_MESSAGE(r.code == 0, r.all());
  CHECK(r.out.find("dtrain_step_seconds{") != std::string::npos);
  CHECK(r.out.find("dtrain_samples_total{") != std::string::npos);
  CHECK(r.out.find("dtrain_loss{") != std::string::npos);
  CHECK(r.out.find("dtrain_eval_loss{") != std::string::npos);
  CHECK(r.out.find("dtrain_eval_metric{") != std::string::npos);
  CHECK(r.out.find("metric=\"accuracy\"} ") != std::string::npos);
}
}

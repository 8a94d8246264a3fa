// Observability: step-time quantiles, the metric registry, Prometheus rendering, the
// /metrics HTTP server, NVML loading, peak FLOP/s, and `dtrain report`.
#include <doctest/doctest.h>
#include "test_util.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "obs/http_server.h"
#include "obs/metrics.h"
#include "obs/nvml.h"
#include "obs/peak_flops.h"
#include "obs/prometheus.h"
#include "obs/report.h"

using namespace dtrain;
using test_util::TmpDir;

namespace {

// Sends `raw` to 127.0.0.1:port and returns everything the server answers before it
// closes (empty on a connect failure). Every wait is bounded by timeout_ms.
std::string raw_http(int port, const std::string& raw, int timeout_ms = 3000) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return "";
  }
  size_t off = 0;
  while (off < raw.size()) {
    ssize_t n = send(fd, raw.data() + off, raw.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;
    off += size_t(n);
  }
  std::string out;
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int left = int(std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now()).count());
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, left) <= 0) break;
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  close(fd);
  return out;
}

std::string get(int port, const std::string& path) {
  return raw_http(port, "GET " + path + " HTTP/1.1\r\nHost: localhost\r\n\r\n");
}

int status_of(const std::string& resp) {
  if (resp.rfind("HTTP/1.1 ", 0) != 0 || resp.size() < 12) return -1;
  return std::stoi(resp.substr(9, 3));
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

std::string user_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no UserError)";
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("quantiles are exact with linear interpolation over the window") {
    std::vector<double> v;
    for (int i = 100; i >= 1; i--) v.push_back(i);
    CHECK(quantile(v, 0.5) == doctest::Approx(50.5));
    CHECK(quantile(v, 0.95) == doctest::Approx(95.05));
    CHECK(quantile(v, 0.99) == doctest::Approx(99.01));
    CHECK(quantile(v, 0) == 1);
    CHECK(quantile(v, 1) == 100);
    CHECK(quantile({3, 1, 2}, 0.5) == 2);
    CHECK(quantile({7}, 0.99) == 7);
    CHECK(std::isnan(quantile({}, 0.5)));

    StepWindow w(3);
    for (int i = 1; i <= 5; i++) w.add({double(i)});
    auto s = w.samples();
    REQUIRE(s.size() == 3);
    CHECK(s[0].total_s == 3);
    CHECK(s[2].total_s == 5);
    CHECK(w.totals_sorted() == std::vector<double>{3, 4, 5});
  }

  TEST_CASE("registry: window quantiles / totals / phase means - snapshots are immutable") {
    MetricRegistry reg("r1", 0, 100);
    auto empty = reg.snapshot();
    REQUIRE(empty != nullptr);
    CHECK(empty->step == 0);
    CHECK(std::isnan(empty->step_p50_s));
    for (int i = 1; i <= 150; i++) {
      StepSample s;
      s.total_s = i;
      s.data_s = 0.5;
      s.forward_s = i % 2 ? 1 : 3;
      s.samples = 32;
      s.tokens = 0;
      reg.record_step(s);
    }
    reg.set_loss(1.25);
    reg.add_checkpoint(2.5);
    reg.add_checkpoint_failure();
    reg.publish();
    auto a = reg.snapshot();
    CHECK(a->step == 150);
    CHECK(a->window_steps == 100);
    CHECK(a->step_p50_s == doctest::Approx(100.5));  // steps 51..150
    CHECK(a->step_p99_s == doctest::Approx(149.01));
    CHECK(a->step_count == 150);
    CHECK(a->step_seconds_sum == doctest::Approx(150 * 151 / 2));
    CHECK(a->samples_total == 150 * 32);
    CHECK(a->data_s == doctest::Approx(0.5));
    CHECK(a->forward_s == doctest::Approx(2));
    CHECK(a->checkpoints_total == 1);
    CHECK(a->checkpoint_failures_total == 1);
    CHECK(a->last_checkpoint_s == 2.5);
    CHECK(a->loss == 1.25);
    CHECK(empty->step == 0);  // the earlier snapshot did not change

    reg.record_step({1.0});
    CHECK(reg.snapshot()->step == 150);  // not visible before publish()
    reg.publish();
    CHECK(reg.snapshot()->step == 151);
    CHECK(a->step == 150);
  }

  TEST_CASE("registry: readers on other threads while the trainer publishes") {
    MetricRegistry reg("r", 0, 10);
    std::atomic<bool> stop{false};
    std::atomic<int64_t> bad{0}, reads{0};
    std::thread reader([&] {
      int64_t last = 0;
      while (!stop.load()) {
        auto s = reg.snapshot();
        if (s->step < last || s->samples_total != s->step * 2) bad++;
        last = s->step;
        reads++;
      }
    });
    // publish at least 20000 steps, and keep going until the reader has run a while
    // (bounded: on a loaded machine the reader thread may start late)
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    int64_t steps = 0;
    while (steps < 20000 || (reads < 1000 && std::chrono::steady_clock::now() < until)) {
      reg.record_step({0.001, 0, 0, 0, 0, 0, 2, 0});
      if (++steps % 10 == 0) reg.publish();
    }
    reg.publish();
    stop = true;
    reader.join();
    CHECK(bad == 0);
    CHECK(reads > 0);
    CHECK(reg.snapshot()->step == steps);
  }

  TEST_CASE("prometheus: numbers and label escaping") {
    CHECK(prom_number(std::nan("")) == "NaN");
    CHECK(prom_number(INFINITY) == "+Inf");
    CHECK(prom_number(-INFINITY) == "-Inf");
    CHECK(prom_number(3) == "3");
    CHECK(prom_number(0.25) == "0.25");
    CHECK(prom_number(1e-05) == "1e-05");
    CHECK(prom_number(1.5e20) == "1.5e+20");
    CHECK(prom_escape_label("a\"b\\c\nd") == "a\\\"b\\\\c\\nd");
  }

  TEST_CASE("prometheus: exposition of a fresh registry (golden)") {
    Snapshot s;
    s.run = "exp \"1\"";
    const std::string L = "{run=\"exp \\\"1\\\"\",rank=\"0\"}";
    std::string want =
        "# HELP dtrain_step_seconds Wall time of one training step; quantiles over the most recent steps, sum and count since the process started.\n"
        "# TYPE dtrain_step_seconds summary\n"
        "dtrain_step_seconds{run=\"exp \\\"1\\\"\",rank=\"0\",quantile=\"0.5\"} NaN\n"
        "dtrain_step_seconds{run=\"exp \\\"1\\\"\",rank=\"0\",quantile=\"0.95\"} NaN\n"
        "dtrain_step_seconds{run=\"exp \\\"1\\\"\",rank=\"0\",quantile=\"0.99\"} NaN\n"
        "dtrain_step_seconds_sum" + L + " 0\n"
        "dtrain_step_seconds_count" + L + " 0\n"
        "# HELP dtrain_step Optimizer steps completed (global step, including steps before a resume).\n"
        "# TYPE dtrain_step gauge\n"
        "dtrain_step" + L + " 0\n"
        "# HELP dtrain_samples_total Training samples (images, or sequences) processed by the job's ranks.\n"
        "# TYPE dtrain_samples_total counter\n"
        "dtrain_samples_total" + L + " 0\n"
        "# HELP dtrain_tokens_total Training tokens processed by the job's ranks (token models only).\n"
        "# TYPE dtrain_tokens_total counter\n"
        "dtrain_tokens_total" + L + " 0\n"
        "# HELP dtrain_checkpoints_total Checkpoints written.\n"
        "# TYPE dtrain_checkpoints_total counter\n"
        "dtrain_checkpoints_total" + L + " 0\n"
        "# HELP dtrain_checkpoint_failures_total Checkpoint writes that failed or checkpoints found invalid.\n"
        "# TYPE dtrain_checkpoint_failures_total counter\n"
        "dtrain_checkpoint_failures_total" + L + " 0\n"
        "# HELP dtrain_resumes_total Resumes from a checkpoint.\n"
        "# TYPE dtrain_resumes_total counter\n"
        "dtrain_resumes_total" + L + " 0\n"
        "# HELP dtrain_preemptions_total Preemptions (SIGTERM/SIGINT) handled.\n"
        "# TYPE dtrain_preemptions_total counter\n"
        "dtrain_preemptions_total" + L + " 0\n"
        "# HELP dtrain_restarts_total Worker restarts by the launcher.\n"
        "# TYPE dtrain_restarts_total counter\n"
        "dtrain_restarts_total" + L + " 0\n"
        "# HELP dtrain_stragglers_total Ranks flagged as stragglers, summed over the log steps.\n"
        "# TYPE dtrain_stragglers_total counter\n"
        "dtrain_stragglers_total" + L + " 0\n";
    CHECK(render_prometheus(s) == want);
  }

  TEST_CASE("prometheus: exposition of a busy registry") {
    MetricRegistry reg("gpt", 3, 100);
    for (int i = 0; i < 4; i++) reg.record_step({0.5 + 0.25 * i, 0.015625, 0.125, 0.25, 0.0625, 0.03125, 8, 8192});
    reg.set_step(1004);
    reg.set_loss(2.5);
    reg.set_lr(0.0003);
    reg.set_eval(1000, 1.25, "accuracy", 0.875);
    reg.set_eval_best(0.9);
    reg.set_mfu(0.42);
    reg.set_arena_high_water(1048576);
    reg.add_checkpoint(1.5);
    reg.add_resume();
    reg.set_gpus({{0, "NVIDIA H100 80GB HBM3", 0.97, 4e10, 8.5e10}, {1, "NVIDIA H100 80GB HBM3", -1, -1, -1}});
    reg.publish();
    std::string t = render_prometheus(*reg.snapshot());
    const std::string L = "run=\"gpt\",rank=\"3\"";
    auto has = [&](const std::string& line) {
      INFO(line);
      CHECK(t.find(line + "\n") != std::string::npos);
    };
    has("dtrain_step_seconds{" + L + ",quantile=\"0.5\"} 0.875");
    has("dtrain_step_seconds{" + L + ",quantile=\"0.95\"} 1.2125");
    has("dtrain_step_seconds_sum{" + L + "} 3.5");
    has("dtrain_step_seconds_count{" + L + "} 4");
    has("dtrain_step{" + L + "} 1004");
    has("dtrain_samples_total{" + L + "} 32");
    has("dtrain_tokens_total{" + L + "} 32768");
    has("# TYPE dtrain_step_phase_seconds gauge");
    has("dtrain_step_phase_seconds{" + L + ",phase=\"backward\"} 0.25");
    has("dtrain_step_phase_seconds{" + L + ",phase=\"sync\"} 0.0625");
    has("dtrain_grad_sync_exposed_seconds{" + L + "} 0.0625");
    has("dtrain_checkpoint_seconds{" + L + "} 1.5");
    has("dtrain_checkpoints_total{" + L + "} 1");
    has("dtrain_resumes_total{" + L + "} 1");
    has("dtrain_gpu_info{" + L + ",gpu=\"0\",name=\"NVIDIA H100 80GB HBM3\"} 1");
    has("dtrain_gpu_utilization_ratio{" + L + ",gpu=\"0\"} 0.97");
    has("dtrain_gpu_memory_bytes{" + L + ",gpu=\"0\",kind=\"used\"} 40000000000");
    has("dtrain_gpu_memory_bytes{" + L + ",gpu=\"0\",kind=\"total\"} 85000000000");
    CHECK(t.find("gpu=\"1\",kind") == std::string::npos);  // unknown values are left out
    CHECK(t.find("dtrain_gpu_utilization_ratio{" + L + ",gpu=\"1\"}") == std::string::npos);
    has("dtrain_arena_high_water_bytes{" + L + "} 1048576");
    has("dtrain_mfu_ratio{" + L + "} 0.42");
    has("dtrain_loss{" + L + "} 2.5");
    has("dtrain_learning_rate{" + L + "} 0.0003");
    has("dtrain_eval_step{" + L + "} 1000");
    has("dtrain_eval_loss{" + L + "} 1.25");
    has("dtrain_eval_metric{" + L + ",metric=\"accuracy\"} 0.875");
    has("dtrain_eval_best{" + L + "} 0.9");
    has("# TYPE dtrain_snapshot_timestamp_seconds gauge");
    // every family has HELP before TYPE, and every sample line belongs to a declared family
    CHECK(t.find("NaN") == std::string::npos);
  }

  TEST_CASE("peak FLOP/s table and MFU") {
    CHECK(peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12);
    CHECK(peak_flops("NVIDIA H100 80GB HBM3", "TF32") == 494e12);
    CHECK(peak_flops("NVIDIA H100 80GB HBM3", "fp32") == 67e12);
    CHECK(peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12);
    CHECK(peak_flops("NVIDIA H200", "fp16") == 989e12);
    CHECK(peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12);
    CHECK(peak_flops("NVIDIA A100 80GB PCIe", "tf32") == 156e12);
    CHECK(peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5e12);
    CHECK(peak_flops("NVIDIA A10", "bf16") == 125e12);
    CHECK(peak_flops("NVIDIA A10G", "bf16") == 0);  // not in the table: unknown, not A10's number
    CHECK(peak_flops("NVIDIA L4", "bf16") == 121e12);
    CHECK(peak_flops("NVIDIA L40S", "bf16") == 362e12);
    CHECK(peak_flops("Tesla V100-SXM2-16GB", "bf16") == 0);  // no bf16 tensor cores
    CHECK(peak_flops("cpu", "fp32") == 0);
    CHECK(peak_flops("NVIDIA H100 80GB HBM3", "int8") == 0);
    CHECK(resolve_peak_flops("cpu", "fp32", 1.5) == 1.5e12);
    CHECK(resolve_peak_flops("NVIDIA H100 80GB HBM3", "bf16", 0) == 989e12);
    CHECK(mfu_ratio(494.5e12, 989e12) == doctest::Approx(0.5));
    CHECK(std::isnan(mfu_ratio(1e12, 0)));
    CHECK(std::isnan(mfu_ratio(NAN, 989e12)));
  }

  TEST_CASE("NVML: a missing library means unavailable / never an error") {
    Nvml missing("libnvidia-ml-does-not-exist.so.1");
    CHECK_FALSE(missing.available());
    CHECK(missing.sample().empty());
    CHECK(missing.status().find("NVML not available") == 0);
    Nvml real;  // the system's, if any
    MESSAGE(real.status());
    if (real.available()) {
      auto g = real.sample();
      CHECK(int(g.size()) == real.device_count());
      for (auto& x : g) {
        CHECK(!x.name.empty());
        CHECK(x.memory_total_bytes > 0);
      }
    }
  }
}

TEST_SUITE("unit") {
  TEST_CASE("http: request line parsing") {
    HttpRequestLine r;
    CHECK(parse_request_line("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", r));
    CHECK(r.method == "GET");
    CHECK(r.path == "/metrics");
    CHECK(parse_request_line("HEAD /metrics?x=1 HTTP/1.0\n\n", r));
    CHECK_FALSE(parse_request_line("GET /metrics\r\n\r\n", r));
    CHECK_FALSE(parse_request_line("GET  /metrics HTTP/1.1\r\n", r));
    CHECK_FALSE(parse_request_line("get /metrics HTTP/1.1\r\n", r));
    CHECK_FALSE(parse_request_line("GET metrics HTTP/1.1\r\n", r));
    CHECK_FALSE(parse_request_line("GET /metrics HTTP/2\r\n", r));
    CHECK_FALSE(parse_request_line(std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n", 12), r));
  }

  TEST_CASE("http: /metrics / 404 / 405 / 400 / HEAD / garbage and concurrent scrapes") {
    MetricRegistry reg("http-test", 0);
    reg.record_step({0.1, 0, 0, 0, 0, 0, 16, 0});
    reg.publish();
    HttpServer srv("127.0.0.1", 0, metrics_handler(reg));
    REQUIRE(srv.port() > 0);

    std::string r = get(srv.port(), "/metrics");
    CHECK(status_of(r) == 200);
    CHECK(r.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
    CHECK(r.find("dtrain_samples_total{run=\"http-test\",rank=\"0\"} 16\n") != std::string::npos);
    CHECK(status_of(get(srv.port(), "/metrics?name[]=x")) == 200);
    CHECK(status_of(get(srv.port(), "/")) == 404);
    CHECK(status_of(get(srv.port(), "/metricsx")) == 404);
    CHECK(status_of(raw_http(srv.port(), "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")) == 405);
    std::string head = raw_http(srv.port(), "HEAD /metrics HTTP/1.0\r\n\r\n");
    CHECK(status_of(head) == 200);
    CHECK(head.find("dtrain_samples_total") == std::string::npos);
    CHECK(status_of(raw_http(srv.port(), "hello there\r\n\r\n")) == 400);
    CHECK(status_of(raw_http(srv.port(), std::string("\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n", 13))) == 400);
    CHECK(status_of(raw_http(srv.port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'a') + "\r\n\r\n")) == 431);
    // a client that connects and says nothing does not hold up the others
    int idle = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(srv.port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(connect(idle, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    auto t0 = std::chrono::steady_clock::now();
    CHECK(status_of(get(srv.port(), "/metrics")) == 200);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1000));

    // 32 concurrent scrapes, while the "trainer" keeps publishing
    std::atomic<bool> stop{false};
    std::thread trainer([&] {
      while (!stop) {
        reg.record_step({0.001, 0, 0, 0, 0, 0, 1, 0});
        reg.publish();
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
    std::atomic<int> ok{0};
    std::vector<std::thread> clients;
    for (int i = 0; i < 32; i++)
      clients.emplace_back([&] {
        std::string resp = get(srv.port(), "/metrics");
        if (status_of(resp) == 200 && resp.find("dtrain_step_seconds_count") != std::string::npos) ok++;
      });
    for (auto& c : clients) c.join();
    stop = true;
    trainer.join();
    close(idle);
    CHECK(ok == 32);
    CHECK(srv.requests_served() >= 36);
    CHECK(status_of(get(srv.port(), "/metrics")) == 200);  // still serving after all that
  }

  TEST_CASE("http: start errors name the config key and the value") {
    MetricRegistry reg;
    HttpServer first("127.0.0.1", 0, metrics_handler(reg));
    int port = first.port();
    CHECK(user_error_of([&] { HttpServer second("127.0.0.1", port, metrics_handler(reg)); }) ==
          fmt::format("observability.prometheus_port: port {} on 127.0.0.1 is already in use", port));
    std::string e = user_error_of([&] { HttpServer s("300.1.2.3", 0, metrics_handler(reg)); });
    CHECK(e.find("observability.bind") == 0);
    CHECK(e.find("300.1.2.3") != std::string::npos);
    e = user_error_of([&] { HttpServer s("192.0.2.1", 0, metrics_handler(reg)); });  // TEST-NET-1: not ours
    CHECK(e.find("observability.bind: \"192.0.2.1\" is not an address of this machine") == 0);
    e = user_error_of([&] { HttpServer s("127.0.0.1", 70000, metrics_handler(reg)); });
    CHECK(e.find("observability.prometheus_port: 70000 is out of range") == 0);
    e = user_error_of([&] { HttpServer s("", 9100, metrics_handler(reg)); });
    CHECK(e.find("observability.bind") == 0);
  }

  TEST_CASE("report: summary of a synthetic run / text / md and json") {
    TmpDir t;
    std::string dir = t.path + "/run_a";
    std::filesystem::create_directories(dir);
    std::string m;
    for (int i = 1; i <= 10; i++) {
      double step_s = i == 10 ? 0.5 : 0.1;  // one slow step
      m += fmt::format(
          "{{\"kind\":\"train\",\"step\":{},\"loss\":{},\"lr\":0.1,\"images_per_s\":{},\"elapsed_s\":{},\"step_s\":{},"
          "\"data_s\":{},\"forward_s\":{},\"backward_s\":{},\"optimizer_s\":{},\"sync_s\":{}}}\n",
          i * 10, 2.0 / i, i == 1 ? 10 : 100, i * 1.0, step_s, 0.1 * step_s, 0.3 * step_s, 0.4 * step_s,
          0.1 * step_s, 0.05 * step_s);
    }
    m += "{\"kind\":\"eval\",\"step\":100,\"eval_loss\":0.4,\"eval_accuracy\":0.875}\n";
    write_text(dir + "/metrics.jsonl", m);
    write_text(dir + "/events.jsonl",
               "{\"time\":\"t\",\"event\":\"run_start\",\"start_step\":0}\n"
               "{\"time\":\"t\",\"event\":\"checkpoint\",\"step\":50,\"bytes\":100,\"seconds\":1.0}\n"
               "{\"time\":\"t\",\"event\":\"signal\",\"signal\":\"SIGTERM\",\"step\":50}\n"
               "{\"time\":\"t\",\"event\":\"checkpoint\",\"step\":50,\"bytes\":100,\"seconds\":2.0}\n"
               "{\"time\":\"t\",\"event\":\"run_end\",\"status\":\"preempted\",\"step\":50,\"wall_time_s\":5}\n"
               "{\"time\":\"t\",\"event\":\"checkpoint_invalid\",\"note\":\"x\"}\n"
               "{\"time\":\"t\",\"event\":\"resume\",\"from\":\"c\",\"step\":50}\n"
               "{\"time\":\"t\",\"event\":\"run_start\",\"start_step\":50}\n"
               "{\"time\":\"t\",\"event\":\"checkpoint\",\"step\":100,\"bytes\":100,\"seconds\":3.0}\n"
               "{\"time\":\"t\",\"event\":\"run_end\",\"status\":\"completed\",\"step\":100,\"wall_time_s\":11.5,\"eval_accuracy\":0.875,\"eval_loss\":0.4}\n");
    RunSummary s = summarize_run(dir);
    CHECK(s.status == "completed");
    CHECK(s.steps == 100);
    CHECK(s.wall_time_s == 11.5);
    CHECK(s.samples_per_s == doctest::Approx(100));  // first (warm-up) row dropped
    CHECK(s.step_rows == 10);
    CHECK(s.step_p50_s == doctest::Approx(0.1));
    CHECK(s.step_p99_s == doctest::Approx(0.1 + 0.4 * 0.91));
    CHECK(s.share_backward == doctest::Approx(0.4));
    CHECK(s.share_sync == doctest::Approx(0.05));
    CHECK(s.share_other == doctest::Approx(0.05));
    CHECK(s.checkpoints == 3);
    CHECK(s.checkpoint_failures == 1);
    CHECK(s.checkpoint_mean_s == doctest::Approx(2.0));
    CHECK(s.resumes == 1);
    CHECK(s.preemptions == 1);
    CHECK(s.restarts == 0);
    CHECK(s.final_loss == doctest::Approx(0.2));
    CHECK(s.final_eval_accuracy == doctest::Approx(0.875));

    // a second run without sync_s, side by side
    std::string dir_b = t.path + "/run_b";
    std::filesystem::create_directories(dir_b);
    write_text(dir_b + "/metrics.jsonl",
               "{\"kind\":\"train\",\"step\":5,\"loss\":1.5,\"lr\":0.1,\"images_per_s\":50,\"elapsed_s\":2,\"step_s\":0.2,"
               "\"data_s\":0.02,\"forward_s\":0.06,\"backward_s\":0.1,\"optimizer_s\":0.02}\n"
               "{\"kind\":\"train\",\"step\":6,\"lo");  // crashed mid-line
    write_text(dir_b + "/events.jsonl", "{\"time\":\"t\",\"event\":\"run_start\"}\n");
    RunSummary b = summarize_run(dir_b);
    CHECK(b.status == "running or crashed");
    CHECK(b.wall_time_s == 2);
    CHECK(std::isnan(b.share_sync));
    REQUIRE(b.notes.size() == 1);
    CHECK(b.notes[0].find("metrics.jsonl:2: skipped a truncated last line") != std::string::npos);

    std::string text = render_report({s, b}, "text");
    CHECK(text.find("step p95") != std::string::npos);
    CHECK(text.find("completed") != std::string::npos);
    CHECK(text.find("running or crashed") != std::string::npos);
    CHECK(text.find("87.5%") != std::string::npos);
    CHECK(text.find("0:12") != std::string::npos);  // 11.5 s rounded
    std::string md = render_report({s, b}, "md");
    CHECK(md.find("| run | " + dir + " | " + dir_b + " |\n|---|---:|---:|\n") == 0);
    CHECK(md.find("| time: exposed sync | 5.0% | - |") != std::string::npos);
    auto j = nlohmann::json::parse(render_report({s, b}, "json"));
    REQUIRE(j.size() == 2);
    CHECK(j[0]["steps"] == 100);
    CHECK(j[0]["share"]["sync_exposed"].get<double>() == doctest::Approx(0.05));
    CHECK(j[1]["share"]["sync_exposed"].is_null());
    CHECK(user_error_of([&] { render_report({s}, "html"); }).find("--format html") != std::string::npos);
  }

  TEST_CASE("report: missing or corrupt files are user errors naming the file") {
    TmpDir t;
    CHECK(user_error_of([&] { summarize_run(t.path + "/nope"); }).find(t.path + "/nope is not a directory") !=
          std::string::npos);
    CHECK(user_error_of([&] { summarize_run(t.path); }) ==
          t.path + "/metrics.jsonl: not found (is this a dtrain run directory?)");
    write_text(t.path + "/metrics.jsonl", "{\"kind\":\"train\",\"step\":1}\n");
    CHECK(user_error_of([&] { summarize_run(t.path); }).find(t.path + "/events.jsonl: not found") == 0);
    write_text(t.path + "/events.jsonl", "{\"event\":\"run_start\"}\nnot json at all\n{\"event\":\"run_end\"}\n");
    CHECK(user_error_of([&] { summarize_run(t.path); }).find(t.path + "/events.jsonl:2: corrupt line") == 0);
    write_text(t.path + "/events.jsonl", "[1,2]\n");
    CHECK(user_error_of([&] { summarize_run(t.path); }).find(t.path + "/events.jsonl:1: corrupt line") == 0);
    CHECK(user_error_of([&] { report_runs({}, "text"); }).find("at least one run directory") != std::string::npos);
    CHECK(user_error_of([&] { report_runs({t.path}, "yaml"); }).find("--format yaml") != std::string::npos);
  }
}

// Collective benchmark (nccl-tests-style sweep) and the data-parallel scaling model.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "backend/backend.h"
#include "core/error.h"
#include "comm/communicator.h"
#include "comm/collective_bench.h"
#include "comm/launcher.h"
#include "plan/scaling.h"
#include "comm/store.h"

using namespace dtrain;
using namespace dtrain::comm;
using namespace dtrain::parallel;

namespace {

int free_port_coll() {
  StoreServer s("127.0.0.1", 0, "x");
  return s.port();
}

std::string read_all(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A broken 2-rank communicator whose collectives do nothing: the #wrong check must see it.
struct DoneWork : Work {
  void wait_impl() override {}
  bool done_impl() override { return true; }
};
struct NoopComm : Communicator {
  explicit NoopComm(Backend& be) : Communicator(&be, "noop") {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string backend_name() const override { return "noop"; }
  CommBytes bytes_sent() const override { return {}; }
  std::shared_ptr<Work> allreduce_impl(Tensor, ReduceOp) override { return std::make_shared<DoneWork>(); }
  std::shared_ptr<Work> reduce_scatter_impl(Tensor, Tensor, ReduceOp) override { return std::make_shared<DoneWork>(); }
  std::shared_ptr<Work> allgather_impl(Tensor, Tensor) override { return std::make_shared<DoneWork>(); }
  std::shared_ptr<Work> broadcast_impl(Tensor, int) override { return std::make_shared<DoneWork>(); }
  std::shared_ptr<Work> barrier_impl() override { return std::make_shared<DoneWork>(); }
};

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("collbench: #wrong counts the elements a broken communicator leaves wrong") {
  auto be = make_backend("cpu", 0, 1);
  NoopComm comm(*be);
  CollectiveBenchArgs a;
  a.min_bytes = 64;
  a.max_bytes = 256;
  a.iters = 1;
  a.warmup = 0;
  auto rows = run_collective_bench(a, comm, *be);
  REQUIRE(rows.size() == 3 * 3);
  for (const auto& r : rows) {
    if (r.op == "allreduce") CHECK(r.wrong == r.count);            // every element lacks rank 1's share
    if (r.op == "allgather") CHECK(r.wrong == r.count / 2);        // rank 1's half never arrives
    if (r.op == "reduce_scatter") CHECK(r.wrong > 0);
    CHECK(r.busbw_gbs == doctest::Approx(r.algbw_gbs * busbw_factor(r.op, 2)));
  }
}

TEST_CASE("collbench: busbw factors follow nccl-tests") {
  CHECK(busbw_factor("allreduce", 1) == 0.0);
  CHECK(busbw_factor("allgather", 1) == 0.0);
  CHECK(busbw_factor("allreduce", 2) == doctest::Approx(1.0));
  CHECK(busbw_factor("allreduce", 8) == doctest::Approx(1.75));
  CHECK(busbw_factor("reduce_scatter", 8) == doctest::Approx(0.875));
  CHECK(busbw_factor("allgather", 4) == doctest::Approx(0.75));
  CHECK_THROWS_AS(busbw_factor("alltoall", 2), UserError);
}

TEST_CASE("collbench: sweep sizes multiply by the step factor and split evenly across ranks") {
  auto c = sweep_counts(8, 64, 2, 1);
  REQUIRE(c.size() == 4);
  CHECK(c[0] == 2);
  CHECK(c[3] == 16);
  auto c3 = sweep_counts(8, 1024, 4, 3);  // 8,32,128,512 B -> 2,8,32,128 f32 -> multiples of 3, >= 3
  REQUIRE(c3.size() == 4);
  CHECK(c3[0] == 3);
  CHECK(c3[1] == 6);
  CHECK(c3[3] == 126);
  CHECK_THROWS_AS(sweep_counts(8, 4, 2, 1), UserError);
  CHECK_THROWS_AS(sweep_counts(8, 64, 1, 1), UserError);
}

TEST_CASE("collbench: the launcher flags are removed from the workers' argv") {
  std::vector<std::string> in = {"dtrain", "bench", "--collectives", "--nproc-per-node", "4", "--max-bytes",
                                 "1024", "--master-port=1234"};
  std::vector<std::string> want = {"dtrain", "bench", "--collectives", "--max-bytes", "1024"};
  CHECK(worker_argv(in, "dtrain", {"--nproc-per-node", "--master-addr", "--master-port"}) == want);
}

TEST_CASE("collbench: table and CSV parse back") {
  std::vector<CollectiveRow> rows(2);
  rows[0] = {1024, 256, "allreduce", 50.0, 0.02048, 0.02048, 0};
  rows[1] = {4096, 1024, "allgather", 80.0, 0.0512, 0.0256, 3};
  for (bool csv : {false, true}) {
    std::string text = csv ? format_collective_csv(rows, 2, "gloo") : format_collective_table(rows, 2, "gloo");
    int n = 0;
    auto back = parse_collective_output(text, "x", &n);
    CHECK(n == 2);
    REQUIRE(back.size() == 2);
    CHECK(back[1].op == "allgather");
    CHECK(back[1].bytes == 4096);
    CHECK(back[1].wrong == 3);
    CHECK(back[0].time_us == doctest::Approx(50.0));
  }
  CHECK_THROWS_AS(parse_collective_output("123 oops\n", "f.txt", nullptr), UserError);
}

TEST_CASE("scaling: ring allreduce time and hierarchical composition") {
  LinkModel l{"t", 1e-5, 1e10};
  CHECK(ring_allreduce_s(1e9, 1, l) == 0.0);
  // 2(n-1) alpha + 2(n-1)/n * B / beta with n = 4: 6e-5 + 1.5 * 0.1
  CHECK(ring_allreduce_s(1e9, 4, l) == doctest::Approx(6e-5 + 0.15));
  LinkModel nv = nvlink_h100(), ib = ib_400g();
  CHECK(nv.beta_bytes_per_s == 450e9);
  CHECK(ib.beta_bytes_per_s == 50e9);
  // up to 8: flat ring over the link
  CHECK(allreduce_s(1e8, 8, ib, nv) == doctest::Approx(ring_allreduce_s(1e8, 8, ib)));
  // 64 = 8 nodes of 8: 2 * (7 alpha_nv + 7/8 B/beta_nv) + ring(B/8, 8, ib)
  double want = 2 * (7 * 5e-6 + 7.0 / 8 * 1e8 / 450e9) + ring_allreduce_s(1e8 / 8, 8, ib);
  CHECK(allreduce_s(1e8, 64, ib, nv) == doctest::Approx(want));
  // hierarchical beats a flat IB ring over all 64 GPUs
  CHECK(allreduce_s(1e8, 64, ib, nv) < ring_allreduce_s(1e8, 64, ib));
  CHECK_THROWS_AS(allreduce_s(1e8, 12, ib, nv), UserError);
}

TEST_CASE("scaling: exposed communication and efficiency bounds") {
  ScalingInputs in{"m", 0.1, 1e8, 0.5, 0.6};  // 30 ms of backward can hide comm
  LinkModel fast{"fast", 0, 1e15}, slow{"slow", 0, 1e9};
  ScalingPoint p = predict_point(in, 8, fast, fast);
  CHECK(p.exposed_s == 0.0);
  CHECK(p.efficiency == 1.0);
  ScalingPoint q = predict_point(in, 8, slow, fast);
  CHECK(q.comm_s == doctest::Approx(2 * 7.0 / 8 * 0.1));  // 175 ms
  CHECK(q.exposed_s == doctest::Approx(0.175 - 0.03));
  CHECK(q.efficiency == doctest::Approx(0.1 / (0.1 + 0.145)));
  for (int g : {8, 64, 512}) {
    ScalingPoint r = predict_point(resnet50_h100_measured(), g, ib_400g(), nvlink_h100());
    CHECK(r.efficiency > 0.0);
    CHECK(r.efficiency <= 1.0);
    CHECK(r.step_s >= 0.0719);
  }
}

TEST_CASE("scaling: least squares recovers alpha and beta from synthetic points") {
  const int n = 4;
  LinkModel truth{"t", 7e-6, 3e9};
  std::vector<std::pair<double, double>> pts;
  for (double b = 1024; b <= 64e6; b *= 4) pts.emplace_back(b, ring_allreduce_s(b, n, truth));
  LinkModel fit = fit_link(pts, n, "fit");
  CHECK(fit.alpha_s == doctest::Approx(7e-6).epsilon(1e-6));
  CHECK(fit.beta_bytes_per_s == doctest::Approx(3e9).epsilon(1e-6));
  CHECK_THROWS_AS(fit_link({{1024, 1e-5}}, n, "x"), UserError);
  CHECK_THROWS_AS(fit_link(pts, 1, "x"), UserError);
}

TEST_CASE("scaling: the table has one row per recipe link and GPU count") {
  ScalingInputs other = parse_scaling_entry("toy:0.05:4e6:0.5:0.8");
  CHECK(other.grad_bytes == 4e6);
  CHECK(other.overlap_fraction == 0.8);
  std::string t = predict_scaling_table({resnet50_h100_measured(), other}, {nvlink_h100(), ib_400g()});
  CHECK(t.find("resnet50-b128-h100 (measured)") != std::string::npos);
  CHECK(t.find("toy:") != std::string::npos);
  for (const char* row : {"| nvlink-h100 | 8 |", "| nvlink-h100 | 512 |", "| ib-400g | 64 |", "| ib-400g | 512 |"})
    CHECK(t.find(row) != std::string::npos);
  size_t rows = 0;
  for (size_t p = t.find("\n| "); p != std::string::npos; p = t.find("\n| ", p + 1)) ++rows;
  CHECK(rows == 2 * (1 + 6));  // per recipe: header + 2 links x 3 sizes
  CHECK_THROWS_AS(parse_scaling_entry("toy:abc:4e6"), UserError);
  CHECK_THROWS_AS(parse_scaling_entry("toy:0.1"), UserError);
  CHECK_THROWS_AS(parse_scaling_entry("toy:0.1:5:1.5"), UserError);
}

}  // TEST_SUITE("unit")

TEST_SUITE("integration") {

TEST_CASE("collbench: one-process world runs every op with zero wrong elements") {
  CollectiveBenchArgs a;
  a.max_bytes = 4096;
  a.iters = 2;
  a.warmup = 1;
  a.csv = fmt::format("{}/collbench_w1_{}.csv", DTRAIN_BUILD_DIR, getpid());
  REQUIRE(collective_bench_job(a) == 0);
  int n = 0;
  auto rows = parse_collective_output(read_all(a.csv), a.csv, &n);
  CHECK(n == 1);
  CHECK(rows.size() == 3 * 10);  // 8 B .. 4 KiB, 3 ops
  for (const auto& r : rows) {
    CHECK(r.wrong == 0);
    CHECK(r.busbw_gbs == 0.0);
  }
  std::remove(a.csv.c_str());
}

TEST_CASE("collbench: two ranks on loopback - every row correct") {
  const int port = free_port_coll();
  const std::string csv = fmt::format("{}/collbench_w2_{}.csv", DTRAIN_BUILD_DIR, getpid());
  std::vector<pid_t> kids;
  for (int r = 0; r < 2; ++r) {
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int rc = 3;
      try {
        setenv("RANK", std::to_string(r).c_str(), 1);
        setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
        setenv("WORLD_SIZE", "2", 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
        CollectiveBenchArgs a;
        a.max_bytes = 64 << 10;
        a.iters = 3;
        a.warmup = 1;
        a.timeout_s = 15;
        a.csv = csv;
        rc = collective_bench_job(a);
      } catch (const std::exception& e) {
        fmt::print(stderr, "rank {}: {}\n", r, e.what());
        rc = 4;
      }
      _exit(rc);
    }
    kids.push_back(pid);
  }
  for (pid_t k : kids) {
    int st = 0;
    waitpid(k, &st, 0);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
  }
  int n = 0;
  auto rows = parse_collective_output(read_all(csv), csv, &n);
  CHECK(n == 2);
  CHECK(rows.size() == 3 * 14);  // 8 B .. 64 KiB, 3 ops
  for (const auto& r : rows) {
    CHECK(r.wrong == 0);
    CHECK(r.time_us > 0);
    CHECK(r.busbw_gbs == doctest::Approx(r.algbw_gbs * busbw_factor(r.op, 2)));
  }
  std::remove(csv.c_str());
}

}  // TEST_SUITE("integration")

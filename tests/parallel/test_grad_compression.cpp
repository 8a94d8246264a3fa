// Gradient compression of the data-parallel bucket all-reduce (parallel/grad_compression.h)
// and the communicators' byte counters (comm/communicator.h), on Gloo ranks as threads:
//  * every collective counts the analytic payload volume (ring all-reduce 2(n-1)/n of the
//    bytes, summed over the ranks 2(n-1) x the bytes for any size; reduce-scatter and
//    allgather (n-1) chunks; a broadcast reaches each non-root once; p2p the bytes sent); a
//    split communicator counts its own;
//  * bf16/fp16 buckets equal cast -> ring sum in 16 bits (communicator.h's order) -> x 1/n ->
//    cast back, bit for bit, and send half the bytes of "none";
//  * PowerSGD on 2 ranks equals a one-process reference of the same algorithm (P, Q, error
//    feedback, warm start) within 1e-5 of the values' scale, sends (n+m) r per compressed
//    matrix + the uncompressed elements, keeps a matrix with r >= min(n, m) uncompressed, and
//    runs plain f32 all-reduces during its warm-up.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numeric>
#include <vector>

#include "backend/backend.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "gloo_ranks.h"
#include "nn/params.h"
#include "parallel/grad_buckets.h"
#include "parallel/grad_compression.h"

using namespace dtrain;
using namespace dtrain::comm;
using namespace dtrain::parallel;

namespace {

Tensor cpu(void* p, DType t, int64_t n) { return Tensor(p, t, Device::cpu(), Shape{n}); }

// Sums of the ranks' counters, filled by the rank threads.
struct Totals {
  std::mutex mu;
  std::vector<CommBytes> per_rank;
  std::vector<uint64_t> work;
  explicit Totals(int world) : per_rank(size_t(world)), work(size_t(world)) {}
};

// Gradient values, drawn once into a table: the rank threads and the references read the
// same floats (computed inline, the compiler may contract them into FMAs differently).
float grad_value(int rank, int64_t i, int step) {
  constexpr int64_t kN = 4096, kRanks = 4, kSteps = 4;
  static const std::vector<float> table = [] {
    std::vector<float> t(size_t(kN * kRanks * kSteps));
    Rng rng(5, 1);
    for (auto& x : t) x = rng.normal();
    return t;
  }();
  return table.at(size_t((int64_t(step) * kRanks + rank) * kN + i));
}

void declare(ParamStore& ps, const std::vector<Shape>& shapes) {
  for (size_t i = 0; i < shapes.size(); ++i) {
    ParamDesc d;
    d.name = "p" + std::to_string(i);
    d.shape = shapes[i];
    ps.declare(d);
  }
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("comm bytes: every collective counts its analytic payload volume on 2 3 and 4 ranks") {
  for (int W : {2, 3, 4}) {
    Totals tot(W);
    const size_t n_even = size_t(W) * 2 * 150;  // segments of whole floats: exactly 2(W-1)/W
    const size_t n_odd = 1237;                  // any size: the ranks' sum is 2(W-1) x the bytes
    run_gloo_ranks(W, [&](int r, GlooCommunicator& c) {
      CHECK(c.bytes_sent().total() == 0);
      std::vector<float> a(n_even, 1.f), b(n_odd, 2.f);
      Tensor ta = cpu(a.data(), DType::F32, int64_t(n_even));
      auto w = c.allreduce_async(ta, ReduceOp::Sum);
      w->wait();
      CHECK(w->bytes_sent() == 2 * uint64_t(W - 1) * n_even * 4 / uint64_t(W));
      CHECK(c.bytes_sent().allreduce == 2 * uint64_t(W - 1) * n_even * 4 / uint64_t(W));
      Tensor tb = cpu(b.data(), DType::F32, int64_t(n_odd));
      const uint64_t before = c.bytes_sent().allreduce;
      c.allreduce(tb, ReduceOp::Avg);
      const uint64_t odd = c.bytes_sent().allreduce - before;
      // 16-bit all-reduce (our ring, padded to W chunks of ceil(n/W))
      std::vector<uint16_t> h(n_even, 0x3f80);
      Tensor th = cpu(h.data(), DType::BF16, int64_t(n_even));
      const uint64_t b16 = c.bytes_sent().allreduce;
      c.allreduce(th, ReduceOp::Sum);
      CHECK(c.bytes_sent().allreduce - b16 == 2 * uint64_t(W - 1) * n_even * 2 / uint64_t(W));
      Tensor tf = cpu(h.data(), DType::F16, int64_t(n_even));
      c.allreduce(tf, ReduceOp::Avg);
      CHECK(c.bytes_sent().allreduce - b16 == 2 * (2 * uint64_t(W - 1) * n_even * 2 / uint64_t(W)));
      // reduce-scatter: (W-1) chunks of n
      std::vector<float> in(size_t(W) * 100, 1.f), out(100);
      Tensor ti = cpu(in.data(), DType::F32, int64_t(in.size())), to = cpu(out.data(), DType::F32, 100);
      c.reduce_scatter(ti, to, ReduceOp::Sum);
      CHECK(c.bytes_sent().reduce_scatter == uint64_t(W - 1) * 400);
      // allgather: (W-1) shards
      std::vector<float> sh(33, float(r)), all(33 * size_t(W));
      Tensor ts = cpu(sh.data(), DType::F32, 33), tl = cpu(all.data(), DType::F32, 33 * W);
      c.allgather(ts, tl);
      CHECK(c.bytes_sent().allgather == uint64_t(W - 1) * 33 * 4);
      // broadcast (binomial tree from root 1): counted per rank, summed below
      std::vector<float> bc(77, float(r));
      Tensor tc = cpu(bc.data(), DType::F32, 77);
      c.broadcast(tc, 1);
      // p2p: the bytes of the sends
      std::vector<float> sbuf(25, 1.f), rbuf(25);
      const int right = (r + 1) % W, left = (r + W - 1) % W;
      auto pw = c.p2p_async({P2POp{P2POp::Kind::Send, cpu(sbuf.data(), DType::F32, 25), right, "p2p bytes"},
                             P2POp{P2POp::Kind::Recv, cpu(rbuf.data(), DType::F32, 25), left, "p2p bytes"}});
      pw->wait();
      CHECK(pw->bytes_sent() == 100);
      CHECK(c.bytes_sent().p2p == 100);
      // a split communicator counts its own; the parent's counters do not move
      const CommBytes parent = c.bytes_sent();
      std::vector<int> members;
      for (int k = 0; k < W; k += 2) members.push_back(k);
      auto sub = c.split("even", r % 2 == 0 ? members : std::vector<int>{});
      if (sub) {
        std::vector<float> s(40, 1.f);
        Tensor t = cpu(s.data(), DType::F32, 40);
        sub->allreduce(t, ReduceOp::Sum);
        const uint64_t k = uint64_t(sub->size());
        CHECK(sub->bytes_sent().allreduce == (k > 1 ? 2 * (k - 1) * 160 / k : 0));
      }
      CHECK(c.bytes_sent().total() == parent.total());
      std::lock_guard<std::mutex> g(tot.mu);
      tot.per_rank[size_t(r)] = c.bytes_sent();
      tot.work[size_t(r)] = odd;
    });
    uint64_t odd_sum = 0, bcast_sum = 0;
    for (int r = 0; r < W; ++r) {
      odd_sum += tot.work[size_t(r)];
      bcast_sum += tot.per_rank[size_t(r)].broadcast;
      CHECK(tot.work[size_t(r)] == wire::gloo_allreduce(n_odd, 4, W, r));
    }
    INFO("world " << W);
    CHECK(odd_sum == 2 * uint64_t(W - 1) * n_odd * 4);  // every segment passes W-1 links per phase
    CHECK(bcast_sum == uint64_t(W - 1) * 77 * 4);       // every non-root receives the tensor once
    CHECK(tot.per_rank[1].broadcast > 0);               // the root sends
  }
}

TEST_CASE("grad compression: bf16 and fp16 buckets equal cast - ring sum - average - cast back on 2 and 3 ranks") {
  for (int W : {2, 3}) {
    for (GradCompression kind : {GradCompression::BF16, GradCompression::FP16}) {
      const std::vector<Shape> shapes = {Shape{7}, Shape{40, 31}, Shape{5, 3}, Shape{1003}, Shape{9}};
      Totals tot(W);
      std::vector<uint64_t> plain(static_cast<size_t>(W));
      run_gloo_ranks(W, [&](int r, GlooCommunicator& c) {
        auto be = make_backend("cpu", 0, 1);
        ParamStore ps;
        declare(ps, shapes);
        ps.finalize(*be);
        const int64_t N = ps.num_params();
        float* g = ps.flat_grads().f32();
        CompressionOptions o;
        o.kind = kind;
        GradBuckets gb(c, ps, /*bucket_mb=*/0.004, /*first_bucket_mb=*/0.002, o);
        REQUIRE(gb.buckets().size() >= 2);
        auto to16 = [&](float x) { return kind == GradCompression::BF16 ? f32_to_bf16(x) : f32_to_f16(x); };
        auto to32 = [&](uint16_t x) { return kind == GradCompression::BF16 ? bf16_to_f32(x) : f16_to_f32(x); };
        for (int step = 0; step < 2; ++step) {
          for (int64_t i = 0; i < N; ++i) g[i] = grad_value(r, i, step) * 3.1f;
          gb.begin_step(true);
          for (int id = int(shapes.size()) - 1; id >= 0; --id) gb.on_grad_ready(id);
          gb.finish();
          size_t wrong = 0;
          for (const Bucket& b : gb.buckets()) {
            const int64_t n = b.end - b.begin, m = (n + W - 1) / W;
            for (int64_t k = 0; k < n; ++k) {
              const int64_t i = b.begin + k, chunk = k / m;
              uint16_t acc = to16(grad_value(int((chunk + 1) % W), i, step) * 3.1f);
              for (int j = 2; j <= W; ++j)
                acc = to16(to32(to16(grad_value(int((chunk + j) % W), i, step) * 3.1f)) + to32(acc));
              acc = to16(to32(acc) * (1.f / float(W)));
              wrong += g[i] != to32(acc);
            }
          }
          CHECK(wrong == 0);
        }
        // the same bucket plan without compression: f32, twice the bytes
        ParamStore ps2;
        declare(ps2, shapes);
        ps2.finalize(*be);
        GradBuckets none(c, ps2, 0.004, 0.002);
        none.begin_step(true);
        none.finish();
        std::lock_guard<std::mutex> lk(tot.mu);
        tot.work[size_t(r)] = gb.last_bytes();
        plain[size_t(r)] = none.last_bytes();
      });
      const uint64_t comp = std::accumulate(tot.work.begin(), tot.work.end(), uint64_t(0));
      const uint64_t f32 = std::accumulate(plain.begin(), plain.end(), uint64_t(0));
      INFO("world " << W << " " << grad_compression_name(kind) << ": " << comp << " vs " << f32 << " bytes");
      // 16-bit: the ranks send 2(W-1) x the padded chunks' 2 bytes; f32: 2(W-1) x 4 bytes
      CHECK(double(comp) / double(f32) == doctest::Approx(0.5).epsilon(0.01));
      CHECK(comp <= f32 / 2 + 2 * uint64_t(W) * uint64_t(W) * 2 * 8);  // padding: < W elements per bucket
    }
  }
}

TEST_CASE("grad compression: PowerSGD on 2 ranks equals a one-process reference with error feedback") {
  const int W = 2, R = 4, steps = 3;
  // [16,3,3,4] -> M [16,36] r 4; [8] and [3,50] (r >= min(n,m)) uncompressed; [20,30] r 4
  const std::vector<Shape> shapes = {Shape{16, 3, 3, 4}, Shape{8}, Shape{3, 50}, Shape{20, 30}};
  for (int64_t start : {0, 1}) {
    Totals tot(W);
    std::vector<std::vector<float>> got(W), err(W);
    std::vector<std::vector<PsgdMatrix>> plans(W);
    std::vector<std::vector<float>> step0(W);
    run_gloo_ranks(W, [&](int r, GlooCommunicator& c) {
      auto be = make_backend("cpu", 0, 1);
      ParamStore ps;
      declare(ps, shapes);
      ps.finalize(*be);
      const int64_t N = ps.num_params();
      float* g = ps.flat_grads().f32();
      CompressionOptions o;
      o.kind = GradCompression::PowerSGD;
      o.powersgd_rank = R;
      o.powersgd_start_step = start;
      o.seed = 11;
      GradBuckets gb(c, ps, 1, 1, o);
      REQUIRE(gb.buckets().size() == 1);
      uint64_t bytes = 0;
      for (int step = 0; step < steps; ++step) {
        for (int64_t i = 0; i < N; ++i) g[i] = grad_value(r, i, step);
        gb.begin_step(true);
        for (int id = int(shapes.size()) - 1; id >= 0; --id) gb.on_grad_ready(id);
        gb.finish();
        if (step == 0) step0[size_t(r)].assign(g, g + N);
        bytes = gb.last_bytes();
      }
      got[size_t(r)].assign(g, g + N);
      err[size_t(r)] = gb.compressor()->psgd_error(0);
      plans[size_t(r)] = gb.compressor()->psgd_plan(0);
      std::lock_guard<std::mutex> lk(tot.mu);
      tot.work[size_t(r)] = bytes;
    });
    const std::vector<PsgdMatrix>& plan = plans[0];
    REQUIRE(plan.size() == 4);
    CHECK(plan[0].rank == 4);
    CHECK(plan[0].cols == 36);
    CHECK(plan[1].rank == 0);
    CHECK(plan[2].rank == 0);  // r = min(3, 50, 4) = 3 compresses nothing: all-reduced as is
    CHECK(plan[3].rank == 4);
    // the reference: one process, double precision, the documented algorithm
    int64_t N = 0;
    for (auto& s : shapes) N += s.numel();
    std::vector<std::vector<double>> E(W, std::vector<double>(size_t(N), 0.0));
    std::vector<std::vector<double>> Q(plan.size());
    std::vector<double> ref(static_cast<size_t>(N));
    for (int step = 0; step < steps; ++step) {
      for (size_t k = 0; k < plan.size(); ++k) {
        const PsgdMatrix& m = plan[k];
        const int64_t rows = m.rows, cols = m.cols, r = m.rank;
        if (r == 0 || step < start) {
          for (int64_t i = m.offset; i < m.offset + rows * cols; ++i)
            ref[size_t(i)] = double(float(double(grad_value(0, i, step)) + double(grad_value(1, i, step))) * 0.5f);
          continue;
        }
        if (Q[k].empty()) {  // the documented first draw: Rng(seed, stream(bucket 0, param)), orthogonalized
          std::vector<float> q(size_t(cols * r));
          Rng rng(11, stream_id(0x9577d, 0, uint64_t(m.param)));
          for (auto& x : q) x = rng.normal();
          orthogonalize_columns(q.data(), cols, r);
          Q[k].assign(q.begin(), q.end());
        }
        std::vector<std::vector<double>> M(W, std::vector<double>(size_t(rows * cols)));
        std::vector<double> P(size_t(rows * r), 0.0);
        for (int w = 0; w < W; ++w)
          for (int64_t i = 0; i < rows * cols; ++i)
            M[size_t(w)][size_t(i)] = double(grad_value(w, m.offset + i, step)) + E[size_t(w)][size_t(m.offset + i)];
        for (int w = 0; w < W; ++w)
          for (int64_t a = 0; a < rows; ++a)
            for (int64_t j = 0; j < r; ++j)
              for (int64_t b = 0; b < cols; ++b)
                P[size_t(a * r + j)] += M[size_t(w)][size_t(a * cols + b)] * Q[k][size_t(b * r + j)];
        for (int64_t j = 0; j < r; ++j) {  // Gram-Schmidt
          double nrm = 0;
          for (int64_t a = 0; a < rows; ++a) nrm += P[size_t(a * r + j)] * P[size_t(a * r + j)];
          nrm = std::sqrt(nrm);
          for (int64_t a = 0; a < rows; ++a) P[size_t(a * r + j)] /= nrm;
          for (int64_t l = j + 1; l < r; ++l) {
            double dot = 0;
            for (int64_t a = 0; a < rows; ++a) dot += P[size_t(a * r + j)] * P[size_t(a * r + l)];
            for (int64_t a = 0; a < rows; ++a) P[size_t(a * r + l)] -= dot * P[size_t(a * r + j)];
          }
        }
        std::fill(Q[k].begin(), Q[k].end(), 0.0);
        for (int w = 0; w < W; ++w)
          for (int64_t b = 0; b < cols; ++b)
            for (int64_t j = 0; j < r; ++j)
              for (int64_t a = 0; a < rows; ++a)
                Q[k][size_t(b * r + j)] += M[size_t(w)][size_t(a * cols + b)] * P[size_t(a * r + j)] / W;
        for (int64_t a = 0; a < rows; ++a)
          for (int64_t b = 0; b < cols; ++b) {
            double v = 0;
            for (int64_t j = 0; j < r; ++j) v += P[size_t(a * r + j)] * Q[k][size_t(b * r + j)];
            ref[size_t(m.offset + a * cols + b)] = v;
            for (int w = 0; w < W; ++w)
              E[size_t(w)][size_t(m.offset + a * cols + b)] = M[size_t(w)][size_t(a * cols + b)] - v;
          }
      }
      if (step == 0 && start == 1)  // warm-up: the plain f32 average, exactly
        for (int w = 0; w < W; ++w)
          for (int64_t i = 0; i < N; ++i) CHECK(step0[size_t(w)][size_t(i)] == float(ref[size_t(i)]));
    }
    double scale = 0, worst = 0, worst_e = 0;
    for (double v : ref) scale = std::max(scale, std::fabs(v));
    for (int w = 0; w < W; ++w) {
      for (int64_t i = 0; i < N; ++i) worst = std::max(worst, std::fabs(double(got[size_t(w)][size_t(i)]) - ref[size_t(i)]));
      int64_t at = 0;  // E packed over the compressed matrices, in plan order
      for (const PsgdMatrix& m : plan) {
        if (m.rank == 0) continue;
        for (int64_t i = 0; i < m.rows * m.cols; ++i)
          worst_e = std::max(worst_e, std::fabs(double(err[size_t(w)][size_t(at + i)]) - E[size_t(w)][size_t(m.offset + i)]));
        at += m.rows * m.cols;
      }
    }
    MESSAGE("PowerSGD start step " << start << ": scale " << scale << ", worst gradient error " << worst
                                   << ", worst error-feedback error " << worst_e);
    CHECK(worst <= 1e-5 * scale);
    CHECK(worst_e <= 1e-5 * scale);
    // bytes: f32 ring all-reduces of the uncompressed elements, the P's and the Q's; the two
    // ranks together send 2(W-1) x each all-reduce's bytes
    const uint64_t plain = 8 + 150, ps = 16 * 4 + 20 * 4, qs = 36 * 4 + 30 * 4;
    CHECK(tot.work[0] + tot.work[1] == 2 * uint64_t(W - 1) * 4 * (plain + ps + qs));
    CHECK(tot.work[0] == wire::gloo_allreduce(plain, 4, W, 0) + wire::gloo_allreduce(ps, 4, W, 0) +
                             wire::gloo_allreduce(qs, 4, W, 0));
  }
}

}  // TEST_SUITE

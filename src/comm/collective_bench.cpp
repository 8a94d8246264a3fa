#include "comm/collective_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "backend/backend.h"
#include "core/error.h"
#include "core/log.h"
#include "comm/communicator.h"
#include "comm/env.h"
#include "comm/launcher.h"
#include "comm/rendezvous.h"
#include "comm/store.h"

namespace dtrain::comm {

double busbw_factor(const std::string& op, int n) {
  if (n <= 1) return 0.0;
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "reduce_scatter" || op == "allgather") return double(n - 1) / n;
  user_error("collective op \"{}\": expected allreduce, reduce_scatter or allgather", op);
}

std::vector<int64_t> sweep_counts(int64_t min_bytes, int64_t max_bytes, int step_factor, int n) {
  if (min_bytes < 4) user_error("--min-bytes {}: expected at least 4 (one f32)", min_bytes);
  if (max_bytes < min_bytes) user_error("--max-bytes {}: expected >= --min-bytes {}", max_bytes, min_bytes);
  if (max_bytes > (int64_t(1) << 34)) user_error("--max-bytes {}: expected at most 16 GiB", max_bytes);
  if (step_factor < 2) user_error("--step-factor {}: expected an integer >= 2", step_factor);
  std::vector<int64_t> out;
  std::set<int64_t> seen;
  for (int64_t b = min_bytes; b <= max_bytes; b *= step_factor) {
    int64_t c = b / 4;
    c -= c % n;
    if (c < n) c = n;
    if (seen.insert(c).second) out.push_back(c);
    if (b > max_bytes / step_factor) break;  // no overflow
  }
  return out;
}

namespace {

// Small integers: every sum over a few hundred ranks stays exact in f32.
float ar_in(int rank, int64_t i) { return float(rank + 1 + i % 5); }
float rs_in(int rank, int64_t j) { return float(rank + 1 + j % 7); }
float ag_in(int rank, int64_t k) { return float(rank * 3 + k % 13); }

struct DevBuf {
  Backend& be;
  void* p = nullptr;
  DevBuf(Backend& b, size_t bytes) : be(b), p(b.alloc(bytes ? bytes : 4)) {}
  ~DevBuf() { be.free(p); }
  Tensor t(int64_t count, size_t byte_offset = 0) const {
    return Tensor(static_cast<char*>(p) + byte_offset, DType::F32, be.device(), Shape{count});
  }
};


}  // namespace

std::vector<CollectiveRow> run_collective_bench(const CollectiveBenchArgs& a, Communicator& comm, Backend& be) {
  if (a.iters < 1) user_error("--iters {}: expected >= 1", a.iters);
  if (a.warmup < 0) user_error("--warmup {}: expected >= 0", a.warmup);
  if (a.ops.empty()) user_error("--ops: expected at least one of allreduce, reduce_scatter, allgather");
  for (const auto& op : a.ops) (void)busbw_factor(op, 2);  // names a known op
  const int n = comm.size(), r = comm.rank();
  const std::vector<int64_t> counts = sweep_counts(a.min_bytes, a.max_bytes, a.step_factor, n);
  const int64_t max_count = counts.back();
  DevBuf big(be, size_t(max_count) * 4), shard(be, size_t(max_count / n) * 4 + 4), wrong_buf(be, 4);
  std::vector<float> host(static_cast<size_t>(max_count));

  std::vector<CollectiveRow> rows;
  for (const auto& op : a.ops) {
    for (int64_t count : counts) {
      const int64_t c = count / n;  // shard elements
      Tensor full = big.t(count), sh = shard.t(c), own = big.t(c, size_t(r * c) * 4);
      auto run_once = [&] {
        if (op == "allreduce") comm.allreduce(full, ReduceOp::Sum);
        else if (op == "reduce_scatter") comm.reduce_scatter(full, sh, ReduceOp::Sum);
        else comm.allgather(own, full);
      };
      // Timed part: contents do not matter (sums of small values stay finite).
      std::fill(host.begin(), host.begin() + count, 0.0f);
      be.copy_from_host(full.data, host.data(), size_t(count) * 4);
      for (int i = 0; i < a.warmup; ++i) run_once();
      be.synchronize();
      comm.barrier();
      // As nccl-tests: enqueue every timed call, then wait for all of them.
      std::vector<std::shared_ptr<Work>> pending;
      pending.reserve(size_t(a.iters));
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < a.iters; ++i) {
        if (op == "allreduce") pending.push_back(comm.allreduce_async(full, ReduceOp::Sum));
        else if (op == "reduce_scatter") pending.push_back(comm.reduce_scatter_async(full, sh, ReduceOp::Sum));
        else pending.push_back(comm.allgather_async(own, full));
      }
      for (auto& w : pending) w->wait();
      be.synchronize();
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / a.iters;

      // Checked call with rank-dependent inputs and exact expected outputs.
      for (int64_t i = 0; i < count; ++i)
        host[size_t(i)] = op == "allreduce" ? ar_in(r, i) : op == "reduce_scatter" ? rs_in(r, i) : 0.0f;
      if (op == "allgather")
        for (int64_t k = 0; k < c; ++k) host[size_t(r * c + k)] = ag_in(r, k);
      be.copy_from_host(full.data, host.data(), size_t(count) * 4);
      run_once();
      int64_t wrong = 0;
      const double tri = double(n) * (n + 1) / 2;
      if (op == "reduce_scatter") {
        be.copy_to_host(host.data(), sh.data, size_t(c) * 4);
        for (int64_t k = 0; k < c; ++k)
          wrong += host[size_t(k)] != float(tri + double(n) * ((r * c + k) % 7));
      } else {
        be.copy_to_host(host.data(), full.data, size_t(count) * 4);
        for (int64_t i = 0; i < count; ++i) {
          float want = op == "allreduce" ? float(tri + double(n) * (i % 5)) : ag_in(int(i / c), i % c);
          wrong += host[size_t(i)] != want;
        }
      }
      float wf = float(wrong);
      Tensor wt = wrong_buf.t(1);
      be.copy_from_host(wt.data, &wf, 4);
      comm.allreduce(wt, ReduceOp::Sum);
      be.copy_to_host(&wf, wt.data, 4);

      CollectiveRow row;
      row.bytes = count * 4;
      row.count = count;
      row.op = op;
      row.time_us = secs * 1e6;
      row.algbw_gbs = double(row.bytes) / secs / 1e9;
      row.busbw_gbs = row.algbw_gbs * busbw_factor(op, n);
      row.wrong = int64_t(wf);
      rows.push_back(row);
    }
  }
  return rows;
}

std::string format_collective_table(const std::vector<CollectiveRow>& rows, int nranks, const std::string& backend) {
  std::string s = fmt::format("# dtrain collective benchmark: backend {}, nranks {}\n", backend, nranks);
  s += "# busbw factor: allreduce 2(n-1)/n, reduce_scatter and allgather (n-1)/n\n";
  s += fmt::format("# {:>12} {:>12} {:>6} {:>15} {:>12} {:>10} {:>10} {:>8}\n", "size(B)", "count(elems)", "type",
                   "op", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
  for (const auto& r : rows)
    s += fmt::format("  {:>12} {:>12} {:>6} {:>15} {:>12.1f} {:>10.3f} {:>10.3f} {:>8}\n", r.bytes, r.count, "float",
                     r.op, r.time_us, r.algbw_gbs, r.busbw_gbs, r.wrong);
  return s;
}

std::string format_collective_csv(const std::vector<CollectiveRow>& rows, int nranks, const std::string& backend) {
  std::string s = "size_bytes,count,type,op,time_us,algbw_gbs,busbw_gbs,wrong,nranks,backend\n";
  for (const auto& r : rows)
    s += fmt::format("{},{},float,{},{:.3f},{:.6f},{:.6f},{},{},{}\n", r.bytes, r.count, r.op, r.time_us,
                     r.algbw_gbs, r.busbw_gbs, r.wrong, nranks, backend);
  return s;
}

std::vector<CollectiveRow> parse_collective_output(const std::string& text, const std::string& source, int* nranks) {
  std::vector<CollectiveRow> rows;
  int n = 0;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (auto p = line.find("nranks "); line.rfind("#", 0) == 0 && p != std::string::npos)
      n = std::atoi(line.c_str() + p + 7);
    std::string l = line;
    for (char& ch : l)
      if (ch == ',') ch = ' ';
    std::istringstream ls(l);
    std::vector<std::string> f;
    for (std::string w; ls >> w;) f.push_back(w);
    if (f.empty() || f[0].find_first_not_of("0123456789") != std::string::npos) continue;
    try {
      if (f.size() < 8) throw std::invalid_argument("too few fields");
      CollectiveRow r;
      r.bytes = std::stoll(f[0]);
      r.count = std::stoll(f[1]);
      r.op = f[3];
      r.time_us = std::stod(f[4]);
      r.algbw_gbs = std::stod(f[5]);
      r.busbw_gbs = std::stod(f[6]);
      r.wrong = std::stoll(f[7]);
      if (f.size() >= 9) n = std::stoi(f[8]);
      rows.push_back(r);
    } catch (const std::exception&) {
      user_error("{}:{}: \"{}\": expected a collective-benchmark row (size count type op time_us algbw busbw #wrong)",
                 source, lineno, line);
    }
  }
  if (nranks) *nranks = n;
  return rows;
}

void validate_collective_args(const CollectiveBenchArgs& a) {
  if (a.device != "cpu" && a.device != "cuda")
    user_error("--device {}: expected cpu (Gloo) or cuda (NCCL)", a.device);
  if (a.nproc_per_node < 1) user_error("--nproc-per-node {}: expected >= 1", a.nproc_per_node);
  (void)sweep_counts(a.min_bytes, a.max_bytes, a.step_factor, 1);
  for (const auto& op : a.ops) (void)busbw_factor(op, 2);  // names a known op
}

int collective_bench_job(const CollectiveBenchArgs& a) {
  validate_collective_args(a);
  DistEnv env = dist_env();
  std::string token = env.job_token;
  if (token.empty()) token = "dtrain:" + env.master_addr + ":" + std::to_string(env.master_port);
  const auto timeout = std::chrono::milliseconds(int64_t(a.timeout_s * 1000));
  Rendezvous rdzv;
  if (!env.distributed) {  // a one-process world: its own private store on a free port
    env.master_addr = "127.0.0.1";
    rdzv.server = std::make_unique<StoreServer>("127.0.0.1", 0, token);
    rdzv.store = std::make_unique<StoreClient>(env.master_addr, rdzv.server->port(), token, timeout);
  } else {
    rdzv = open_rendezvous(env, token, timeout);
  }
  Store& store = *rdzv.store;
  std::unique_ptr<Backend> be = make_backend(a.device, env.local_rank, 1);
  auto comm = make_communicator(env, store, *be, a.timeout_s);
  std::vector<CollectiveRow> rows = run_collective_bench(a, *comm, *be);
  int64_t wrong = 0;
  for (const auto& r : rows) wrong += r.wrong;
  if (comm->rank() == 0) {
    std::string table = format_collective_table(rows, comm->size(), comm->backend_name());
    fmt::print("{}", table);
    std::fflush(stdout);
    if (!a.csv.empty()) {
      std::ofstream f(a.csv);
      if (!f) user_error("--csv {}: cannot open for writing", a.csv);
      f << format_collective_csv(rows, comm->size(), comm->backend_name());
    }
  }
  comm->barrier();  // rank 0's store outlives every rank's last collective
  return wrong == 0 ? 0 : 1;
}

}  // namespace dtrain::comm

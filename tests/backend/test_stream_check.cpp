// The stream-order checker (backend/stream_check.h, DTRAIN_STREAM_CHECK): CUDA's ordering
// rules held against what a CPU run issues. Each case builds the situation a GPU run would
// race in, checks that the checker names both sides, and that the one call the contract asks
// for (an event wait, a host wait, the communicator's producer ordering) makes it clean:
//  * a missing wait: the compute stream reads an all-reduce's output before Work::wait();
//  * ZeRO-3's prefetch into a slot that queued kernels still read (a write after a read on a
//    reused buffer), and the same with the producer edge a communicator adds;
//  * a host read of a pinned buffer that an asynchronous copy is still writing;
//  * a pipeline receive read before its group completed, and a receive matched out of order;
//  * the decisions are the host's issue order's, never the timing (the same verdicts with the
//    ops' real execution delayed or not).
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <thread>

#include "backend/checked_backend.h"
#include "backend/cpu/cpu_backend.h"
#include "comm/gloo_comm.h"
#include "comm/store.h"
#include "core/buffer.h"
#include "core/error.h"

using namespace dtrain;

namespace {

std::unique_ptr<Backend> checked_cpu() {
  return std::make_unique<CheckedBackend>(std::make_unique<CpuBackend>(1), std::make_shared<StreamChecker>());
}

std::string race_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const RuntimeFault& e) {
    return e.what();
  }
  return "";
}

// A one-rank Gloo communicator over `be` (its own store server on loopback).
struct OneRank {
  comm::StoreServer server{"127.0.0.1", 0, "stream-check"};
  comm::StoreClient store{"127.0.0.1", server.port(), "stream-check", std::chrono::seconds(5)};
  std::unique_ptr<comm::GlooCommunicator> comm;
  explicit OneRank(Backend& be) {
    comm::GlooOptions o;
    o.timeout_s = 5;
    comm = std::make_unique<comm::GlooCommunicator>(store, 0, 1, o, &be);
  }
};

}  // namespace

TEST_CASE("stream check: a read of an all-reduce's output before its wait is a race naming both sides") {
  auto be = checked_cpu();
  OneRank one(*be);
  Buffer gb(*be, 64 * 4), yb(*be, 64 * 4);
  Tensor g = gb.tensor(DType::F32, Shape{8, 8}), y = yb.tensor(DType::F32, Shape{8, 8});
  be->stream_checker()->name(g.data, g.nbytes(), "grads[layer.weight]");
  be->fill(g, 1.f);
  auto w = one.comm->allreduce_async(g, comm::ReduceOp::Avg);  // ordered after the fill: no race
  const std::string msg = race_of([&] { be->gemm(false, false, 1.f, g, g, 0.f, y); });
  CAPTURE(msg);
  CHECK(msg.find("stream-order race on grads[layer.weight] (bytes 0-256 of it): gemm (op 2 on stream 'compute') "
                 "reads it while gloo allreduce of group 'world' (op 1 on stream 'gloo world') may still be writing it") !=
        std::string::npos);
  // the same, with the wait the contract asks for
  auto be2 = checked_cpu();
  OneRank two(*be2);
  Buffer gb2(*be2, 64 * 4), yb2(*be2, 64 * 4);
  Tensor g2 = gb2.tensor(DType::F32, Shape{8, 8}), y2 = yb2.tensor(DType::F32, Shape{8, 8});
  be2->fill(g2, 1.f);
  auto w2 = two.comm->allreduce_async(g2, comm::ReduceOp::Avg);
  w2->wait();
  CHECK_NOTHROW(be2->gemm(false, false, 1.f, g2, g2, 0.f, y2));
  w->wait();
}

TEST_CASE("stream check: a collective is ordered after the compute work that produced its input") {
  // Without the producer edge (a stream that never waits for the compute stream, as the NCCL
  // communicator's was when nothing set its producer), the all-gather reads a cast that the
  // compute stream may not have run yet.
  auto be = checked_cpu();
  Buffer a(*be, 256 * 4), b(*be, 256 * 2);
  Tensor master = a.tensor(DType::F32, Shape{256}), half = b.tensor(DType::BF16, Shape{256});
  be->fill(master, 0.5f);
  be->cast(master, half);
  auto comm_stream = be->make_stream("nccl dp (no producer edge)");
  std::string msg = race_of([&] { comm_stream->issue("allgather #0", {reads(half)}); });
  CAPTURE(msg);
  CHECK(msg.find("allgather #0 (op 1 on stream 'nccl dp (no producer edge)') reads it while cast (op 2 on stream "
                 "'compute') may still be writing it") != std::string::npos);
  // with the edge: clean
  auto ordered = be->make_stream("nccl dp");
  ordered->wait_for(be->compute_stream());
  CHECK_NOTHROW(ordered->issue("allgather #0", {reads(half)}));
}

TEST_CASE("stream check: ZeRO-3's prefetch into a slot that queued kernels still read is a write after a read") {
  // unit 0's forward reads slot A; the prefetch of unit 2 gathers into slot A again. On a GPU
  // the gather may run while the GEMM that reads the slot is still queued.
  auto be = checked_cpu();
  Buffer slot(*be, 64 * 4), xb(*be, 64 * 4), yb(*be, 64 * 4), shard(*be, 64 * 4);
  Tensor w = slot.tensor(DType::F32, Shape{8, 8}), x = xb.tensor(DType::F32, Shape{8, 8}),
         y = yb.tensor(DType::F32, Shape{8, 8}), mine = shard.tensor(DType::F32, Shape{64});
  be->stream_checker()->name(w.data, w.nbytes(), "zero3 window slot 0");
  be->fill(x, 1.f);
  be->fill(mine, 2.f);
  auto comm_stream = be->make_stream("gloo dp_shard");
  comm_stream->wait_for(be->compute_stream());
  comm_stream->issue("allgather (unit 0)", {reads(mine), writes(w)});
  be->compute_stream().wait_for(*comm_stream);  // the unit's gather waited for before its forward
  be->gemm(false, true, 1.f, x, w, 0.f, y);     // unit 0's forward reads the slot
  const std::string msg = race_of([&] { comm_stream->issue("allgather (unit 2)", {reads(mine), writes(w)}); });
  CAPTURE(msg);
  CHECK(msg.find("stream-order race on zero3 window slot 0") != std::string::npos);
  CHECK(msg.find("allgather (unit 2) (op 2 on stream 'gloo dp_shard') writes it while gemm (op 3 on stream "
                 "'compute') may still be reading it") != std::string::npos);
  // the producer edge every communicator adds before an operation makes it safe
  comm_stream->wait_for(be->compute_stream());
  CHECK_NOTHROW(comm_stream->issue("allgather (unit 2)", {reads(mine), writes(w)}));
}

TEST_CASE("stream check: a host read of a staging buffer that a copy is still writing") {
  auto be = checked_cpu();
  Buffer g(*be, 1024 * 4);
  Tensor grads = g.tensor(DType::F32, Shape{1024});
  be->fill(grads, 3.f);
  float* host = static_cast<float*>(be->alloc_host(1024 * 4));
  const uint64_t t1 = be->copy_to_host_async(host, grads.data, 512 * 4);
  const uint64_t t2 = be->copy_to_host_async(host + 512, grads.f32() + 512, 512 * 4);
  be->copy_wait(t1);
  CHECK_NOTHROW(be->host_access("offload update of chunk 0", {reads(host, 512 * 4)}));
  const std::string msg = race_of([&] { be->host_access("offload update of chunk 1", {reads(host + 512, 512 * 4)}); });
  CAPTURE(msg);
  CHECK(msg.find("offload update of chunk 1 (op 2 on stream 'host') reads it while copy_to_host_async (op 2 on stream "
                 "'copy device->host') may still be writing it") != std::string::npos);
  be->copy_wait(t2);
  CHECK_NOTHROW(be->host_access("offload update of chunk 1", {reads(host + 512, 512 * 4)}));
  // the update's result goes back on the other copy stream; the compute stream reads the new
  // parameters only after copy_join
  const uint64_t t3 = be->copy_from_host_async(grads.data, host, 1024 * 4);
  CHECK(race_of([&] { be->scale(grads, 2.f); }).find("scale (op") != std::string::npos);
  be->copy_wait(t3);
  be->copy_join();
  CHECK_NOTHROW(be->scale(grads, 2.f));
  be->free_host(host);
}

TEST_CASE("stream check: a receive buffer read before its point-to-point group completed") {
  auto be = checked_cpu();
  Buffer in(*be, 32 * 4), out(*be, 32 * 4);
  Tensor act = in.tensor(DType::F32, Shape{4, 8}), y = out.tensor(DType::F32, Shape{4, 8});
  be->stream_checker()->name(act.data, act.nbytes(), "activations of micro-batch 1 for virtual stage 1");
  auto pp = be->make_stream("gloo pp");
  pp->wait_for(be->compute_stream());
  StreamMark recv = pp->issue("p2p (recv from rank 0: activations of micro-batch 1 for virtual stage 1)", {writes(act)});
  const std::string msg = race_of([&] { be->gelu_fwd(act, y); });
  CAPTURE(msg);
  CHECK(msg.find("stream-order race on activations of micro-batch 1 for virtual stage 1") != std::string::npos);
  CHECK(msg.find("gelu_fwd (op 1 on stream 'compute') reads it while p2p (recv from rank 0") != std::string::npos);
  recv.host_wait();  // Work::wait()
  CHECK_NOTHROW(be->gelu_fwd(act, y));
}

TEST_CASE("stream check: verdicts follow the issue order and not the timing") {
  // The same sequence twice, once with the host pausing between the ops (as if the device had
  // long finished): a missing edge is a race both times, since nothing orders the two.
  for (bool pause : {false, true}) {
    CAPTURE(pause);
    auto be = checked_cpu();
    Buffer b(*be, 16 * 4);
    Tensor t = b.tensor(DType::F32, Shape{16});
    be->fill(t, 1.f);
    if (pause) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto s = be->make_stream("comm");
    CHECK(race_of([&] { s->issue("allreduce", {writes(t)}); }).find("stream-order race") != std::string::npos);
  }
}

TEST_CASE("stream check: a write covering several earlier accesses merges them and forget drops history") {
  StreamChecker c;
  const auto s1 = c.add_stream("a"), s2 = c.add_stream("b");
  std::vector<char> mem(4096);
  for (int i = 0; i < 16; ++i) c.issue(s1, "small writes", {writes(mem.data() + i * 256, 256)});
  c.wait_stream(s2, s1);
  c.issue(s2, "one big write", {writes(mem.data(), 4096)});
  // s1 never waited for s2: its read of any part races with the big write
  CHECK_THROWS_WITH_AS(c.issue(s1, "read", {reads(mem.data() + 1000, 8)}), doctest::Contains("one big write (op 1"),
                       RuntimeFault);
  c.forget(mem.data(), 4096);
  CHECK_NOTHROW(c.issue(s1, "read", {reads(mem.data() + 1000, 8)}));
  CHECK(c.issued() == 19);
}

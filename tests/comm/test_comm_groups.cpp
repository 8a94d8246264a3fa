// Process groups (Communicator::split), the device mesh, point-to-point, and what a
// collective's failure says. Ranks run as threads, each with its own StoreClient and Gloo
// world communicator, on loopback (as in test_dist.cpp); tensors are tiny, timeouts short.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <numeric>
#include <thread>

#include "comm/gloo_comm.h"
#include "comm/mesh.h"
#include "comm/store.h"
#include "gloo_ranks.h"
#include "core/error.h"

using namespace dtrain;
using namespace dtrain::comm;
using namespace std::chrono_literals;

namespace {


void run_ranks(int world, const std::function<void(int, GlooCommunicator&)>& fn, double timeout_s = 5) {
  run_gloo_ranks(world, fn, timeout_s);
}

Tensor cpu(std::vector<float>& v) { return Tensor(v.data(), DType::F32, Device::cpu(), Shape{int64_t(v.size())}); }
Tensor cpu(float* p, DType t, int64_t n) { return Tensor(p, t, Device::cpu(), Shape{n}); }

// The four collectives on `c`, each rank contributing values made of its GLOBAL rank.
void check_collectives(Communicator& c, size_t n) {
  const int W = c.size(), me = c.rank();
  const std::vector<int> g = c.global_ranks();
  auto v = [](int global, size_t i) { return float(global * 100) + float(i); };
  std::vector<float> a(n);
  for (size_t i = 0; i < n; ++i) a[i] = v(g[size_t(me)], i);
  Tensor ta = cpu(a);
  c.allreduce(ta, ReduceOp::Sum);
  bool ok = true;
  for (size_t i = 0; i < n; ++i) {
    float s = 0;
    for (int k = 0; k < W; ++k) s += v(g[size_t(k)], i);
    ok = ok && a[i] == s;
  }
  CHECK_MESSAGE(ok, "allreduce in " << c.group_name());
  std::vector<float> sh(n), out(n * size_t(W), -1.f);
  for (size_t i = 0; i < n; ++i) sh[i] = v(g[size_t(me)], i);
  Tensor tsh = cpu(sh), tout = cpu(out);
  c.allgather(tsh, tout);
  ok = true;
  for (int k = 0; k < W; ++k)
    for (size_t i = 0; i < n; ++i) ok = ok && out[size_t(k) * n + i] == v(g[size_t(k)], i);
  CHECK_MESSAGE(ok, "allgather in " << c.group_name());
  std::vector<float> in(n * size_t(W)), rs(n, -1.f);
  for (size_t i = 0; i < in.size(); ++i) in[i] = v(g[size_t(me)], i);
  Tensor tin = cpu(in), trs = cpu(rs);
  c.reduce_scatter(tin, trs, ReduceOp::Sum);
  ok = true;
  for (size_t i = 0; i < n; ++i) {
    float s = 0;
    for (int k = 0; k < W; ++k) s += v(g[size_t(k)], size_t(me) * n + i);
    ok = ok && rs[i] == s;
  }
  CHECK_MESSAGE(ok, "reduce_scatter in " << c.group_name());
  std::vector<float> b(n, float(g[size_t(me)]));
  Tensor tb = cpu(b);
  c.broadcast(tb, W - 1);
  ok = true;
  for (size_t i = 0; i < n; ++i) ok = ok && b[i] == float(g[size_t(W - 1)]);
  CHECK_MESSAGE(ok, "broadcast in " << c.group_name());
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("device mesh: coordinates and groups / 1x1x1 - 2x2x2 - 1x4x2 - 3x1x2") {
  {
    DeviceMesh m(1, 1, 1);
    CHECK(m.world() == 1);
    CHECK(m.coord(0) == MeshCoord{0, 0, 0});
    for (MeshDim d : {MeshDim::Pipeline, MeshDim::Data, MeshDim::Tensor}) {
      CHECK(m.group(d, 0) == std::vector<int>{0});
      CHECK(m.groups(d) == std::vector<std::vector<int>>{{0}});
    }
    CHECK(m.shard_group(0, 1) == std::vector<int>{0});
    CHECK(m.replicate_group(0, 1) == std::vector<int>{0});
  }
  {
    DeviceMesh m(2, 2, 2);  // rank = p*4 + d*2 + t
    CHECK(m.world() == 8);
    CHECK(m.coord(5) == MeshCoord{1, 0, 1});
    CHECK(m.coord(6) == MeshCoord{1, 1, 0});
    CHECK(m.rank_of({1, 1, 1}) == 7);
    CHECK(m.group(MeshDim::Tensor, 5) == std::vector<int>{4, 5});
    CHECK(m.group(MeshDim::Data, 5) == std::vector<int>{5, 7});
    CHECK(m.group(MeshDim::Pipeline, 5) == std::vector<int>{1, 5});
    CHECK(m.groups(MeshDim::Tensor) == std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
    CHECK(m.groups(MeshDim::Data) == std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
    CHECK(m.groups(MeshDim::Pipeline) == std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
    CHECK(m.str() == "pp=2 x dp=2 x tp=2");
  }
  {
    DeviceMesh m(1, 4, 2);  // rank = d*2 + t
    CHECK(m.coord(7) == MeshCoord{0, 3, 1});
    CHECK(m.group(MeshDim::Data, 3) == std::vector<int>{1, 3, 5, 7});
    CHECK(m.group(MeshDim::Tensor, 3) == std::vector<int>{2, 3});
    CHECK(m.group(MeshDim::Pipeline, 3) == std::vector<int>{3});
    // hybrid sharding: shard groups of 2 consecutive data ranks, replicate across them
    CHECK(m.shard_group(5, 2) == std::vector<int>{5, 7});
    CHECK(m.replicate_group(5, 2) == std::vector<int>{1, 5});
    CHECK(m.shard_group(2, 2) == std::vector<int>{0, 2});
    CHECK(m.replicate_group(2, 2) == std::vector<int>{2, 6});
    CHECK(m.shard_group(3, 4) == std::vector<int>{1, 3, 5, 7});
    CHECK(m.replicate_group(3, 4) == std::vector<int>{3});
    CHECK(m.shard_group(3, 1) == std::vector<int>{3});
    CHECK(m.replicate_group(3, 1) == std::vector<int>{1, 3, 5, 7});
    CHECK_THROWS_WITH_AS(m.shard_group(0, 3), doctest::Contains("shard group size 3"), UserError);
    CHECK_THROWS_WITH_AS(m.replicate_group(0, 0), doctest::Contains("shard group size 0"), UserError);
  }
  {
    DeviceMesh m(3, 1, 2);  // rank = p*2 + t
    CHECK(m.coord(5) == MeshCoord{2, 0, 1});
    CHECK(m.group(MeshDim::Pipeline, 5) == std::vector<int>{1, 3, 5});
    CHECK(m.group(MeshDim::Data, 5) == std::vector<int>{5});
    CHECK(m.group(MeshDim::Tensor, 5) == std::vector<int>{4, 5});
  }
  // every rank is in exactly one group per dimension, at the index of its coordinate
  for (auto [p, d, t] : {std::tuple{2, 3, 4}, std::tuple{1, 4, 2}, std::tuple{4, 1, 1}}) {
    DeviceMesh m(p, d, t);
    for (MeshDim dim : {MeshDim::Pipeline, MeshDim::Data, MeshDim::Tensor}) {
      std::vector<int> seen(size_t(m.world()), 0);
      for (const auto& grp : m.groups(dim)) {
        CHECK(int(grp.size()) == m.size(dim));
        for (size_t k = 0; k < grp.size(); ++k) {
          seen[size_t(grp[k])]++;
          CHECK(m.coord(grp[k])[dim] == int(k));
          CHECK(m.group(dim, grp[k]) == grp);
        }
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; }));
    }
  }
  CHECK_THROWS_WITH_AS(DeviceMesh(1, 0, 2), doctest::Contains("dp size"), UserError);
  CHECK_THROWS_WITH_AS(DeviceMesh(2, 2, 2).coord(8), doctest::Contains("rank 8"), UserError);
}

TEST_CASE("groups: split arguments are checked - bad names and member lists") {
  run_ranks(1, [](int, GlooCommunicator& c) {
    CHECK(c.group_name() == "world");
    CHECK(c.global_ranks() == std::vector<int>{0});
    CHECK_THROWS_WITH_AS(c.split("a/b", {0}), doctest::Contains("name must be"), UserError);
    CHECK_THROWS_WITH_AS(c.split("", {0}), doctest::Contains("name must be"), UserError);
    CHECK_THROWS_WITH_AS(c.split("tp", {0, 0}), doctest::Contains("member 0 is listed twice"), UserError);
    CHECK_THROWS_WITH_AS(c.split("tp", {1}), doctest::Contains("member 1 is not a rank"), UserError);
    auto solo = c.split("solo", {0});  // one rank: a group of one
    REQUIRE(solo);
    CHECK(solo->size() == 1);
    check_collectives(*solo, 5);
    CHECK(c.split("none", {}) == nullptr);
  });
  run_ranks(2, [](int r, GlooCommunicator& c) {
    if (r == 0) CHECK_THROWS_WITH_AS(c.split("tp", {1}), doctest::Contains("does not contain this rank (0)"), UserError);
  });
}

TEST_CASE("groups: 4 ranks split 2x2 - collectives on each sub-group - two splits co-exist") {
  run_ranks(4, [](int r, GlooCommunicator& world) {
    // rows {0,1} {2,3} and columns {0,2} {1,3}; both groups of a split share a name
    auto row = world.split("row", r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3});
    auto col = world.split("col", r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3});
    // a reversed member list: the new rank is the index in the list
    auto rev = world.split("rev", {3, 2, 1, 0});
    REQUIRE(row);
    REQUIRE(col);
    REQUIRE(rev);
    CHECK(row->group_name() == "row");
    CHECK(row->size() == 2);
    CHECK(row->rank() == r % 2);
    CHECK(col->rank() == r / 2);
    CHECK(rev->rank() == 3 - r);
    CHECK(rev->global_ranks() == std::vector<int>{3, 2, 1, 0});
    CHECK(col->global_ranks() == (r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3}));
    for (size_t n : {size_t(1), size_t(7), size_t(33)}) {
      check_collectives(*row, n);
      check_collectives(*col, n);
      check_collectives(world, n);
      check_collectives(*rev, n);
    }
    // async collectives of two groups in flight at once
    std::vector<float> a(9, float(r)), b(9, float(r));
    auto wa = row->allreduce_async(cpu(a), ReduceOp::Sum);
    auto wb = col->allreduce_async(cpu(b), ReduceOp::Avg);
    wa->wait();
    wb->wait();
    CHECK(a[8] == float(r < 2 ? 0 + 1 : 2 + 3));
    CHECK(b[0] == float(r % 2 == 0 ? (0 + 2) / 2.0 : (1 + 3) / 2.0));
    // the same name again is a new group; a nested split maps global ranks through
    auto row2 = world.split("row", r < 2 ? std::vector<int>{1, 0} : std::vector<int>{3, 2});
    CHECK(row2->rank() == 1 - r % 2);
    check_collectives(*row2, 3);
    auto pair = col->split("col_pair", {1, 0});  // inside a column: {2,0} or {3,1} in global ranks
    CHECK(pair->global_ranks() == (r % 2 == 0 ? std::vector<int>{2, 0} : std::vector<int>{3, 1}));
    check_collectives(*pair, 4);
    // ranks outside every group pass an empty list and get nullptr
    auto only01 = world.split("only01", r < 2 ? std::vector<int>{0, 1} : std::vector<int>{});
    CHECK((only01 != nullptr) == (r < 2));
    if (only01) check_collectives(*only01, 2);
    world.barrier();
  });
}

TEST_CASE("groups: split_mesh on 4 ranks - tp dp pp groups and hybrid shard/replicate groups") {
  run_ranks(4, [](int r, GlooCommunicator& world) {
    DeviceMesh m(1, 2, 2);
    MeshComms mc = split_mesh(world, m, 1);
    CHECK(mc.tensor->global_ranks() == m.group(MeshDim::Tensor, r));
    CHECK(mc.data->global_ranks() == m.group(MeshDim::Data, r));
    CHECK(mc.pipeline->size() == 1);
    CHECK(mc.data->group_name() == "dp");
    CHECK(mc.along(MeshDim::Tensor).rank() == m.coord(r).tensor);
    for (MeshDim d : {MeshDim::Pipeline, MeshDim::Data, MeshDim::Tensor}) check_collectives(mc.along(d), 5);
    check_collectives(*mc.shard, 3);
    check_collectives(*mc.replicate, 3);
    DeviceMesh hs(1, 4, 1);  // hybrid sharding: shard within {0,1} {2,3}, replicate across
    MeshComms h = split_mesh(world, hs, 2);
    CHECK(h.shard->global_ranks() == (r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
    CHECK(h.replicate->global_ranks() == (r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3}));
    check_collectives(*h.shard, 6);
    check_collectives(*h.replicate, 6);
    CHECK_THROWS_WITH_AS(split_mesh(world, DeviceMesh(2, 2, 2)), doctest::Contains("has 8 ranks"), UserError);
    CHECK_THROWS_WITH_AS(split_mesh(world, hs, 3), doctest::Contains("shard group size 3"), UserError);
  });
}

TEST_CASE("p2p: ring send/recv on the world and on a sub-group / sizes 0 1 and odd") {
  run_ranks(4, [](int r, GlooCommunicator& world) {
    const int W = 4, right = (r + 1) % W, left = (r + W - 1) % W;
    for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(1001)}) {
      std::vector<float> out(n), in(n, -1.f);
      for (size_t i = 0; i < n; ++i) out[i] = float(r * 10000) + float(i);
      auto w = world.p2p_async({{P2POp::Kind::Recv, cpu(in), left, "ring"}, {P2POp::Kind::Send, cpu(out), right, "ring"}});
      w->wait();
      bool ok = true;
      for (size_t i = 0; i < n; ++i) ok = ok && in[i] == float(left * 10000) + float(i);
      CHECK_MESSAGE(ok, "ring of " << n);
    }
    // several to one peer in one group: the k-th send pairs with the k-th receive (NCCL's
    // rule: no tags), whatever the order of sends and receives inside the group
    std::vector<float> s1(3, float(r)), s2(5, float(r) + 0.5f), r1(3), r2(5), r3(3);
    std::vector<float> s3(3, float(r) + 0.25f);
    auto g = world.p2p_async({{P2POp::Kind::Recv, cpu(r1), left},
                              {P2POp::Kind::Send, cpu(s1), right},
                              {P2POp::Kind::Send, cpu(s2), right},
                              {P2POp::Kind::Recv, cpu(r2), left},
                              {P2POp::Kind::Recv, cpu(r3), left},
                              {P2POp::Kind::Send, cpu(s3), right}});
    g->wait();
    CHECK(r1[2] == float(left));
    CHECK(r2[4] == float(left) + 0.5f);
    CHECK(r3[0] == float(left) + 0.25f);
    CHECK(g->done());
    // a collective queued between two groups runs between them, in order on the stream
    std::vector<float> x(4, 1.f), y(4), z(4);
    auto g1 = world.p2p_async({{P2POp::Kind::Send, cpu(s1), right}, {P2POp::Kind::Recv, cpu(y.data(), DType::F32, 3), left}});
    Tensor tx = cpu(x);
    auto ar = world.allreduce_async(tx, ReduceOp::Sum);
    auto g2 = world.p2p_async({{P2POp::Kind::Send, cpu(s3), right}, {P2POp::Kind::Recv, cpu(z.data(), DType::F32, 3), left}});
    for (auto& w : {g1, ar, g2}) w->wait();
    CHECK(y[0] == float(left));
    CHECK(x[3] == 4.f);
    CHECK(z[1] == float(left) + 0.25f);
    // both directions at once inside a sub-group (new ranks: 1 <-> 0)
    auto col = world.split("col", r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3});
    const int peer = 1 - col->rank();
    std::vector<float> mine(11, float(r)), theirs(11);
    std::vector<int32_t> idx{r, -r}, idx_in(2);
    Tensor ti(idx.data(), DType::I32, Device::cpu(), Shape{2}), ti_in(idx_in.data(), DType::I32, Device::cpu(), Shape{2});
    col->p2p_async({{P2POp::Kind::Send, cpu(mine), peer},
                    {P2POp::Kind::Send, ti, peer},
                    {P2POp::Kind::Recv, cpu(theirs), peer},
                    {P2POp::Kind::Recv, ti_in, peer}})
        ->wait();
    const int other = col->global_ranks()[size_t(peer)];
    CHECK(theirs[10] == float(other));
    CHECK(idx_in == std::vector<int32_t>{other, -other});
  });
}

TEST_CASE("p2p: a send and a receive that pair up by order but disagree fail on both ranks naming both sides") {
  std::vector<std::string> msg(4);
  run_ranks(
      4,
      [&](int r, GlooCommunicator& world) {
        auto col = world.split("col", r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3});
        if (r % 2 == 1) return;
        // global 0 expects 4 floats of "activations", global 2 sends 5 floats of "gradients":
        // NCCL would pair them (first send, first receive); here both sides refuse at once
        std::vector<float> buf(r == 0 ? 4 : 5, 1.f);
        auto t0 = std::chrono::steady_clock::now();
        try {
          (r == 0 ? col->recv_async(cpu(buf), 1, "activations") : col->send_async(cpu(buf), 0, "gradients"))->wait();
        } catch (const RuntimeFault& e) {
          msg[size_t(r)] = e.what();
        }
        CHECK(std::chrono::steady_clock::now() - t0 < 3s);
        // the communicator is broken from now on
        CHECK_THROWS_WITH_AS(col->barrier(), doctest::Contains("failed earlier"), RuntimeFault);
      },
      5);
  CAPTURE(msg[0]);
  CAPTURE(msg[2]);
  CHECK(msg[0].find("recv #0 from rank 1 (global 2) of 16 bytes ('activations') paired with rank 1 (global 2)'s send "
                    "#0 of 20 bytes ('gradients')") != std::string::npos);
  CHECK(msg[0].find("group 'col' (global ranks 0,2)") != std::string::npos);
  CHECK(msg[2].find("send #0 to rank 0 (global 0) of 20 bytes ('gradients') paired with rank 0 (global 0)'s recv #0 "
                    "of 16 bytes ('activations')") != std::string::npos);
}

TEST_CASE("p2p: an out-of-order pipeline receive of the same size is refused naming both micro-batches") {
  // Stage 0 sends micro-batch 1's activations first; stage 1 receives micro-batch 0's first.
  // Same sizes, so NCCL would hand micro-batch 1's activations to micro-batch 0 silently.
  std::vector<std::string> msg(2);
  run_ranks(
      2,
      [&](int r, GlooCommunicator& world) {
        std::vector<float> buf(64, float(r));
        const auto what = [](int m) { return fmt::format("activations of micro-batch {} for virtual stage 1", m); };
        try {
          (r == 0 ? world.send_async(cpu(buf), 1, what(1)) : world.recv_async(cpu(buf), 0, what(0)))->wait();
        } catch (const RuntimeFault& e) {
          msg[size_t(r)] = e.what();
        }
      },
      5);
  CAPTURE(msg[0]);
  CAPTURE(msg[1]);
  CHECK(msg[1].find("recv #0 from rank 0 of 256 bytes ('activations of micro-batch 0 for virtual stage 1') paired "
                    "with rank 0's send #0 of 256 bytes ('activations of micro-batch 1 for virtual stage 1')") !=
        std::string::npos);
  CHECK(msg[0].find("send #0 to rank 1 of 256 bytes ('activations of micro-batch 1 for virtual stage 1') paired "
                    "with rank 1's recv #0 of 256 bytes ('activations of micro-batch 0 for virtual stage 1')") !=
        std::string::npos);
}

TEST_CASE("p2p: a receive queued behind a receive of the same stream hangs as on NCCL and times out naming both") {
  // Rank 0 posts a receive from rank 1, then a send to rank 1; rank 1 does the same. With
  // Gloo's tagged, independent operations this exchange worked; on NCCL each rank's stream
  // blocks in its receive, so neither send ever runs. The CPU communicator must hang the same
  // way and say so: which receive, on which stream, and what waits behind it.
  std::vector<std::string> msg(2);
  run_ranks(
      2,
      [&](int r, GlooCommunicator& world) {
        std::vector<float> in(8), out(8, float(r));
        auto rw = world.recv_async(cpu(in), 1 - r, fmt::format("gradients of micro-batch 0 for stage {}", r));
        auto sw = world.send_async(cpu(out), 1 - r, fmt::format("activations of micro-batch 1 for stage {}", 1 - r));
        try {
          rw->wait();
        } catch (const RuntimeFault& e) {
          msg[size_t(r)] = e.what();
        }
        CHECK_THROWS_AS(sw->wait(), RuntimeFault);
      },
      0.5);
  // the first rank to time out closes its connections: the other one's wait ends at once
  CHECK((msg[0].find("Timed out waiting") != std::string::npos || msg[1].find("Timed out waiting") != std::string::npos));
  for (int r = 0; r < 2; ++r) {
    CAPTURE(msg[size_t(r)]);
    CHECK(msg[size_t(r)].find(fmt::format("recv #0 from rank {} of 32 bytes ('gradients of micro-batch 0 for stage {}'): "
                                          "no matching send from rank {} ([", 1 - r, r, 1 - r)) != std::string::npos);
    CHECK(msg[size_t(r)].find(fmt::format("waiting behind it on the stream: gloo p2p group #1 (send #0 to rank {} of 32 "
                                          "bytes ('activations of micro-batch 1 for stage {}')", 1 - r, 1 - r)) !=
          std::string::npos);
  }
}

TEST_CASE("groups: a rank that never arrives - the others' error names the group - the collective number and the missing rank") {
  // In the world: rank 2 skips allreduce #1. In the sub-group "trio" (global 1,2,3; rank
  // 0 joins none) global 3 = trio rank 2 skips allreduce #1.
  for (bool sub : {false, true}) {
    CAPTURE(sub);
    const int W = sub ? 4 : 3;
    const int absent = W - 1;
    std::vector<std::string> msg(static_cast<size_t>(W));
    std::vector<double> secs(static_cast<size_t>(W));
    std::atomic<int> done{0};
    run_ranks(
        W,
        [&](int r, GlooCommunicator& world) {
          std::unique_ptr<Communicator> trio;
          if (sub) trio = world.split("trio", r == 0 ? std::vector<int>{} : std::vector<int>{1, 2, 3});
          Communicator* c = sub ? trio.get() : &world;
          if (!c) return;
          std::vector<float> a(16, 1.f);
          Tensor first = cpu(a);
          c->allreduce(first, ReduceOp::Sum);  // #0: everyone
          if (r == absent) {  // alive, but never joins #1; keeps its communicator open
            while (done.load() < W - (sub ? 2 : 1)) std::this_thread::sleep_for(10ms);
            return;
          }
          auto t0 = std::chrono::steady_clock::now();
          try {
            Tensor t = cpu(a);
            c->allreduce(t, ReduceOp::Sum);
          } catch (const RuntimeFault& e) {
            msg[size_t(r)] = e.what();
          }
          secs[size_t(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          done++;
        },
        1.0);
    for (int r = sub ? 1 : 0; r < absent; ++r) {
      CAPTURE(msg[size_t(r)]);
      const std::string& m = msg[size_t(r)];
      CHECK(m.find("allreduce #1") != std::string::npos);
      if (sub) {
        CHECK(m.find("group 'trio' (global ranks 1,2,3)") != std::string::npos);
        CHECK(m.find("not arrived within 250 ms: rank 2 (global 3)") != std::string::npos);
      } else {
        CHECK(m.find("group 'world'") != std::string::npos);
        CHECK(m.find("not arrived within 250 ms: rank 2 (global 2)") != std::string::npos);
      }
      const size_t na = m.find("not arrived");
      REQUIRE(na != std::string::npos);
      CHECK(m.find("rank 0", na) == std::string::npos);  // the ones that came are not named
      CHECK(m.find("rank 1 ", na) == std::string::npos);
      CHECK(secs[size_t(r)] < 1.0 + 0.25 + 1.0);  // the timeout, the grace, and slack
    }
  }
}

}  // TEST_SUITE

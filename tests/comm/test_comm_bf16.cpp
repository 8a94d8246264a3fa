// 16-bit collectives of the Gloo communicator, on 2 and 3 ranks (threads of this process):
//  * allgather of bf16 and f16 tensors moves the bytes as they are;
//  * reduce_scatter and allreduce of bf16 tensors give, bit for bit, the documented order
//    (f16 likewise: its reduce_scatter below)
//    (comm/communicator.h): chunk c's sum starts at rank c+1 and adds ranks c+2, ..., c, each
//    step in f32 rounded to bf16 (round to nearest even); Avg then multiplies by 1/size in
//    f32 and rounds once more. allreduce pads to size chunks of ceil(n/size) elements.
//  * an unsupported dtype is refused with the collective and the dtype named.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "gloo_ranks.h"

using namespace dtrain;

namespace {

// Values with full bf16 mantissas and mixed magnitudes, so the rounding of each step matters.
bf16_t input(int rank, size_t i) {
  const float v = (float(int(i * 7 + size_t(rank) * 13) % 29) - 14.f) * (1.f + 0.0078125f * float(rank + 1)) /
                  float(1 + (i % 5)) + 0.37f * float(rank);
  return f32_to_bf16(v);
}

// The documented ring order for chunk c of `world` ranks, element i of the chunk.
bf16_t ring_sum(int world, int c, size_t i_global, bool avg) {
  bf16_t acc = input((c + 1) % world, i_global);
  for (int k = 2; k <= world; ++k) acc = f32_to_bf16(bf16_to_f32(input((c + k) % world, i_global)) + bf16_to_f32(acc));
  if (avg) acc = f32_to_bf16(bf16_to_f32(acc) * (1.f / float(world)));
  return acc;
}

Tensor cpu(void* p, DType t, int64_t n) { return Tensor(p, t, Device::cpu(), Shape{n}); }

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("gloo 16-bit: allgather of bf16 and f16 moves the bytes as they are on 2 and 3 ranks") {
  for (int world : {2, 3}) {
    for (DType dt : {DType::BF16, DType::F16}) {
      const size_t n = 37;
      run_gloo_ranks(world, [&](int rank, comm::GlooCommunicator& c) {
        std::vector<uint16_t> shard(n), out(n * size_t(world), 0xffff);
        for (size_t i = 0; i < n; ++i) shard[i] = uint16_t(rank * 1000 + int(i) * 3 + 0x8001);  // any bits
        Tensor s = cpu(shard.data(), dt, int64_t(n)), o = cpu(out.data(), dt, int64_t(n) * world);
        c.allgather(s, o);
        for (int r = 0; r < world; ++r)
          for (size_t i = 0; i < n; ++i) CHECK(out[size_t(r) * n + i] == uint16_t(r * 1000 + int(i) * 3 + 0x8001));
        // in place: the shard in its own slot of `out`
        std::vector<uint16_t> io(n * size_t(world), 0);
        std::memcpy(io.data() + size_t(rank) * n, shard.data(), n * 2);
        Tensor mine = cpu(io.data() + size_t(rank) * n, dt, int64_t(n)), all = cpu(io.data(), dt, int64_t(n) * world);
        c.allgather(mine, all);
        CHECK(io == out);
      });
    }
  }
}

TEST_CASE("gloo bf16: reduce_scatter gives the documented ring order bit for bit on 2 and 3 ranks") {
  for (int world : {2, 3}) {
    for (comm::ReduceOp op : {comm::ReduceOp::Sum, comm::ReduceOp::Avg}) {
      const size_t n = 53;
      run_gloo_ranks(world, [&](int rank, comm::GlooCommunicator& c) {
        std::vector<bf16_t> in(n * size_t(world)), out(n, 0);
        for (size_t i = 0; i < in.size(); ++i) in[i] = input(rank, i);
        Tensor ti = cpu(in.data(), DType::BF16, int64_t(in.size())), to = cpu(out.data(), DType::BF16, int64_t(n));
        c.reduce_scatter(ti, to, op);
        size_t wrong = 0;
        for (size_t i = 0; i < n; ++i)
          wrong += out[i] != ring_sum(world, rank, size_t(rank) * n + i, op == comm::ReduceOp::Avg);
        INFO("world " << world << " rank " << rank << (op == comm::ReduceOp::Avg ? " avg" : " sum"));
        CHECK(wrong == 0);
      });
    }
  }
}

// f16 (tensor/sequence parallelism under precision.dtype = "fp16"): the same ring, each step
// added in f32 and rounded to f16.
TEST_CASE("gloo f16: reduce_scatter gives the documented ring order bit for bit on 2 and 3 ranks") {
  auto in16 = [](int rank, size_t i) { return f32_to_f16(bf16_to_f32(input(rank, i)) * 1.001f); };
  for (int world : {2, 3}) {
    const size_t n = 41;
    run_gloo_ranks(world, [&](int rank, comm::GlooCommunicator& c) {
      std::vector<f16_t> in(n * size_t(world)), out(n, 0);
      for (size_t i = 0; i < in.size(); ++i) in[i] = in16(rank, i);
      Tensor ti = cpu(in.data(), DType::F16, int64_t(in.size())), to = cpu(out.data(), DType::F16, int64_t(n));
      c.reduce_scatter(ti, to, comm::ReduceOp::Sum);
      size_t wrong = 0;
      for (size_t i = 0; i < n; ++i) {
        const size_t g = size_t(rank) * n + i;
        f16_t acc = in16((rank + 1) % world, g);
        for (int k = 2; k <= world; ++k) acc = f32_to_f16(f16_to_f32(in16((rank + k) % world, g)) + f16_to_f32(acc));
        wrong += out[i] != acc;
      }
      INFO("world " << world << " rank " << rank);
      CHECK(wrong == 0);
    });
  }
}

TEST_CASE("gloo bf16: allreduce is the ring reduce-scatter of ceil(n/size) chunks then an allgather") {
  for (int world : {2, 3}) {
    for (comm::ReduceOp op : {comm::ReduceOp::Sum, comm::ReduceOp::Avg}) {
      const size_t n = 100;  // not a multiple of 3: the last chunk is padded
      const size_t m = (n + size_t(world) - 1) / size_t(world);
      run_gloo_ranks(world, [&](int rank, comm::GlooCommunicator& c) {
        std::vector<bf16_t> t(n);
        for (size_t i = 0; i < n; ++i) t[i] = input(rank, i);
        Tensor tt = cpu(t.data(), DType::BF16, int64_t(n));
        c.allreduce(tt, op);
        size_t wrong = 0;
        for (size_t i = 0; i < n; ++i) wrong += t[i] != ring_sum(world, int(i / m), i, op == comm::ReduceOp::Avg);
        INFO("world " << world << " rank " << rank);
        CHECK(wrong == 0);
        // the sum is close to the exact one (each of world-1 steps rounds once: <= 2^-8 relative each)
        double exact = 0;
        for (int r = 0; r < world; ++r) exact += double(bf16_to_f32(input(r, 5)));
        if (op == comm::ReduceOp::Avg) exact /= world;
        CHECK(std::abs(double(bf16_to_f32(t[5])) - exact) <= 0.01 * std::abs(exact) + 1e-6);
      });
    }
  }
}

TEST_CASE("gloo 16-bit: an unsupported dtype is refused naming the collective and the dtype") {
  run_gloo_ranks(2, [&](int, comm::GlooCommunicator& c) {
    std::vector<int32_t> i32(16);
    Tensor i = cpu(i32.data(), DType::I32, 8);
    Tensor i16 = cpu(i32.data(), DType::I32, 16);
    auto what = [](auto&& f) {
      try {
        f();
      } catch (const Error& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    const std::string a = what([&] { c.allreduce(i, comm::ReduceOp::Sum); });  // 16-bit floats are supported
    CHECK_MESSAGE(a.find("allreduce") != std::string::npos, a);
    CHECK_MESSAGE(a.find("i32") != std::string::npos, a);
    Tensor i4 = cpu(i32.data(), DType::I32, 4);
    const std::string b = what([&] { c.reduce_scatter(i, i4, comm::ReduceOp::Sum); });
    CHECK_MESSAGE(b.find("reduce_scatter") != std::string::npos, b);
    CHECK_MESSAGE(b.find("i32") != std::string::npos, b);
    const std::string d = what([&] { c.allgather(i, i16); });
    CHECK_MESSAGE(d.find("allgather") != std::string::npos, d);
    CHECK_MESSAGE(d.find("i32") != std::string::npos, d);
  });
}

}  // TEST_SUITE unit

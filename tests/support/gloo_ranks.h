#pragma once
// Gloo ranks as threads of one test process: each its own store client and communicator over
// a fresh store server on loopback.
#include <chrono>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "comm/gloo_comm.h"
#include "comm/store.h"

// Runs fn(rank, comm) on `world` threads; rethrows the first failure.
inline void run_gloo_ranks(int world, const std::function<void(int, dtrain::comm::GlooCommunicator&)>& fn,
                           double timeout_s = 5) {
  using namespace dtrain::comm;
  const char* token = "gloo-ranks";
  StoreServer server("127.0.0.1", 0, token);
  std::vector<std::thread> th;
  std::vector<std::exception_ptr> errs{size_t(world)};
  for (int r = 0; r < world; ++r)
    th.emplace_back([&, r] {
      try {
        StoreClient sc("127.0.0.1", server.port(), token, std::chrono::seconds(5));
        GlooOptions o;
        o.timeout_s = timeout_s;
        GlooCommunicator comm(sc, r, world, o);
        fn(r, comm);
      } catch (...) {
        errs[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : th) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

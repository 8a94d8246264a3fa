#pragma once
// GlooCommunicator's Work (gloo_comm.cpp, gloo_p2p.cpp): finished by the stream thread with an
// error or none; wait() blocks the caller until then.
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>

#include "comm/gloo_comm.h"
#include "core/error.h"

namespace dtrain::comm {

class GlooCommunicator::GlooWork : public Work {
 public:
  GlooWork(std::string desc, std::chrono::milliseconds timeout)
      : desc_(std::move(desc)), timeout_(timeout) {}
  void finish(std::exception_ptr e) {
    std::lock_guard<std::mutex> g(mu_);
    err_ = e;
    done_ = true;
    cv_.notify_all();
  }
  const std::string& desc() const { return desc_; }

 protected:
  void wait_impl() override {
    std::unique_lock<std::mutex> g(mu_);
    // The operation has its own timeout from when it reaches the head of the stream, and an
    // operation stuck ahead of it breaks the communicator when its own runs out (then this
    // one ends at once); the margin only guards against a bug.
    if (!cv_.wait_for(g, timeout_ * 2 + std::chrono::seconds(30), [&] { return done_; }))
      fault("{}: no completion within {} ms", desc_, timeout_.count());
    if (err_) std::rethrow_exception(err_);
  }
  bool done_impl() override {
    std::lock_guard<std::mutex> g(mu_);
    return done_;
  }

 private:
  std::string desc_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr err_;
};

}  // namespace dtrain::comm

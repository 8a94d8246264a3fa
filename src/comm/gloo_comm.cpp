#include "comm/gloo_comm.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <thread>
#include <mutex>
#include <exception>
#include <initializer_list>

#include "core/dtype.h"
#include "core/error.h"
#include "comm/gloo_work.h"
#include "comm/store.h"

namespace dtrain::comm {
namespace {

// Gloo's rendezvous Store interface over dtrain's Store (either client).
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(comm::Store& s, std::string prefix) : s_(s), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_.set(prefix_ + key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = s_.get(prefix_ + key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, s_.timeout()); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    std::vector<std::string> full;
    for (auto& k : keys) full.push_back(prefix_ + k);
    s_.wait(full, t);
  }

 private:
  comm::Store& s_;
  std::string prefix_;
};

void check_f32_cpu(const Tensor& t, const char* what) {
  DTRAIN_CHECK(t.dtype == DType::F32 && t.device.is_cpu(),
               "gloo {}: expected an f32 cpu tensor, got {}", what, t.str());
}

// A cpu tensor of one of `ok` (named in the fault: "f32, bf16").
void check_cpu(const Tensor& t, const char* what, std::initializer_list<DType> ok) {
  DTRAIN_CHECK(t.device.is_cpu(), "gloo {}: expected a cpu tensor, got {}", what, t.str());
  std::string names;
  for (DType d : ok) {
    if (d == t.dtype) return;
    names += (names.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  fault("gloo {}: {} tensors are not supported (only {}), got {}", what, dtype_name(t.dtype), names, t.str());
}

void add_f32(void* dst, const void* src, size_t n) {
  float* d = static_cast<float*>(dst);
  const float* s = static_cast<const float*>(src);
  for (size_t i = 0; i < n; ++i) d[i] += s[i];
}

// One pairwise step of a bf16 sum: in f32, rounded to bf16 (nearest even).
void add_bf16(void* dst, const void* src, size_t n) {
  bf16_t* d = static_cast<bf16_t*>(dst);
  const bf16_t* s = static_cast<const bf16_t*>(src);
  for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(bf16_to_f32(d[i]) + bf16_to_f32(s[i]));
}

// One pairwise step of an f16 sum: in f32, rounded to f16 (nearest even).
void add_f16(void* dst, const void* src, size_t n) {
  f16_t* d = static_cast<f16_t*>(dst);
  const f16_t* s = static_cast<const f16_t*>(src);
  for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(f16_to_f32(d[i]) + f16_to_f32(s[i]));
}

// Avg: times 1/size in f32 (bf16, f16: rounded once more).
void scale(void* p, DType dt, size_t n, float s) {
  if (dt == DType::F32) {
    float* f = static_cast<float*>(p);
    for (size_t i = 0; i < n; ++i) f[i] *= s;
  } else if (dt == DType::BF16) {
    bf16_t* h = static_cast<bf16_t*>(p);
    for (size_t i = 0; i < n; ++i) h[i] = f32_to_bf16(bf16_to_f32(h[i]) * s);
  } else {
    f16_t* h = static_cast<f16_t*>(p);
    for (size_t i = 0; i < n; ++i) h[i] = f32_to_f16(f16_to_f32(h[i]) * s);
  }
}

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

}  // namespace


GlooCommunicator::GlooCommunicator(Store& store, int rank, int size, const GlooOptions& opt, Backend* be)
    : GlooCommunicator(store, rank, size, opt, nullptr, be) {}

GlooCommunicator::GlooCommunicator(Store& store, int rank, int size, const GlooOptions& opt,
                                   std::shared_ptr<gloo::transport::Device> dev, Backend* be)
    : Communicator(be, stream_label("gloo", opt.group_name, global_or_identity(opt.global_ranks, size))),
      store_(store), opt_(opt), rank_(rank), size_(size), global_(opt.global_ranks),
      timeout_(std::chrono::milliseconds(int64_t(opt.timeout_s * 1000))) {
  DTRAIN_CHECK(size >= 1 && rank >= 0 && rank < size, "gloo: rank {} of {}", rank, size);
  // Gloo's TCP pairs write with writev, which raises SIGPIPE when the peer is gone: the
  // default action would kill this rank silently (signal 13) before the collective could
  // fail naming the peer. Ignored, the write returns EPIPE and the error path runs (Python,
  // hence PyTorch's Gloo, starts with SIGPIPE ignored too). dtrain's own sockets use
  // MSG_NOSIGNAL.
  static std::once_flag sigpipe;
  std::call_once(sigpipe, [] { ::signal(SIGPIPE, SIG_IGN); });
  if (global_.empty())
    for (int i = 0; i < size; ++i) global_.push_back(i);
  DTRAIN_CHECK(int(global_.size()) == size, "gloo: {} global ranks for a group of {}", global_.size(), size);
  gloo::transport::tcp::attr attr;
  if (!opt.iface.empty()) attr.iface = opt.iface;
  else attr.hostname = opt.hostname;
  try {
    dev_ = dev ? std::move(dev) : gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(timeout_);
    StoreAdapter adapter(store, opt.key_prefix);
    ctx->connectFullMesh(adapter, dev_);
    // A rank's connectFullMesh can return while a peer's side of their pair is still
    // handshaking; a rank that then leaves at once (a refused op, an error right after init)
    // closes the pair under the peer's rendezvous. Nobody leaves the constructor before every
    // rank has connected (tag outside the range of submitted operations' sequence numbers).
    if (size > 1) {
      gloo::BarrierOptions b(ctx);
      b.setTag(0xfffffff0u);
      b.setTimeout(timeout_);
      gloo::barrier(b);
    }
    ctx_ = ctx;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fault("gloo rendezvous of rank {} of {} of {} via store {} ({}) failed: {}", rank, size,
          group_label(opt.group_name, global_), store.address(),
          opt.iface.empty() ? "host " + opt.hostname : "iface " + opt.iface, e.what());
  }
  sends_to_.assign(size_t(size), 0);
  recvs_from_.assign(size_t(size), 0);
  thread_ = std::thread([this] { worker(); });
}

GlooCommunicator::~GlooCommunicator() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::string GlooCommunicator::peer_name(int r) const {
  if (opt_.group_name == "world" && global_[size_t(r)] == r) return fmt::format("rank {}", r);
  return fmt::format("rank {} (global {})", r, global_[size_t(r)]);
}

void GlooCommunicator::mark_broken(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  if (!broken_) broken_reason_ = why;
  broken_ = true;
}

std::unique_ptr<Communicator> GlooCommunicator::split_impl(const std::string& name, const std::vector<int>& ranks) {
  const int index = split_index(*this, name, ranks);
  const uint64_t nth = splits_++;
  if (index < 0) return nullptr;
  GlooOptions o = opt_;
  o.key_prefix = opt_.key_prefix + split_key(name, nth, ranks);
  o.group_name = name;
  o.global_ranks.clear();
  for (int r : ranks) o.global_ranks.push_back(global_[size_t(r)]);
  return std::unique_ptr<Communicator>(new GlooCommunicator(store_, index, int(ranks.size()), o, dev_, backend()));
}

std::shared_ptr<Work> GlooCommunicator::submit(const char* name, std::string detail,
                                               std::function<void(uint64_t)> fn) {
  std::lock_guard<std::mutex> g(mu_);
  uint64_t seq = seq_++;
  auto w = std::make_shared<GlooWork>(fmt::format("gloo {} #{} ({}) in {} on {} with peers 0-{}", name, seq,
                                                  detail, group_label(opt_.group_name, global_),
                                                  peer_name(rank_), size_ - 1),
                                      timeout_);
  queue_.push_back({w, std::move(fn), int64_t(seq)});
  cv_.notify_all();
  return w;
}

void GlooCommunicator::worker() {
  while (true) {
    std::shared_ptr<GlooWork> w;
    std::function<void(uint64_t)> fn;
    int64_t seq = 0;
    std::string broken;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop requested and nothing left
      w = queue_.front().work;
      fn = std::move(queue_.front().fn);
      seq = queue_.front().seq;
      queue_.pop_front();
      if (broken_) broken = broken_reason_;
    }
    if (!broken.empty()) {
      w->finish(std::make_exception_ptr(
          RuntimeFault(fmt::format("{}: not run, the communicator failed earlier: {}", w->desc(), broken))));
      continue;
    }
    try {
      cur_ = w.get();
      fn(uint64_t(seq));
      cur_ = nullptr;
      w->finish(nullptr);
    } catch (const std::exception& e) {
      cur_ = nullptr;
      std::string msg;
      if (seq < 0) {  // a p2p group: its error names the operation and the stream behind it
        std::lock_guard<std::mutex> g(mu_);
        msg = fmt::format("{} failed: {}{}", w->desc(), e.what(), queued_after());
      } else {
        // Who did not arrive: a timeout closes this rank's connections (Gloo), so the peers
        // that are in this collective fail soon after and record it; wait a grace for them.
        auto grace = std::clamp(timeout_ / 4, std::chrono::milliseconds(100), std::chrono::milliseconds(5000));
        msg = fmt::format("{} failed: {}{}", w->desc(), e.what(),
                          report_arrivals(store_, opt_.key_prefix, uint64_t(seq), rank_, global_, grace));
      }
      mark_broken(msg);
      w->finish(std::make_exception_ptr(RuntimeFault(msg)));
    }
  }
}

CommBytes GlooCommunicator::bytes_sent() const {
  CommBytes b;
  b.allreduce = sent_[0].load();
  b.reduce_scatter = sent_[1].load();
  b.allgather = sent_[2].load();
  b.broadcast = sent_[3].load();
  b.p2p = sent_[4].load();
  return b;
}

void GlooCommunicator::count(int kind, uint64_t bytes) {
  sent_[kind] += bytes;
  if (cur_) cur_->add_bytes(bytes);
}

std::shared_ptr<Work> GlooCommunicator::allreduce_impl(Tensor t, ReduceOp op) {
  check_cpu(t, "allreduce", {DType::F32, DType::BF16, DType::F16});
  size_t n = size_t(t.numel());
  if (op == ReduceOp::Max && t.dtype != DType::F32)
    fault("gloo allreduce: the max of {} tensors is not supported (only f32), got {}", dtype_name(t.dtype), t.str());
  if (t.dtype != DType::F32)
    return submit("allreduce", fmt::format("{} {}", n, dtype_name(t.dtype)), [this, t, op, n](uint64_t seq) {
      if (n == 0 || size_ == 1) return;
      allreduce_16(t.data, t.dtype, n, op, seq);
    });
  return submit("allreduce", fmt::format("{} f32", n), [this, t, op, n](uint64_t seq) {
    const uint32_t tag = uint32_t(seq);
    if (n == 0 || size_ == 1) return;
    gloo::AllreduceOptions o(ctx_);
    o.setOutput(t.f32(), n);
    o.setReduceFunction(op == ReduceOp::Max ? static_cast<ReduceFn>(&gloo::max<float>)
                                            : static_cast<ReduceFn>(&gloo::sum<float>));
    o.setTag(tag);
    o.setTimeout(timeout_);
    gloo::allreduce(o);
    count(0, wire::gloo_allreduce(n, 4, size_, rank_));
    if (op == ReduceOp::Avg) scale(t.data, DType::F32, n, 1.f / float(size_));
  });
}

// bf16/f16 all-reduce: the ring reduce-scatter of size chunks of m = ceil(n/size) elements
// (zero padded), Avg's scaling of the own chunk, then an all-gather of the chunks (bytes).
// Sends 2 (size-1) m 2 bytes.
void GlooCommunicator::allreduce_16(void* data, DType dt, size_t n, ReduceOp op, uint64_t seq) {
  const size_t P = size_t(size_), m = (n + P - 1) / P;
  uint16_t* t = static_cast<uint16_t*>(data);
  std::vector<uint16_t> padded(m * P, 0), mine(m), all(m * P);
  std::copy(t, t + n, padded.data());
  reduce_scatter_ring(padded.data(), mine.data(), m, 2, dt == DType::BF16 ? add_bf16 : add_f16, seq);
  if (op == ReduceOp::Avg) scale(mine.data(), dt, m, 1.f / float(size_));
  count(0, wire::ring_reduce_scatter(m * 2, size_));
  gloo::AllgatherOptions o(ctx_);
  o.setInput(mine.data(), m);
  o.setOutput(all.data(), m * P);
  o.setTag(uint32_t(seq));
  o.setTimeout(timeout_);
  gloo::allgather(o);
  count(0, wire::ring_allgather(m * 2, size_));
  std::copy(all.data(), all.data() + n, t);
}

// Ring reduce-scatter over Gloo's unbound buffers: at step s rank r sends its partial
// chunk (r-s-1) to rank r+1 and adds the chunk (r-s-2) received from rank r-1; after
// size-1 steps chunk r holds every rank's contribution. So chunk c's sum starts with rank
// c+1's piece and adds those of ranks c+2, ..., c in this order (one `add` per step: f32
// adds in f32, bf16 adds in f32 and rounds to bf16).
void GlooCommunicator::reduce_scatter_ring(const void* in, void* out, size_t n, size_t esize, AddFn add,
                                           uint64_t seq) {
  const int P = size_;
  const size_t chunk = n * esize;
  rs_work_.assign(static_cast<const char*>(in), static_cast<const char*>(in) + chunk * size_t(P));
  rs_recv_.resize(chunk);
  auto send_buf = ctx_->createUnboundBuffer(rs_work_.data(), rs_work_.size());
  auto recv_buf = ctx_->createUnboundBuffer(rs_recv_.data(), chunk);
  const int right = (rank_ + 1) % P, left = (rank_ + P - 1) % P;
  const uint64_t base = (uint64_t(0x7d) << 56) | (uint64_t(seq & 0xffffffffu) << 8);
  auto mod = [P](int x) { return ((x % P) + P) % P; };
  for (int s = 0; s < P - 1; ++s) {
    int send_chunk = mod(rank_ - s - 1), recv_chunk = mod(rank_ - s - 2);
    uint64_t slot = base + uint64_t(s);
    recv_buf->recv(left, slot, 0, chunk);
    send_buf->send(right, slot, size_t(send_chunk) * chunk, chunk);
    if (!recv_buf->waitRecv(timeout_)) fault("ring step {}: receive from rank {} aborted", s, left);
    if (!send_buf->waitSend(timeout_)) fault("ring step {}: send to rank {} aborted", s, right);
    add(rs_work_.data() + size_t(recv_chunk) * chunk, rs_recv_.data(), n);
  }
  std::memcpy(out, rs_work_.data() + size_t(rank_) * chunk, chunk);
}

std::shared_ptr<Work> GlooCommunicator::reduce_scatter_impl(Tensor in, Tensor out, ReduceOp op) {
  check_cpu(in, "reduce_scatter", {DType::F32, DType::BF16, DType::F16});
  check_cpu(out, "reduce_scatter", {in.dtype});
  size_t n = size_t(out.numel());
  DTRAIN_CHECK(size_t(in.numel()) == n * size_t(size_), "reduce_scatter: input {} is not {} x {}",
               in.numel(), size_, n);
  const DType dt = in.dtype;
  DTRAIN_CHECK(op != ReduceOp::Max, "gloo reduce_scatter: no max reduction ({})", in.str());
  return submit("reduce_scatter", fmt::format("{} x {} {}", size_, n, dtype_name(dt)),
                [this, in, out, op, n, dt](uint64_t seq) {
                  if (n == 0) return;
                  if (size_ == 1) std::memmove(out.data, in.data, n * dtype_size(dt));
                  else {
                    reduce_scatter_ring(in.data, out.data, n, dtype_size(dt),
                                        dt == DType::F32 ? add_f32 : dt == DType::BF16 ? add_bf16 : add_f16, seq);
                    count(1, wire::ring_reduce_scatter(n * dtype_size(dt), size_));
                  }
                  if (op == ReduceOp::Avg && size_ > 1) scale(out.data, dt, n, 1.f / float(size_));
                });
}

std::shared_ptr<Work> GlooCommunicator::allgather_impl(Tensor shard, Tensor out) {
  check_cpu(shard, "allgather", {DType::F32, DType::BF16, DType::F16});
  check_cpu(out, "allgather", {shard.dtype});
  size_t n = size_t(shard.numel());
  DTRAIN_CHECK(size_t(out.numel()) == n * size_t(size_), "allgather: output {} is not {} x {}",
               out.numel(), size_, n);
  const DType dt = shard.dtype;
  return submit("allgather", fmt::format("{} x {} {}", size_, n, dtype_name(dt)), [this, shard, out, n, dt](uint64_t seq) {
    const uint32_t tag = uint32_t(seq);
    if (n == 0) return;
    const size_t bytes = n * dtype_size(dt);
    char* mine = static_cast<char*>(out.data) + size_t(rank_) * bytes;
    if (size_ == 1) {
      std::memmove(mine, shard.data, bytes);
      return;
    }
    gloo::AllgatherOptions o(ctx_);
    o.setTag(tag);
    o.setTimeout(timeout_);
    if (dt == DType::F32) {  // the shard may alias `out`
      std::vector<float> tmp(shard.f32(), shard.f32() + n);
      o.setInput(tmp.data(), n);
      o.setOutput(out.f32(), n * size_t(size_));
      gloo::allgather(o);
      count(2, wire::ring_allgather(bytes, size_));
    } else {  // 16-bit: the bytes as they are
      const uint16_t* src = static_cast<const uint16_t*>(shard.data);
      std::vector<uint16_t> tmp(src, src + n);
      o.setInput(tmp.data(), n);
      o.setOutput(static_cast<uint16_t*>(out.data), n * size_t(size_));
      gloo::allgather(o);
      count(2, wire::ring_allgather(bytes, size_));
    }
  });
}

std::shared_ptr<Work> GlooCommunicator::broadcast_impl(Tensor t, int root) {
  check_f32_cpu(t, "broadcast");
  DTRAIN_CHECK(root >= 0 && root < size_, "broadcast root {} of {}", root, size_);
  size_t n = size_t(t.numel());
  return submit("broadcast", fmt::format("{} f32 from rank {}", n, root), [this, t, root, n](uint64_t seq) {
    const uint32_t tag = uint32_t(seq);
    if (n == 0 || size_ == 1) return;
    gloo::BroadcastOptions o(ctx_);
    o.setOutput(t.f32(), n);
    o.setRoot(root);
    o.setTag(tag);
    o.setTimeout(timeout_);
    gloo::broadcast(o);
    count(3, wire::gloo_broadcast(n * 4, size_, rank_, root));
  });
}

std::shared_ptr<Work> GlooCommunicator::barrier_impl() {
  return submit("barrier", "no data", [this](uint64_t seq) {
    const uint32_t tag = uint32_t(seq);
    if (size_ == 1) return;
    gloo::BarrierOptions o(ctx_);
    o.setTag(tag);
    o.setTimeout(timeout_);
    gloo::barrier(o);
  });
}

}  // namespace dtrain::comm

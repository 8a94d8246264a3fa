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

// ---------------------------------------------------------------------- point-to-point ----

namespace {

constexpr uint64_t kP2PSlotPrefix = uint64_t(0x7e) << 56;  // Gloo's own prefixes are 0x01-0x08
enum class Msg : uint64_t { Ready = 1, Header = 2, Data = 3 };
// The slot of message `m` of the k-th operation of one direction between two ranks.
uint64_t p2p_slot(Msg m, uint64_t k) { return kP2PSlotPrefix | (uint64_t(m) << 52) | (k & ((uint64_t(1) << 52) - 1)); }

// What each side of a pair tells the other before the bytes move: the receiver its buffer
// ("ready"), the sender its message ("header").
struct Control {
  uint64_t bytes = 0;
  uint64_t refused = 0;  // header: 1 when the sender found the pair mismatched (both fail)
  char what[240] = {};
};

void set_what(Control& c, const std::string& w) {
  std::memset(c.what, 0, sizeof c.what);
  std::memcpy(c.what, w.data(), std::min(w.size(), sizeof c.what - 1));
}

// " of 16 bytes ('activations of micro-batch 0 for virtual stage 1')"
std::string sized(uint64_t bytes, const std::string& what) {
  return fmt::format(" of {} bytes{}", bytes, what.empty() ? "" : " ('" + what + "')");
}

}  // namespace

struct GlooCommunicator::P2PGroup {
  struct Item {
    bool send = false;
    int peer = 0;
    uint64_t k = 0;  // this direction's index: the k-th send to / receive from `peer`
    void* data = nullptr;
    uint64_t bytes = 0;
    std::string what, name;  // name: "recv #3 of 4096 bytes ('...') from rank 1"
    Control mine, theirs;
    std::unique_ptr<gloo::transport::UnboundBuffer> out, in, payload;
    std::string error;
  };
  std::vector<Item> items;
};

std::shared_ptr<Work> GlooCommunicator::p2p_impl(const std::vector<P2POp>& ops) {
  DTRAIN_CHECK(!ops.empty(), "gloo p2p: an empty batch");
  auto g = std::make_shared<P2PGroup>();
  std::string detail;
  for (const auto& op : ops) {
    const bool send = op.kind == P2POp::Kind::Send;
    DTRAIN_CHECK(op.t.device.is_cpu(), "gloo {}: expected a cpu tensor, got {}", send ? "send" : "recv", op.t.str());
    DTRAIN_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_, "gloo {}: peer {} on rank {} of {}",
                 send ? "send" : "recv", op.peer, rank_, size_);
    P2PGroup::Item it;
    it.send = send;
    it.peer = op.peer;
    it.k = send ? sends_to_[size_t(op.peer)]++ : recvs_from_[size_t(op.peer)]++;
    it.data = op.t.data;
    it.bytes = op.t.nbytes();
    it.what = op.what;
    it.name = fmt::format("{} #{} {} {}{}", send ? "send" : "recv", it.k, send ? "to" : "from", peer_name(op.peer),
                          sized(it.bytes, it.what));
    if (!detail.empty() && g->items.size() <= 3) detail += ", ";
    if (g->items.size() < 3) detail += it.name;
    else if (g->items.size() == 3) detail += "...";
    g->items.push_back(std::move(it));
  }
  uint64_t sends = 0;
  for (const auto& it : g->items)
    if (it.send) sends += it.bytes;
  const uint64_t n = p2p_seq_++;
  std::shared_ptr<Work> w;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto gw = std::make_shared<GlooWork>(
        fmt::format("gloo p2p group #{} ({}) in {} on {}", n, detail, group_label(opt_.group_name, global_),
                    peer_name(rank_)),
        timeout_);
    queue_.push_back({gw, [this, g, sends](uint64_t) {
                        run_p2p(*g);
                        count(4, sends);
                      },
                      -1});
    w = gw;
  }
  cv_.notify_all();
  return w;
}

std::string GlooCommunicator::queued_after() const {
  if (queue_.empty()) return "";
  std::string s = "; waiting behind it on the stream: ";
  for (size_t i = 0; i < queue_.size() && i < 2; ++i) s += (i ? ", " : "") + queue_[i].work->desc();
  if (queue_.size() > 2) s += fmt::format(" and {} more", queue_.size() - 2);
  return s;
}

// The worker thread: every operation of the group posted at once, then one thread each
// (the operations of a group progress together, as in ncclGroupStart/End).
void GlooCommunicator::run_p2p(P2PGroup& g) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  static char empty_byte;  // Gloo's buffers need an address, even for 0 bytes
  for (auto& it : g.items) {
    it.mine.bytes = it.bytes;
    set_what(it.mine, it.what);
    it.in = ctx_->createUnboundBuffer(&it.theirs, sizeof(Control));
    if (it.send) {  // the receiver's "ready" comes first
      it.in->recv(it.peer, p2p_slot(Msg::Ready, it.k));
    } else {  // tell the sender this receive is running; its header follows
      it.out = ctx_->createUnboundBuffer(&it.mine, sizeof(Control));
      it.out->send(it.peer, p2p_slot(Msg::Ready, it.k));
      it.in->recv(it.peer, p2p_slot(Msg::Header, it.k));
    }
    it.payload = ctx_->createUnboundBuffer(it.data ? it.data : &empty_byte, it.bytes);
  }
  auto left = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()),
                    std::chrono::milliseconds(1));
  };
  auto run = [&](P2PGroup::Item& it) {
    const char* partner = it.send ? "recv" : "send";
    try {
      if (!it.in->waitRecv(left())) throw std::runtime_error("aborted");
    } catch (const std::exception& e) {
      it.error = fmt::format("{}: no matching {} from {} ({})", it.name, partner, peer_name(it.peer), e.what());
      return;
    }
    const std::string theirs(it.theirs.what, strnlen(it.theirs.what, sizeof it.theirs.what));
    const bool differ = it.theirs.bytes != it.bytes || (!it.what.empty() && !theirs.empty() && theirs != it.what);
    if (differ || it.theirs.refused)
      it.error = fmt::format(
          "{} paired with {}'s {} #{}{}: NCCL pairs the k-th send from one rank to another with the k-th receive, "
          "whatever they carry, and both sides must agree",
          it.name, peer_name(it.peer), partner, it.k, sized(it.theirs.bytes, theirs));
    if (it.send) {  // the header: this send's size and name, or that the pair is refused
      it.mine.refused = it.error.empty() ? 0 : 1;
      it.out = ctx_->createUnboundBuffer(&it.mine, sizeof(Control));
      it.out->send(it.peer, p2p_slot(Msg::Header, it.k));
    }
    try {
      if (it.error.empty() && it.bytes > 0) {
        if (it.send) it.payload->send(it.peer, p2p_slot(Msg::Data, it.k));
        else it.payload->recv(it.peer, p2p_slot(Msg::Data, it.k));
        const bool ok = it.send ? it.payload->waitSend(left()) : it.payload->waitRecv(left());
        if (!ok) throw std::runtime_error("aborted");
      }
      if (!it.out->waitSend(left())) throw std::runtime_error("aborted");
    } catch (const std::exception& e) {
      if (it.error.empty())
        it.error = fmt::format("{}: the bytes did not move ({})", it.name, e.what());
    }
  };
  if (g.items.size() == 1) {
    run(g.items[0]);
  } else {
    std::vector<std::thread> th;
    for (auto& it : g.items) th.emplace_back([&run, &it] { run(it); });
    for (auto& t : th) t.join();
  }
  std::string err;
  for (const auto& it : g.items)  // a refused pair first: it explains the timeouts around it
    if (!it.error.empty() && (err.empty() || it.error.find("paired with") != std::string::npos)) err = it.error;
  if (!err.empty())
    throw std::runtime_error(fmt::format("{} (a communicator runs its operations in order, one at a time, and a "
                                         "point-to-point operation holds its stream until its partner runs: NCCL's "
                                         "rules, docs/distributed.md)",
                                         err));
}

}  // namespace dtrain::comm

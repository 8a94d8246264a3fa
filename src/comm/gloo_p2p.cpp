// GlooCommunicator's point-to-point groups under NCCL's rules (gloo_comm.h): the k-th send
// from one rank to another paired with the k-th receive, a header exchange per pair, every
// operation of a group progressing on a thread of its own, the group holding the stream.
#include <gloo/transport/tcp/device.h>
#include <gloo/rendezvous/context.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "comm/gloo_comm.h"
#include "comm/gloo_work.h"
#include "core/error.h"

namespace dtrain::comm {


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

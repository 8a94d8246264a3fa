#include "comm/communicator.h"

#include <net/if.h>

#include <cctype>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <thread>

#include "backend/backend.h"
#include "core/error.h"
#include "comm/env.h"
#include "comm/gloo_comm.h"
#include "comm/store.h"
#ifdef DTRAIN_WITH_CUDA
#include <nccl.h>

#include "comm/nccl_comm.h"
#endif

namespace dtrain::comm {
namespace {

bool is_loopback(const std::string& a) {
  return a == "localhost" || a.rfind("127.", 0) == 0 || a == "::1";
}

// The address other ranks reach this one at: DTRAIN_GLOO_HOST, else loopback when the
// master is local, else this machine's host name.
std::string own_hostname(const DistEnv& env) {
  if (const char* h = std::getenv("DTRAIN_GLOO_HOST"); h && *h) return h;
  if (is_loopback(env.master_addr)) return "127.0.0.1";
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || !buf[0]) return env.master_addr;
  return buf;
}

std::string join_ranks(const std::vector<int>& r, size_t max_shown) {
  std::string s;
  for (size_t i = 0; i < r.size(); ++i) {
    if (i == max_shown && r.size() > max_shown + 1) {
      s += fmt::format(",...,{}", r.back());
      break;
    }
    if (i) s += ',';
    s += std::to_string(r[i]);
  }
  return s;
}

}  // namespace

uint64_t wire::gloo_allreduce(uint64_t elements, uint64_t esize, int size, int rank) {
  if (elements == 0 || size <= 1) return 0;
  // gloo/allreduce.cc ring(), with its defaults (maxSegmentSize 1 MiB)
  const uint64_t P = uint64_t(size), total = elements * esize;
  const uint64_t max_seg = esize * std::max<uint64_t>(1, (uint64_t(1) << 20) / esize);
  const uint64_t want = std::max((total + max_seg - 1) / max_seg, P * 2);
  const uint64_t segs = (want + P - 1) / P * P, per_rank = segs / P;
  const uint64_t seg_bytes = ((total + segs - 1) / segs + esize - 1) / esize * esize;
  auto len = [&](uint64_t off) { return off >= total ? uint64_t(0) : std::min(seg_bytes, total - off); };
  uint64_t sent = 0;
  for (uint64_t i = 0; i < segs - per_rank; ++i) {
    sent += len((((uint64_t(rank) + 1) * per_rank + i) * seg_bytes) % (segs * seg_bytes));  // reduce-scatter
    sent += len(((uint64_t(rank) * per_rank + i) * seg_bytes) % (segs * seg_bytes));        // allgather
  }
  return sent;
}

uint64_t wire::gloo_broadcast(uint64_t bytes, int size, int rank, int root) {
  // gloo/broadcast.cc: virtual rank v = rank - root; round i of ceil(log2 size) takes the
  // ranks whose bits above i are zero; those with bit i clear send to v ^ (1 << i) if it exists
  const uint64_t vsize = uint64_t(size), vrank = (uint64_t(rank) + vsize - uint64_t(root)) % vsize;
  uint64_t dim = 0;
  while ((uint64_t(1) << dim) < vsize) ++dim;
  uint64_t mask = (uint64_t(1) << dim) - 1, sent = 0;
  for (uint64_t i = 0; i < dim; ++i) {
    mask ^= uint64_t(1) << i;
    if ((vrank & mask) != 0) continue;
    const uint64_t vpeer = vrank ^ (uint64_t(1) << i);
    if (vpeer >= vsize) continue;
    if ((vrank & (uint64_t(1) << i)) == 0) sent += bytes;
  }
  return sent;
}

Communicator::Communicator(Backend* be, const std::string& stream_name) : be_(be) {
  stream_ = be ? be->make_stream(stream_name) : std::make_unique<Stream>(stream_name, nullptr);
  // the one place the ordering is wired: every communicator, split groups included (they are
  // made with the same backend), orders its work after the backend's compute stream
  producer_ = be ? &be->compute_stream() : nullptr;
}

Communicator::~Communicator() = default;

namespace {

std::string op_label(const Communicator& c, const std::string& what) {
  return fmt::format("{} {} of {}", c.backend_name(), what, group_label(c.group_name(), c.global_ranks()));
}

}  // namespace

template <typename F>
std::shared_ptr<Work> Communicator::ordered(const std::string& what, const std::vector<MemAccess>& acc, F&& launch) {
  if (producer_) stream_->wait_for(*producer_);
  StreamMark mark = stream_->issue(op_label(*this, what), acc);
  std::shared_ptr<Work> w = launch();
  w->set_mark(std::move(mark));
  return w;
}

std::shared_ptr<Work> Communicator::allreduce_async(Tensor t, ReduceOp op) {
  return ordered("allreduce", {writes(t)}, [&] { return allreduce_impl(t, op); });
}

std::shared_ptr<Work> Communicator::reduce_scatter_async(Tensor in, Tensor out_shard, ReduceOp op) {
  return ordered("reduce_scatter", {reads(in), writes(out_shard)},
                 [&] { return reduce_scatter_impl(in, out_shard, op); });
}

std::shared_ptr<Work> Communicator::allgather_async(Tensor shard, Tensor out) {
  return ordered("allgather", {reads(shard), writes(out)}, [&] { return allgather_impl(shard, out); });
}

std::shared_ptr<Work> Communicator::broadcast_async(Tensor t, int root) {
  return ordered("broadcast", {writes(t)}, [&] { return broadcast_impl(t, root); });
}

std::shared_ptr<Work> Communicator::barrier_async() {
  return ordered("barrier", {}, [&] { return barrier_impl(); });
}

std::shared_ptr<Work> Communicator::p2p_async(const std::vector<P2POp>& ops) {
  std::vector<MemAccess> acc;
  std::string what = "p2p (";
  for (size_t i = 0; i < ops.size(); ++i) {
    const bool send = ops[i].kind == P2POp::Kind::Send;
    acc.push_back(send ? reads(ops[i].t) : writes(ops[i].t));
    if (i < 3)
      what += fmt::format("{}{} rank {}{}", i ? ", " : "", send ? "send to" : "recv from", ops[i].peer,
                          ops[i].what.empty() ? "" : ": " + ops[i].what);
    else if (i == 3)
      what += ", ...";
  }
  what += ")";
  return ordered(what, acc, [&] { return p2p_impl(ops); });
}

std::vector<int> Communicator::global_ranks() const {
  std::vector<int> g(static_cast<size_t>(size()));
  for (int i = 0; i < size(); ++i) g[size_t(i)] = i;
  return g;
}

std::unique_ptr<Communicator> Communicator::split_impl(const std::string& name, const std::vector<int>&) {
  fault("{} communicator of {}: process group '{}': this backend has no sub-groups", backend_name(),
        group_label(group_name(), global_ranks()), name);
}

std::shared_ptr<Work> Communicator::p2p_impl(const std::vector<P2POp>&) {
  fault("{} communicator of {}: this backend has no point-to-point operations", backend_name(),
        group_label(group_name(), global_ranks()));
}

int split_index(const Communicator& parent, const std::string& name, const std::vector<int>& ranks) {
  const std::string where = fmt::format("process group '{}' split from {} on its rank {}", name,
                                        group_label(parent.group_name(), parent.global_ranks()), parent.rank());
  bool ok_name = !name.empty() && name.size() <= 64;
  for (char c : name) ok_name = ok_name && (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-');
  if (!ok_name) user_error("{}: the name must be 1-64 characters of A-Z a-z 0-9 _ . -", where);
  std::set<int> seen;
  int index = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    int r = ranks[i];
    if (r < 0 || r >= parent.size())
      user_error("{}: member {} is not a rank of the parent group (it has {})", where, r, parent.size());
    if (!seen.insert(r).second) user_error("{}: member {} is listed twice", where, r);
    if (r == parent.rank()) index = int(i);
  }
  if (!ranks.empty() && index < 0)
    user_error("{}: the member list [{}] does not contain this rank ({}); a rank passes its own group, or an "
               "empty list", where, join_ranks(ranks, 16), parent.rank());
  return index;
}

std::string split_key(const std::string& name, uint64_t nth, const std::vector<int>& ranks) {
  std::string members;
  if (ranks.size() <= 16) {
    members = join_ranks(ranks, 16);
    std::replace(members.begin(), members.end(), ',', '.');
  } else {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the list
    for (int r : ranks) {
      h ^= uint64_t(uint32_t(r));
      h *= 1099511628211ull;
    }
    members = fmt::format("{}x{}-{:016x}", ranks.front(), ranks.size(), h);
  }
  return fmt::format("grp/{}/{}/{}/", name, nth, members);
}

std::vector<int> global_or_identity(std::vector<int> global, int size) {
  if (global.empty())
    for (int i = 0; i < size; ++i) global.push_back(i);
  return global;
}

std::string stream_label(const std::string& backend, const std::string& name, const std::vector<int>& global) {
  bool identity = true;
  for (size_t i = 0; i < global.size(); ++i) identity = identity && global[i] == int(i);
  if (name == "world" && identity) return backend + " world";
  return fmt::format("{} {} (global ranks {})", backend, name, join_ranks(global, 16));
}

std::string group_label(const std::string& name, const std::vector<int>& global) {
  bool identity = true;
  for (size_t i = 0; i < global.size(); ++i) identity = identity && global[i] == int(i);
  if (name == "world" && identity) return "group 'world'";
  return fmt::format("group '{}' (global ranks {})", name, join_ranks(global, 16));
}

std::string report_arrivals(Store& store, const std::string& prefix, uint64_t seq, int rank,
                            const std::vector<int>& global, std::chrono::milliseconds grace) {
  const int n = int(global.size());
  auto key = [&](int r) { return fmt::format("{}fail/{}", prefix, r); };
  std::vector<int64_t> seen(size_t(n), -1);  // the peer's record, -1 = none yet
  const auto deadline = std::chrono::steady_clock::now() + grace;
  // Every store request ends by then too (a pass begun before the deadline gets 250 ms more):
  // the store's host may be cut off from this rank, or gone without a word, and waiting out the
  // store's own timeout would double the time this rank takes to fail.
  StoreDeadline limit(deadline + std::chrono::milliseconds(250));
  try {
    store.set(key(rank), std::to_string(seq));
    while (true) {
      bool all = true;
      for (int r = 0; r < n; ++r) {
        if (r == rank || seen[size_t(r)] >= int64_t(seq)) continue;
        if (std::chrono::steady_clock::now() >= deadline) {
          all = false;
          break;
        }
        if (store.check({key(r)})) seen[size_t(r)] = std::stoll(store.get_string(key(r)));
        all = all && seen[size_t(r)] >= int64_t(seq);
      }
      if (all) return "; every peer arrived";
      if (std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception& e) {
    return fmt::format("; arrivals unknown: the store is unreachable: {}", e.what());
  }
  std::string out;
  for (int r = 0; r < n; ++r) {
    if (r == rank || seen[size_t(r)] >= int64_t(seq)) continue;
    out += fmt::format("{}rank {} (global {})", out.empty() ? "" : ", ", r, global[size_t(r)]);
    if (seen[size_t(r)] >= 0) out += fmt::format(" failed earlier, at #{}", seen[size_t(r)]);
  }
  return fmt::format("; not arrived within {} ms: {}", grace.count(), out);
}

std::string gloo_iface_from_env() {
  std::string var, name;
  if (const char* i = std::getenv("DTRAIN_GLOO_IFACE"); i && *i) {
    var = "DTRAIN_GLOO_IFACE", name = i;
  } else if (const char* g = std::getenv("GLOO_SOCKET_IFNAME"); g && *g) {
    var = "GLOO_SOCKET_IFNAME", name = std::string(g).substr(0, std::string(g).find(','));
  }
  if (!name.empty() && if_nametoindex(name.c_str()) == 0) {
    std::string have;
    if (struct if_nameindex* ifs = if_nameindex()) {
      for (auto* p = ifs; p->if_index != 0; ++p) have += std::string(have.empty() ? "" : ", ") + p->if_name;
      if_freenameindex(ifs);
    }
    user_error("environment variable {}={}: no network interface '{}' on this machine (it has: {})", var,
               std::getenv(var.c_str()), name, have);
  }
  return name;
}

std::unique_ptr<Communicator> make_communicator(const DistEnv& env, Store& store, Backend& be, double timeout_s) {
  const Device device = be.device();
  if (timeout_s <= 0) user_error("distributed timeout {} s: expected a positive number", timeout_s);
  const std::string prefix = fmt::format("r{}/", env.restart_count);
  if (device.is_cpu()) {
    GlooOptions o;
    o.iface = gloo_iface_from_env();
    o.hostname = own_hostname(env);
    o.key_prefix = prefix + "gloo/";
    o.timeout_s = timeout_s;
    return std::make_unique<GlooCommunicator>(store, env.rank, env.world_size, o, &be);
  }
#ifdef DTRAIN_WITH_CUDA
  return std::make_unique<NcclCommunicator>(store, env.rank, env.world_size, be, prefix + "nccl/", timeout_s);
#else
  user_error("device {}: this dtrain was built without CUDA, so NCCL is unavailable", device.str());
#endif
}

std::vector<std::string> describe_communicators() {
  std::vector<std::string> out = {"Gloo: CPU tensors (Debian's libgloo)"};
#ifdef DTRAIN_WITH_CUDA
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess) {
    if (v >= 20900) out.push_back(fmt::format("NCCL: {}.{}.{}", v / 10000, (v % 10000) / 100, v % 100));
    else out.push_back(fmt::format("NCCL: {}.{}.{}", v / 1000, (v % 1000) / 100, v % 100));
  }
#else
  out.push_back("NCCL: not built");
#endif
  return out;
}

}  // namespace dtrain::comm

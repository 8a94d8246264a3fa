#include "comm/communicator.h"

#include <net/if.h>

#include <unistd.h>

#include <cstdlib>

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

}  // namespace

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

std::unique_ptr<Communicator> make_communicator(const DistEnv& env, Store& store,
                                                Device device, double timeout_s) {
  if (timeout_s <= 0) user_error("distributed timeout {} s: expected a positive number", timeout_s);
  const std::string prefix = fmt::format("r{}/", env.restart_count);
  if (device.is_cpu()) {
    GlooOptions o;
    o.iface = gloo_iface_from_env();
    o.hostname = own_hostname(env);
    o.key_prefix = prefix + "gloo/";
    o.timeout_s = timeout_s;
    return std::make_unique<GlooCommunicator>(store, env.rank, env.world_size, o);
  }
#ifdef DTRAIN_WITH_CUDA
  return std::make_unique<NcclCommunicator>(store, env.rank, env.world_size, device.index,
                                            prefix + "nccl/", timeout_s);
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

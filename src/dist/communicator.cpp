#include "dist/communicator.h"

#include <net/if.h>

#include <unistd.h>

#include <cstdlib>

#include "core/error.h"
#include "dist/env.h"
#include "dist/gloo_comm.h"
#include "dist/store.h"
#ifdef DTRAIN_WITH_CUDA
#include "dist/nccl_comm.h"
#endif

namespace dtrain::dist {
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
  const std::string prefix = "r" + std::to_string(env.restart_count) + "/";
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

}  // namespace dtrain::dist

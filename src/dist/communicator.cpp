#include "dist/communicator.h"

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

std::unique_ptr<Communicator> make_communicator(const DistEnv& env, Store& store,
                                                Device device, double timeout_s) {
  if (timeout_s <= 0) user_error("distributed timeout {} s: expected a positive number", timeout_s);
  const std::string prefix = "r" + std::to_string(env.restart_count) + "/";
  if (device.is_cpu()) {
    GlooOptions o;
    if (const char* i = std::getenv("DTRAIN_GLOO_IFACE"); i && *i) o.iface = i;
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

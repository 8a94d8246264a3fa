#include "comm/rendezvous.h"

#include "core/error.h"
#include "core/log.h"
#include "comm/c10d_store.h"

namespace dtrain::comm {

Rendezvous open_rendezvous(const DistEnv& env, const std::string& token, std::chrono::milliseconds timeout) {
  Rendezvous r;
  if (env.agent_store) {
    auto dialect = parse_dialect(env.tcpstore_protocol);
    if (!dialect) user_error("environment variable DTRAIN_TCPSTORE_PROTOCOL='{}': expected auto, legacy or validate",
                             env.tcpstore_protocol);
    auto s = std::make_unique<C10dStore>(env.master_addr, env.master_port, kAgentKeyPrefix, timeout, *dialect);
    r.kind = std::string("c10d-") + dialect_name(s->dialect());
    log::info("rendezvous: torchrun's agent store at {} ({} protocol), keys under '{}'", s->address(),
               dialect_name(s->dialect()), kAgentKeyPrefix);
    r.store = std::move(s);
    return r;
  }
  if (env.host_store) r.server = std::make_unique<StoreServer>("", env.master_port, token);
  r.store = std::make_unique<StoreClient>(env.master_addr, env.master_port, token, timeout);
  r.kind = "dtrain";
  if (env.rank == 0)
    log::info("rendezvous: dtrain's store at {}:{} (hosted by {}), {} ranks started by {}", env.master_addr,
              env.master_port, env.host_store ? "rank 0" : "the launcher", env.world_size, env.source);
  return r;
}

}  // namespace dtrain::comm

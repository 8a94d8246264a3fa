#pragma once
// Opens the rendezvous store of a worker, as dist_env() describes it:
//  * torchrun's agent store (env.agent_store): a C10dStore client of MASTER_ADDR:MASTER_PORT,
//    every key under kAgentKeyPrefix ("dtrain/"), so "r<restart>/gloo/0" is the torch key
//    "dtrain/r<restart>/gloo/0". Nobody hosts anything.
//  * otherwise: dtrain's StoreClient of MASTER_ADDR:MASTER_PORT with the job token; this
//    process hosts the StoreServer there first when env.host_store (rank 0 without dtrain's
//    launcher).
// Callers prefix their keys with "r<restart_count>/", so a restarted group never reads a
// key of the previous attempt.
#include <chrono>
#include <memory>
#include <string>

#include "comm/env.h"
#include "comm/store.h"

namespace dtrain::comm {

inline constexpr const char* kAgentKeyPrefix = "dtrain/";

struct Rendezvous {
  std::unique_ptr<StoreServer> server;  // only when this process hosts dtrain's store
  std::unique_ptr<Store> store;
  std::string kind;  // "c10d-legacy" | "c10d-validate" | "dtrain"
};

// `token`: dtrain's job token (unused with the agent store). RuntimeFault naming the
// address when the store cannot be reached within `timeout`.
Rendezvous open_rendezvous(const DistEnv& env, const std::string& token, std::chrono::milliseconds timeout);

}  // namespace dtrain::comm

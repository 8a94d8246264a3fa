#pragma once
// Replicas start equal: rank 0's parameters and buffers are broadcast, then every rank's
// SHA-256 of them is compared.
#include <array>
#include <cstdint>

#include "comm/communicator.h"
#include "nn/params.h"

namespace dtrain::parallel {

// Broadcasts params and float buffers from rank 0, then checks that every rank holds
// identical params+buffers (allgather of their SHA-256); RuntimeFault naming the ranks
// that differ. Counters (host int64) are not touched.
void sync_params(comm::Communicator& comm, ParamStore& ps);
// The check alone (collective): RuntimeFault on every rank when any rank differs.
// with_buffers = false: the parameters alone (batch-norm running statistics are each rank's
// own during training, as under DDP without broadcast_buffers; rank 0's are checkpointed).
void verify_params(comm::Communicator& comm, ParamStore& ps, bool with_buffers = true);
// SHA-256 of the flat params followed (with_buffers) by the flat buffers (host copy).
std::array<uint8_t, 32> params_digest(ParamStore& ps, bool with_buffers = true);

}  // namespace dtrain::parallel

#include "parallel/param_sync.h"

#include <cstring>

#include "core/error.h"
#include "core/sha256.h"

namespace dtrain::parallel {

std::array<uint8_t, 32> params_digest(ParamStore& ps, bool with_buffers) {
  Sha256 h;
  std::vector<uint8_t> host;
  std::vector<Tensor> parts{ps.flat_params()};
  if (with_buffers) parts.push_back(ps.flat_buffers());
  for (const Tensor& t : parts) {
    host.resize(t.nbytes());
    if (!host.empty()) ps.backend().copy_to_host(host.data(), t.data, host.size());
    h.update(host.data(), host.size());
  }
  return h.digest();
}

void sync_params(comm::Communicator& comm, ParamStore& ps) {
  Tensor p = ps.flat_params(), b = ps.flat_buffers();
  if (p.numel()) comm.broadcast(p, 0);
  if (b.numel()) comm.broadcast(b, 0);
  verify_params(comm, ps);
}

void verify_params(comm::Communicator& comm, ParamStore& ps, bool with_buffers) {
  // Digest as 16 floats holding 16-bit halves (exact in f32, safe through any transport).
  auto d = params_digest(ps, with_buffers);
  const int W = comm.size();
  std::vector<float> mine(16), all(size_t(16 * W));
  for (int i = 0; i < 16; ++i) mine[size_t(i)] = float(d[size_t(2 * i)] | (d[size_t(2 * i + 1)] << 8));
  Backend& be = ps.backend();
  Buffer dev_mine(be, 16 * sizeof(float)), dev_all(be, all.size() * sizeof(float));
  Tensor tm = dev_mine.tensor(DType::F32, Shape{16}), ta = dev_all.tensor(DType::F32, Shape{int64_t(16 * W)});
  be.copy_from_host(tm.data, mine.data(), 16 * sizeof(float));
  comm.allgather(tm, ta);
  be.copy_to_host(all.data(), ta.data, all.size() * sizeof(float));
  std::string bad;
  for (int r = 1; r < W; ++r)
    if (std::memcmp(all.data() + 16 * r, all.data(), 16 * sizeof(float)) != 0)
      bad += (bad.empty() ? "" : ", ") + std::to_string(r);
  if (!bad.empty())
    fault("parameter check: rank(s) {} hold {} that differ from rank 0 (SHA-256 of the flat buffers, checked "
          "on rank {})", bad, with_buffers ? "parameters/buffers" : "parameters", comm.rank());
}

}  // namespace dtrain::parallel

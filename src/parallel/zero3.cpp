#include "parallel/zero3.h"

#include <algorithm>
#include <csignal>

#include "core/clock.h"
#include "core/error.h"
#include "core/failpoint.h"
#include "parallel/zero.h"

namespace dtrain::parallel {

std::vector<std::vector<Zero3::Run>> Zero3::f32_runs(const ParamStore& ps, int u, int world) {
  const UnitDesc& d = ps.units()[size_t(u)];
  const int64_t S = (d.numel() + world - 1) / world;  // ParamStore::unit_shard_size
  std::vector<std::vector<Run>> out(static_cast<size_t>(world));
  std::vector<int64_t> packed(static_cast<size_t>(world), 0);
  for (int id = d.first_param; id < d.end_param; ++id) {
    const ParamDesc& p = ps.params()[size_t(id)];
    if (!p.read_f32) continue;
    const int64_t a = p.offset - d.begin, b = a + p.shape.numel();
    for (int r = 0; r < world; ++r) {
      const int64_t lo = std::max(a, r * S), hi = std::min(b, (r + 1) * S);
      if (lo >= hi) continue;
      out[size_t(r)].push_back(Run{lo, hi - lo, packed[size_t(r)]});
      packed[size_t(r)] += hi - lo;
    }
  }
  return out;
}

int64_t zero3_f32_pack(const ParamStore& ps, int u, int world) {
  int64_t most = 0;
  for (const auto& runs : Zero3::f32_runs(ps, u, world)) {
    int64_t n = 0;
    for (const auto& r : runs) n += r.count;
    most = std::max(most, n);
  }
  return most;
}

Zero3::Zero3(comm::Communicator& comm, ParamStore& ps, comm::Communicator* replicate, DType reduce_dtype)
    : comm_(comm), replicate_(replicate), ps_(ps), be_(ps.backend()), world_(comm.size()),
      reduce_dtype_(reduce_dtype), gather16_(ps.mixed()) {
  DTRAIN_CHECK(ps.finalized() && ps.sharded() && ps.shard_world() == world_ && ps.shard_rank() == comm.rank(),
               "Zero3: the ParamStore must be finalized and sharded as rank {} of {}", comm.rank(), world_);
  DTRAIN_CHECK(reduce_dtype == DType::F32 || reduce_dtype == DType::BF16, "Zero3: reduce dtype {}",
               dtype_name(reduce_dtype));
  const std::vector<UnitDesc>& units = ps.units();
  roots_.resize(units.size());
  runs_.resize(units.size());
  pack_.assign(units.size(), 0);
  int64_t max_shard = 0, max_pack = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (gather16_) {
      runs_[u] = f32_runs(ps, int(u), world_);
      pack_[u] = zero3_f32_pack(ps, int(u), world_);
    }
    if (units[u].root) {
      roots_[u] = make_slot(ps.unit_shard_size(int(u)), pack_[u]);
      roots_[u].unit = int(u);
      root_ids_.push_back(int(u));
    } else {
      max_shard = std::max(max_shard, ps.unit_shard_size(int(u)));
      max_pack = std::max(max_pack, pack_[u]);
    }
  }
  if (max_shard > 0) {
    shared_.push_back(make_slot(max_shard, max_pack));
    shared_.push_back(make_slot(max_shard, max_pack));
  }
  norm_buf_ = Buffer(be_, sizeof(float));
  global_rank_ = comm.global_ranks()[size_t(comm.rank())];
}

Zero3::~Zero3() {
  // a failed step may leave collectives in flight: let them end before their buffers go
  auto quiet = [](Slot& s) {
    try {
      if (s.gather) s.gather->wait();
      if (s.gather32) s.gather32->wait();
      if (s.scatter) s.scatter->wait();
    } catch (const std::exception&) {
    }
  };
  for (Slot& s : shared_) quiet(s);
  for (Slot& s : roots_) quiet(s);
}

Zero3::Slot Zero3::make_slot(int64_t shard, int64_t pack) const {
  Slot s;
  const size_t full = size_t(shard) * size_t(world_);
  s.params = Buffer(be_, full * sizeof(float));
  s.grads = Buffer(be_, full * sizeof(float));
  s.reduced = Buffer(be_, size_t(shard) * sizeof(float));
  if (ps_.mixed()) s.cparams = Buffer(be_, full * dtype_size(ps_.compute_dtype()));
  if (reduce_dtype_ == DType::BF16) {
    s.grads16 = Buffer(be_, full * 2);
    s.reduced16 = Buffer(be_, size_t(shard) * 2);
  }
  if (pack > 0) s.pack = Buffer(be_, size_t(pack) * size_t(world_) * sizeof(float));
  return s;
}

int Zero3::next_unit(int unit, int dir) const {
  const auto& units = ps_.units();
  for (int u = unit + dir; u >= 0 && u < int(units.size()); u += dir)
    if (!units[size_t(u)].root) return u;
  return -1;
}

void Zero3::launch_gather(Slot& s, int unit, bool master) {
  // a prefetch nobody used: it must end before the slot is reused
  if (s.gather) s.gather->wait();
  if (s.gather32) s.gather32->wait();
  s.gather.reset();
  s.gather32.reset();
  s.unit = unit;
  s.master = master || !gather16_;
  const int64_t shard = ps_.unit_shard_size(unit);
  Tensor mine = ps_.unit_shard_params(unit);
  if (s.master) {
    Tensor out = s.params.tensor(DType::F32, Shape{shard * world_});
    s.gather = comm_.allgather_async(mine, out);
    if (!master) traffic_.allgather += int64_t(out.nbytes());
    return;
  }
  // 16 bits on the wire: this rank's shard cast into its own slot of the window
  Tensor out = s.cparams.tensor(ps_.compute_dtype(), Shape{shard * world_});
  Tensor own = out.slice0(int64_t(comm_.rank()) * shard, int64_t(comm_.rank() + 1) * shard);
  be_.cast(mine, own);
  const int64_t pack = pack_[size_t(unit)];
  Tensor all;
  if (pack > 0) {  // the read_f32 parameters' f32 values: this rank's pieces packed
    all = s.pack.tensor(DType::F32, Shape{pack * world_});
    for (const Run& r : runs_[size_t(unit)][size_t(comm_.rank())]) {
      Tensor dst = all.slice0(comm_.rank() * pack + r.packed, comm_.rank() * pack + r.packed + r.count);
      be_.copy(mine.slice0(r.at - comm_.rank() * shard, r.at - comm_.rank() * shard + r.count), dst);
    }
  }
  s.gather = comm_.allgather_async(own, out);
  traffic_.allgather += int64_t(out.nbytes());
  if (pack > 0) {
    s.gather32 = comm_.allgather_async(all.slice0(comm_.rank() * pack, (comm_.rank() + 1) * pack), all);
    traffic_.allgather += int64_t(all.nbytes());
    traffic_.allgather_f32 += int64_t(all.nbytes());
  }
}

void Zero3::wait_gather(Slot& s) {
  if (s.gather) s.gather->wait();
  s.gather.reset();
  if (!s.gather32) return;
  s.gather32->wait();
  s.gather32.reset();
  const int64_t pack = pack_[size_t(s.unit)];
  Tensor all = s.pack.tensor(DType::F32, Shape{pack * world_});
  Tensor params = s.params.tensor(DType::F32, Shape{ps_.unit_shard_size(s.unit) * world_});
  for (int rank = 0; rank < world_; ++rank)
    for (const Run& r : runs_[size_t(s.unit)][size_t(rank)]) {
      Tensor dst = params.slice0(r.at, r.at + r.count);
      be_.copy(all.slice0(rank * pack + r.packed, rank * pack + r.packed + r.count), dst);
    }
}

Zero3::Slot& Zero3::slot_of(int unit) {
  if (ps_.units()[size_t(unit)].root) return roots_[size_t(unit)];
  DTRAIN_CHECK(shared_.size() == 2, "Zero3: unit {} without slots", unit);
  for (Slot& s : shared_)
    if (s.unit == unit) return s;
  const int pick = shared_[0].attached ? 1 : shared_[1].attached ? 0 : 1 - last_shared_;
  DTRAIN_CHECK(!shared_[size_t(pick)].attached, "Zero3: unit {} while two units are in use", unit);
  launch_gather(shared_[size_t(pick)], unit);
  return shared_[size_t(pick)];
}

void Zero3::ready(Slot& s, int unit, bool with_grads) {
  if (s.master && gather16_) launch_gather(s, unit);  // gather_full left the f32 master there
  wait_gather(s);
  const int64_t full = ps_.unit_shard_size(unit) * world_;
  if (with_grads) {
    if (s.scatter) finish_scatter(s);
    Tensor g = s.grads.tensor(DType::F32, Shape{full});
    be_.fill(g, 0.f);  // the padding past the unit stays zero for the reduce-scatter
  }
  s.attached = true;
  ps_.attach_unit(unit, static_cast<float*>(s.params.data()), ps_.mixed() ? s.cparams.data() : nullptr,
                  with_grads ? static_cast<float*>(s.grads.data()) : nullptr);
  if (!shared_.empty() && &s == &shared_[1]) last_shared_ = 1;
  if (!shared_.empty() && &s == &shared_[0]) last_shared_ = 0;
}

void Zero3::prefetch(int unit) {
  if (unit < 0) return;
  for (Slot& s : shared_)
    if (s.unit == unit) return;  // held (e.g. from the forward) or already on its way
  Slot& free = shared_[0].attached ? shared_[1] : shared_[0];
  if (free.attached) return;
  launch_gather(free, unit);
}

void Zero3::finish_scatter(Slot& s) {
  s.scatter->wait();
  s.scatter.reset();
  Tensor g = ps_.unit_shard_grads(s.grad_unit);
  Tensor r = s.reduced.tensor(DType::F32, g.shape);
  // hybrid sharding: the shard group's average, averaged over the replicas holding the same
  // piece (every rank finishes its scatters in the same order, so these line up)
  if (reduce_dtype_ == DType::BF16) {
    Tensor r16 = s.reduced16.tensor(DType::BF16, g.shape);
    if (replicate_) replicate_->allreduce(r16, comm::ReduceOp::Avg);
    be_.cast(r16, r);
  } else if (replicate_) {
    replicate_->allreduce(r, comm::ReduceOp::Avg);
  }
  be_.add(g, r, g);  // micro-batches accumulate in the shard
  s.grad_unit = -1;
}

void Zero3::begin_pass(bool training) {
  training_ = training;
  if (training) passes_++;
  for (Slot& s : shared_) {  // the master shards changed since the last pass
    if (s.gather) s.gather->wait();
    if (s.gather32) s.gather32->wait();
    s.gather.reset();
    s.gather32.reset();
    s.unit = -1;
  }
  for (int u : root_ids_) launch_gather(roots_[size_t(u)], u);
  for (int u : root_ids_) ready(roots_[size_t(u)], u, training);
}

double Zero3::end_pass() {
  const auto t0 = Clock::now();
  for (int u : root_ids_) {
    Slot& s = roots_[size_t(u)];
    ps_.detach_unit(u);
    s.attached = false;
    if (training_) launch_scatter(s, u);
  }
  auto settle = [&](Slot& s) {
    if (s.attached) ps_.detach_unit(s.unit);
    s.attached = false;
    if (s.gather) s.gather->wait();
    if (s.gather32) s.gather32->wait();
    s.gather.reset();
    s.gather32.reset();
    if (s.scatter) finish_scatter(s);
  };
  for (Slot& s : shared_) settle(s);
  for (int u : root_ids_) settle(roots_[size_t(u)]);
  training_ = false;
  return seconds_since(t0);
}

void Zero3::before_forward(int unit) {
  Slot& s = slot_of(unit);
  if (s.gather && failpoint::hits(failpoint::Point::KillInGather, global_rank_, passes_)) raise(SIGKILL);
  ready(s, unit, false);
  prefetch(next_unit(unit, +1));
}

void Zero3::after_forward(int unit) {
  Slot& s = slot_of(unit);
  ps_.detach_unit(unit);
  s.attached = false;  // released; kept until another unit needs the slot
}

void Zero3::before_backward(int unit) {
  Slot& s = slot_of(unit);
  ready(s, unit, true);
  prefetch(next_unit(unit, -1));
}

void Zero3::after_backward(int unit) {
  Slot& s = slot_of(unit);
  ps_.detach_unit(unit);
  s.attached = false;
  launch_scatter(s, unit);
}

void Zero3::launch_scatter(Slot& s, int unit) {
  const int64_t shard = ps_.unit_shard_size(unit);
  Tensor g = s.grads.tensor(DType::F32, Shape{shard * world_});
  s.grad_unit = unit;
  if (reduce_dtype_ == DType::BF16) {
    Tensor g16 = s.grads16.tensor(DType::BF16, g.shape);
    be_.cast(g, g16);
    s.scatter = comm_.reduce_scatter_async(g16, s.reduced16.tensor(DType::BF16, Shape{shard}), comm::ReduceOp::Avg);
    traffic_.reduce_scatter += int64_t(g16.nbytes());
    return;
  }
  Tensor r = s.reduced.tensor(DType::F32, Shape{shard});
  s.scatter = comm_.reduce_scatter_async(g, r, comm::ReduceOp::Avg);
  traffic_.reduce_scatter += int64_t(g.nbytes());
}

double Zero3::grad_sq_norm(double scale) {
  const Tensor g = ps_.shard_grads();
  const double sq = g.numel() ? be_.sum_squares(g) : 0.0;
  return sum_over_group(comm_, be_, norm_buf_, sq * scale * scale);
}

std::vector<float> Zero3::gather_full() {
  std::vector<float> out(size_t(ps_.num_params()));
  const auto& units = ps_.units();
  for (size_t u = 0; u < units.size(); ++u) {
    Slot& s = units[u].root ? roots_[u] : shared_[0];
    DTRAIN_CHECK(!s.attached, "Zero3::gather_full during a pass");
    launch_gather(s, int(u), /*master=*/true);
    s.gather->wait();
    s.gather.reset();
    be_.copy_to_host(out.data() + units[u].begin, s.params.data(), size_t(units[u].numel()) * sizeof(float));
    if (!units[u].root) s.unit = -1;
  }
  return out;
}

int64_t Zero3::shard_bytes() const { return 2 * ps_.shard_params().numel() * int64_t(sizeof(float)); }

int64_t Zero3::window_bytes() const {
  int64_t n = 0;
  auto add = [&](const Slot& s) {
    n += int64_t(s.params.bytes() + s.cparams.bytes() + s.grads.bytes() + s.reduced.bytes() + s.grads16.bytes() +
                 s.reduced16.bytes() + s.pack.bytes());
  };
  for (const Slot& s : shared_) add(s);
  for (int u : root_ids_) add(roots_[size_t(u)]);
  return n;
}

}  // namespace dtrain::parallel

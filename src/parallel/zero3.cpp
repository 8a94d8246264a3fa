#include "parallel/zero3.h"

#include <algorithm>
#include <csignal>

#include "core/clock.h"
#include "core/error.h"
#include "core/failpoint.h"
#include "parallel/zero.h"

namespace dtrain::parallel {

Zero3::Zero3(comm::Communicator& comm, ParamStore& ps, comm::Communicator* replicate)
    : comm_(comm), replicate_(replicate), ps_(ps), be_(ps.backend()), world_(comm.size()) {
  DTRAIN_CHECK(ps.finalized() && ps.sharded() && ps.shard_world() == world_ && ps.shard_rank() == comm.rank(),
               "Zero3: the ParamStore must be finalized and sharded as rank {} of {}", comm.rank(), world_);
  const std::vector<UnitDesc>& units = ps.units();
  roots_.resize(units.size());
  int64_t max_shard = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].root) {
      roots_[u] = make_slot(ps.unit_shard_size(int(u)));
      roots_[u].unit = int(u);
      root_ids_.push_back(int(u));
    } else {
      max_shard = std::max(max_shard, ps.unit_shard_size(int(u)));
    }
  }
  if (max_shard > 0) {
    shared_.push_back(make_slot(max_shard));
    shared_.push_back(make_slot(max_shard));
  }
  norm_buf_ = Buffer(be_, sizeof(float));
  global_rank_ = comm.global_ranks()[size_t(comm.rank())];
}

Zero3::~Zero3() {
  // a failed step may leave collectives in flight: let them end before their buffers go
  auto quiet = [](Slot& s) {
    try {
      if (s.gather) s.gather->wait();
      if (s.scatter) s.scatter->wait();
    } catch (const std::exception&) {
    }
  };
  for (Slot& s : shared_) quiet(s);
  for (Slot& s : roots_) quiet(s);
}

Zero3::Slot Zero3::make_slot(int64_t shard) const {
  Slot s;
  const size_t full = size_t(shard) * size_t(world_);
  s.params = Buffer(be_, full * sizeof(float));
  s.grads = Buffer(be_, full * sizeof(float));
  s.reduced = Buffer(be_, size_t(shard) * sizeof(float));
  if (ps_.mixed()) s.cparams = Buffer(be_, full * dtype_size(ps_.compute_dtype()));
  return s;
}

void Zero3::sync_host() {
  if (be_.device().is_cpu()) be_.synchronize();
}

int Zero3::next_unit(int unit, int dir) const {
  const auto& units = ps_.units();
  for (int u = unit + dir; u >= 0 && u < int(units.size()); u += dir)
    if (!units[size_t(u)].root) return u;
  return -1;
}

void Zero3::launch_gather(Slot& s, int unit) {
  if (s.gather) s.gather->wait();  // a prefetch nobody used: it must end before the slot is reused
  s.gather.reset();
  s.unit = unit;
  s.cast = false;
  const int64_t shard = ps_.unit_shard_size(unit);
  Tensor mine = ps_.unit_shard_params(unit);
  Tensor out = s.params.tensor(DType::F32, Shape{shard * world_});
  sync_host();
  s.gather = comm_.allgather_async(mine, out);
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
  if (s.gather) {
    s.gather->wait();
    s.gather.reset();
  }
  const int64_t full = ps_.unit_shard_size(unit) * world_;
  if (ps_.mixed() && !s.cast) {
    Tensor p = s.params.tensor(DType::F32, Shape{full});
    Tensor c = s.cparams.tensor(ps_.compute_dtype(), Shape{full});
    be_.cast(p, c);
    s.cast = true;
  }
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
  if (replicate_) replicate_->allreduce(r, comm::ReduceOp::Avg);
  be_.add(g, r, g);  // micro-batches accumulate in the shard
  s.grad_unit = -1;
}

void Zero3::begin_pass(bool training) {
  training_ = training;
  if (training) passes_++;
  for (Slot& s : shared_) {  // the master shards changed since the last pass
    if (s.gather) s.gather->wait();
    s.gather.reset();
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
    s.gather.reset();
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
  Tensor r = s.reduced.tensor(DType::F32, Shape{shard});
  sync_host();
  s.grad_unit = unit;
  s.scatter = comm_.reduce_scatter_async(g, r, comm::ReduceOp::Avg);
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
    launch_gather(s, int(u));
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
    n += int64_t(s.params.bytes() + s.cparams.bytes() + s.grads.bytes() + s.reduced.bytes());
  };
  for (const Slot& s : shared_) add(s);
  for (int u : root_ids_) add(roots_[size_t(u)]);
  return n;
}

}  // namespace dtrain::parallel

#include "plan/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "session/dist_setup.h"
#include "session/runtime.h"

namespace dtrain {

namespace {

int64_t round_up(int64_t n, int64_t q) { return (n + q - 1) / q * q; }
int64_t ceil_div(int64_t n, int64_t d) { return (n + d - 1) / d; }

// optimizer state buffers (optim/optimizer.cpp: Sgd adds "momentum" when momentum > 0,
// AdamW "exp_avg" and "exp_avg_sq"; session/session.cpp makes AdamW for any name but "sgd")
int optimizer_states(const Config& cfg) {
  if (cfg.optim.name == "sgd") return cfg.optim.momentum > 0 ? 1 : 0;
  return 2;
}

constexpr int64_t kMiB = int64_t(1) << 20;

}  // namespace

int64_t alloc_bytes(int64_t n, AllocRounding r) {
  if (n <= 0) return 0;
  if (r == AllocRounding::Cuda) {
    // backend/cuda/memory.cpp round_size: 512 B, 2 MiB above 16 MiB
    return round_up(n, n > 16 * kMiB ? 2 * kMiB : 512);
  }
  // backend/cpu: aligned_alloc(256, n rounded up to 256), counted as malloc_usable_size.
  // glibc serves it from the heap (8 bytes of slack) below its mmap threshold (128 KiB by
  // default) and from its own pages above it (the chunk is page-rounded and 256 bytes of
  // it go to the alignment). A process that has freed large blocks raises the threshold,
  // and such blocks then come from the heap: at most 4 KiB less each.
  const int64_t a = round_up(n, 256);
  if (a + 304 < 128 * 1024) return a + 8;
  return round_up(a + 312, 4096) - 256;
}

int64_t ArenaBlocks::peak() const {
  int64_t p = steady;
  for (int64_t v : peaks) p = std::max(p, v);
  return p;
}

ArenaBlocks arena_blocks(const std::vector<int64_t>& marks, AllocRounding r) {
  std::vector<int64_t> blocks;
  int64_t high_water = 0;
  ArenaBlocks out;
  auto held = [&] {
    int64_t n = 0;
    for (int64_t b : blocks) n += alloc_bytes(b, r);
    return n;
  };
  for (int64_t mark : marks) {
    if (mark > 0) {
      int64_t cap = 0;
      for (int64_t b : blocks) cap += b;
      if (blocks.empty()) {
        blocks.push_back(64 * kMiB);
        cap = blocks.back();
      }
      while (cap < mark) {  // Arena::alloc: a new block as large as the last
        blocks.push_back(blocks.back());
        cap += blocks.back();
      }
    }
    out.peaks.push_back(held());
    high_water = std::max(high_water, mark);
    if (blocks.size() > 1) blocks.assign(1, round_up(high_water, kMiB));  // Arena::reset
  }
  out.steady = held();
  return out;
}

int64_t zero3_shard_elements(const ParamStore& ps, int world) {
  int64_t n = 0;
  for (const UnitDesc& u : ps.units()) n += ceil_div(u.numel(), world);  // ParamStore::set_sharding
  return n;
}

int64_t zero3_window_bytes(const ParamStore& ps, int world, DType compute, AllocRounding r, DType reduce) {
  // parallel/zero3.cpp: make_slot(shard, pack) = params and grads [world * shard] f32,
  // reduced [shard] f32; under mixed precision the compute-dtype copy [world * shard] and the
  // f32 pack of the read_f32 parameters [world * pack]; with reduce dtype bf16 the bf16 casts
  // of grads and reduced. One slot per root unit, two of the largest non-root unit.
  auto slot = [&](int64_t shard, int64_t pack) {
    const int64_t full = shard * world;
    return 2 * alloc_bytes(full * 4, r) + alloc_bytes(shard * 4, r) +
           (compute != DType::F32 ? alloc_bytes(full * int64_t(dtype_size(compute)), r) : 0) +
           (compute != DType::F32 && pack > 0 ? alloc_bytes(pack * world * 4, r) : 0) +
           (reduce == DType::BF16 ? alloc_bytes(full * 2, r) + alloc_bytes(shard * 2, r) : 0);
  };
  int64_t n = 0, max_shard = 0, max_pack = 0;
  for (size_t i = 0; i < ps.units().size(); ++i) {
    const UnitDesc& u = ps.units()[i];
    const int64_t shard = ceil_div(u.numel(), world);
    const int64_t pack = compute != DType::F32 ? parallel::zero3_f32_pack(ps, int(i), world) : 0;
    if (u.root) {
      n += slot(shard, pack);
    } else {
      max_shard = std::max(max_shard, shard);
      max_pack = std::max(max_pack, pack);
    }
  }
  if (max_shard > 0) n += 2 * slot(max_shard, max_pack);
  return n;
}

StateBytes predict_state(const ParamStore& ps, const Config& cfg, int zero, int world, AllocRounding r,
                         int shard_group) {
  DTRAIN_CHECK(world >= 1 && zero >= 0 && zero <= 3, "predict_state: zero {} on {} ranks", zero, world);
  if (shard_group <= 0) shard_group = world;
  DTRAIN_CHECK(world % shard_group == 0, "predict_state: shard group {} of {} ranks", shard_group, world);
  auto A = [r](int64_t n) { return alloc_bytes(n, r); };
  const DType compute = compute_dtype_of(cfg.precision.dtype);
  const int64_t P = ps.num_params();
  const int states = optimizer_states(cfg);
  const bool dp = world > 1;  // one process: no DataParallel (parallel.zero has no effect)
  StateBytes b;
  b.buffers = A(ps.num_buffer_elements() * 4);  // ParamStore::finalize
  if (dp && zero == 3) {
    // ParamStore::finalize, sharded over the shard group (session/session.cpp: hybrid sharding
    // shards over S ranks): the rank's pieces of every unit (no 16-bit copy: the windows hold
    // it); the optimizer's state has the shard buffers' layout. The replicate all-reduce
    // works in place in the windows' reduced shards.
    const int64_t shard = zero3_shard_elements(ps, shard_group);
    b.params = A(shard * 4);
    b.grads = A(shard * 4);
    b.optimizer = states * A(shard * 4);
    b.comm = zero3_window_bytes(ps, shard_group, compute, r,
                                cfg.parallel.reduce_dtype == "bf16" ? DType::BF16 : DType::F32);
    b.small += A(4);  // Zero3::norm_buf_
  } else {
    b.params = A(P * 4);
    b.grads = A(P * 4);
    if (compute != DType::F32) b.compute_copy = A(P * int64_t(dtype_size(compute)));
    int64_t local = P;
    if (dp && zero > 0) {
      // parallel/zero.cpp: rank 0's shard_range [0, min(P, s)), s = ceil(P / world); the
      // sharder's padded buffer [world * s] and shard [s] (stage 1 all-gathers the
      // parameters through them, stage 2 also reduce-scatters the gradients)
      const int64_t s = ceil_div(P, world);
      local = std::min(P, s);
      b.comm = A(s * world * 4) + A(s * 4);
      b.small += A(4);  // ZeroSharder::norm_buf_
    }
    b.optimizer = states * A(local * 4);
  }
  if (cfg.parallel.offload == "optimizer") {
    // optim/offload.cpp: the state moves to the host with the master copy and the gradient
    // staging of the same elements (Backend::alloc_host, unrounded here)
    const int64_t elems = dp && zero == 3 ? zero3_shard_elements(ps, shard_group)
                          : dp && zero > 0 ? std::min(P, ceil_div(P, world))
                                           : P;
    b.host = (states + 2) * elems * 4;
    b.optimizer = 0;
  }
  if (dp) b.small += A(4 * 4);  // DataParallel::flags_
  // Runtime::loss_slot: one f64 per micro-batch, at least 8
  b.small += A(std::max<int64_t>(cfg.train.grad_accum, 8) * 8);
  return b;
}

MemoryPlan make_memory_plan(const ParamStore& ps, const Config& cfg, int world, const std::string& device,
                            const std::vector<ActivationProfile>& profiles, const ParamStore* frozen) {
  DTRAIN_CHECK(device == "cpu" || device == "cuda", "make_memory_plan: device '{}'", device);
  const AllocRounding r = device == "cuda" ? AllocRounding::Cuda : AllocRounding::Cpu;
  MemoryPlan p;
  p.recipe = cfg.source();
  p.model = cfg.model.kind;
  p.optimizer = cfg.optim.name;
  p.precision = cfg.precision.dtype;
  p.device = device;
  p.world = world;
  p.num_params = ps.num_params();
  p.frozen_params = frozen ? frozen->num_params() : 0;
  p.units = int(ps.units().size());
  p.root_units = int(std::count_if(ps.units().begin(), ps.units().end(), [](const UnitDesc& u) { return u.root; }));
  p.batch = cfg.train.batch_size;
  p.grad_accum = cfg.train.grad_accum;
  p.eval_batch = cfg.eval.batch_size;
  p.profiles = profiles;
  // synthetic data keeps one staged batch per micro-batch stream; loaders stage into one buffer pair
  const int64_t copies = cfg.data.kind == "synthetic" ? p.grad_accum : 1;
  int shard_group = world;  // parallel.shard_group_size for the ZeRO-3 rows
  if (world > 1) {
    Config z3 = cfg;
    z3.assign(z3.parallel.zero, 3);
    shard_group = resolve_shard_group_size(z3, world);
  }
  std::vector<int> stages;
  if (world == 1)
    stages = {-1};
  else
    stages = {0, 1, 2, 3};
  for (int zero : stages)
    for (const ActivationProfile& a : profiles) {
      DTRAIN_CHECK(a.batch >= 1, "activation profile at batch {}", a.batch);
      PlanRow row;
      row.zero = zero;
      row.recompute = a.recompute;
      row.shard_group = zero == 3 ? shard_group : 0;
      row.state = predict_state(ps, cfg, std::max(zero, 0), world, r, row.shard_group);
      if (frozen) {  // ParamStore::finalize of a frozen store: the f32 weights and the 16-bit copy, no gradients
        const DType compute = compute_dtype_of(cfg.precision.dtype);
        row.state.frozen = alloc_bytes(frozen->num_params() * 4, r);
        if (compute != DType::F32) row.state.frozen += alloc_bytes(frozen->num_params() * int64_t(dtype_size(compute)), r);
      }
      auto scale = [&](int64_t bytes, int64_t batch) { return int64_t(std::llround(double(bytes) * double(batch) / double(a.batch))); };
      const int64_t kept = scale(a.train_high_water, p.batch);
      row.scratch_activations = scale(a.scratch_high_water, p.batch);
      row.activations = kept + row.scratch_activations;
      row.eval_activations = scale(a.eval_high_water, p.eval_batch);
      // the first step (both arenas grow), then an evaluation (the step's arena alone grows)
      const ArenaBlocks step = arena_blocks({kept, row.eval_activations}, r);
      const ArenaBlocks scratch = arena_blocks({row.scratch_activations}, r);
      row.arena = std::max(step.peaks[0] + scratch.peaks[0], step.peaks[1] + scratch.steady);
      row.arena_steady = step.steady + scratch.steady;
      row.inputs = copies * (alloc_bytes(scale(a.input_bytes, p.batch), r) + alloc_bytes(scale(a.label_bytes, p.batch), r));
      p.rows.push_back(row);
    }
  return p;
}

namespace {

std::string mib(int64_t b) { return b ? fmt::format("{:.2f}", double(b) / double(kMiB)) : "-"; }

std::string layout_name(const PlanRow& r, int world) {
  if (r.zero < 0) return "1 process";
  if (r.zero == 0) return "zero 0 (DDP)";
  if (r.zero == 3 && r.shard_group > 0 && r.shard_group < world) return fmt::format("zero 3 (S={})", r.shard_group);
  return fmt::format("zero {}", r.zero);
}

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

}  // namespace

std::string memory_plan_table(const MemoryPlan& p) {
  const bool mixed = p.precision != "fp32";
  bool recompute = false, measured = false, eval = false, offload = false, frozen = false;
  for (const PlanRow& r : p.rows) {
    offload |= r.state.host > 0;
    frozen |= r.state.frozen > 0;
    recompute |= !r.recompute.empty();
    measured |= r.measured >= 0;
    eval |= r.eval_activations > 0;
  }
  std::string out = fmt::format(
      "memory plan{} {} | {} | {} {}parameters in {} units ({} root){} | {} | {} | {} {} | batch {} per rank x accum {}\n",
      p.title.empty() ? "" : " (" + p.title + ")", p.recipe, p.model, p.num_params, frozen ? "trainable " : "", p.units,
      p.root_units, frozen ? fmt::format(" + {} frozen", p.frozen_params) : "", p.optimizer, p.precision, p.world,
      p.world == 1 ? "process" : "ranks", p.batch, p.grad_accum);
  out += fmt::format("predicted bytes per rank ({} allocator), MiB:\n\n", p.device);
  std::string head = fmt::format("{:<13}", "layout");
  if (recompute) head += fmt::format(" {:<10}", "recompute");
  if (frozen) head += fmt::format(" {:>9}", "frozen");
  head += fmt::format(" {:>9}", "params");
  if (mixed) head += fmt::format(" {:>9}", p.precision);
  head += fmt::format(" {:>9} {:>9} {:>9} {:>11} {:>9} {:>8} {:>10} {:>15}", "grads", "optimizer", "comm", "activations",
                      "arena", "other", "total", "total bytes");
  if (offload) head += fmt::format(" {:>9}", "host");
  if (measured) head += fmt::format(" {:>10} {:>7}", "measured", "error");
  out += head + "\n";
  for (const PlanRow& r : p.rows) {
    std::string line = fmt::format("{:<13}", layout_name(r, p.world));
    if (recompute) line += fmt::format(" {:<10}", r.recompute);
    if (frozen) line += fmt::format(" {:>9}", mib(r.state.frozen));
    line += fmt::format(" {:>9}", mib(r.state.params + r.state.buffers));
    if (mixed) line += fmt::format(" {:>9}", mib(r.state.compute_copy));
    line += fmt::format(" {:>9} {:>9} {:>9} {:>11} {:>9} {:>8} {:>10} {:>15}", mib(r.state.grads), mib(r.state.optimizer),
                        mib(r.state.comm), mib(r.activations), mib(r.arena),
                        mib(r.state.small + r.inputs), mib(r.total()), with_commas(r.total()));
    if (offload) line += fmt::format(" {:>9}", mib(r.state.host));
    if (r.measured >= 0)
      line += fmt::format(" {:>10} {:>+6.2f}%", mib(r.measured),
                          r.measured ? 100.0 * double(r.total() - r.measured) / double(r.measured) : 0.0);
    out += line + "\n";
  }
  out += "\n";
  for (const ActivationProfile& a : p.profiles)
    out += fmt::format("measured at batch {} on the CPU{}: step {} bytes{}{}\n", a.batch,
                       a.recompute.empty() ? "" : " (recompute " + a.recompute + ")", with_commas(a.train_high_water),
                       a.scratch_high_water ? fmt::format(" + recompute scratch {} bytes", with_commas(a.scratch_high_water))
                                            : "",
                       a.eval_high_water ? fmt::format("; evaluation {} bytes", with_commas(a.eval_high_water)) : "");
  if (frozen)
    out += "  frozen: lora.enabled's base model, f32 (and its 16-bit copy under mixed precision): no gradients, no\n"
           "  optimizer state, replicated on every data rank; params, grads, optimizer and comm are the adapters'.\n";
  out += "  params: f32 weights and BatchNorm running statistics (ZeRO-3: the rank's shard of every unit);\n";
  if (mixed)
    out += fmt::format("  {}: the 16-bit copy the layers compute on (ZeRO-3: cast into the windows instead);\n",
                       p.precision);
  out +=
      "  comm: ZeRO-1/2's padded all-gather / reduce-scatter buffer and shard, ZeRO-3's windows (two of the largest\n"
      "  unit, one per root unit: parameters, gradients, reduced shard); other: the staged input batch, loss slots\n"
      "  and flags. Rank 0 shown (ZeRO-1/2's last rank may own less).\n";
  if (offload)
    out += "  host: parallel.offload = \"optimizer\": the optimizer state (so none on the device), the f32 master\n"
           "  copy and the gradient staging of the rank's elements in host memory (pinned on CUDA), not in total.\n";
  for (const PlanRow& r : p.rows)
    if (r.zero == 3 && r.shard_group > 0 && r.shard_group < p.world) {
      out += fmt::format("  zero 3 (S={0}): hybrid sharding (parallel.shard_group_size = {0}): sharded over {0} ranks, "
                         "{1} replicas.\n",
                         r.shard_group, p.world / r.shard_group);
      break;
    }
  if (p.device == "cpu")
    out += "  CPU blocks above glibc's mmap threshold are counted with their page slack (up to 4 KiB each, less\n"
           "  where glibc places them on its heap).\n";
  out += fmt::format(
      "  activations: the arenas' high-water marks of one real forward + backward at batch {} on the CPU, scaled\n"
      "  linearly to batch {} per rank{}.\n"
      "  arena: the peak of the blocks the arenas take for those marks (a first block of 64 MiB, more of the last\n"
      "  one's size while a pass outgrows them, then one block of the mark; train.recompute adds a scratch arena);\n"
      "  a tensor that does not fit a block's rest can cost one block more. On CUDA, kernels may keep other tensors\n"
      "  than the CPU's and workspaces (cuBLAS, cuDNN) are not counted; neither are Gloo/NCCL buffers nor host memory.\n",
      p.profiles.empty() ? 1 : p.profiles.front().batch, p.batch,
      eval ? fmt::format(" (evaluation, after the first step: one forward-only batch scaled to eval.batch_size {})",
                         p.eval_batch)
           : "");
  if (measured)
    out += "  measured: the peak bytes rank 0 allocated through its backend over one training step and one evaluation\n"
           "  batch on the CPU (ranks as threads over Gloo); error = (predicted - measured) / measured.\n";
  return out;
}

nlohmann::json memory_plan_json(const MemoryPlan& p) {
  nlohmann::json rows = nlohmann::json::array();
  for (const PlanRow& r : p.rows) {
    nlohmann::json j = {{"layout", r.zero < 0 ? "single" : "zero" + std::to_string(r.zero)},
                        {"zero", r.zero < 0 ? nlohmann::json(nullptr) : nlohmann::json(r.zero)},
                        {"shard_group_size", r.zero == 3 ? nlohmann::json(r.shard_group) : nlohmann::json(nullptr)},
                        {"parameters", r.state.params},
                        {"compute_copy", r.state.compute_copy},
                        {"buffers", r.state.buffers},
                        {"gradients", r.state.grads},
                        {"optimizer_state", r.state.optimizer},
                        {"offload_host", r.state.host},
                        {"frozen", r.state.frozen},
                        {"comm", r.state.comm},
                        {"small", r.state.small},
                        {"activations", r.activations},
                        {"scratch_activations", r.scratch_activations},
                        {"eval_activations", r.eval_activations},
                        {"arena", r.arena},
                        {"arena_steady", r.arena_steady},
                        {"inputs", r.inputs},
                        {"total", r.total()}};
    if (!r.recompute.empty()) j["recompute"] = r.recompute;
    if (r.measured >= 0) {
      j["measured_peak"] = r.measured;
      j["relative_error"] = r.measured ? double(r.total() - r.measured) / double(r.measured) : 0.0;
    }
    rows.push_back(j);
  }
  nlohmann::json profiles = nlohmann::json::array();
  for (const ActivationProfile& a : p.profiles)
    profiles.push_back({{"recompute", a.recompute},
                        {"batch", a.batch},
                        {"train_high_water", a.train_high_water},
                        {"scratch_high_water", a.scratch_high_water},
                        {"eval_high_water", a.eval_high_water},
                        {"input_bytes", a.input_bytes},
                        {"label_bytes", a.label_bytes}});
  return {{"title", p.title},
          {"frozen_params", p.frozen_params},
          {"recipe", p.recipe},
          {"model", p.model},
          {"optimizer", p.optimizer},
          {"precision", p.precision},
          {"device", p.device},
          {"world_size", p.world},
          {"num_params", p.num_params},
          {"units", p.units},
          {"root_units", p.root_units},
          {"batch_size", p.batch},
          {"grad_accum", p.grad_accum},
          {"eval_batch_size", p.eval_batch},
          {"activation_profiles", profiles},
          {"rows", rows}};
}

}  // namespace dtrain

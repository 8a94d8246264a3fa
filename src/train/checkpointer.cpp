#include "train/checkpointer.h"

#include <chrono>
#include <functional>

#include "core/clock.h"
#include "core/log.h"
#include "checkpoint/dist_checkpoint.h"
#include "checkpoint/flat_shards.h"
#include "checkpoint/pipeline_ckpt.h"
#include "checkpoint/train_state.h"

namespace dtrain {

void Checkpointer::failed(int64_t step, const Error& e) {
  if (!run_) return;
  reg_.add_checkpoint_failure();
  reg_.publish();
  run_->event("checkpoint_failed", {{"step", step}, {"error", e.what()}});
}

void Checkpointer::done(const std::string& path, uint64_t bytes, double secs, const std::string& why,
                        double blocked_s) {
  if (!run_) return;
  reg_.add_checkpoint(secs);
  nlohmann::json ev = {{"step", CheckpointManager::step_of(path)}, {"path", path}, {"bytes", bytes},
                       {"seconds", secs}, {"reason", why}};
  if (blocked_s >= 0) {
    ev["async"] = true;
    ev["blocked_seconds"] = blocked_s;
    log::info("checkpoint {} ({:.1f} MB, {:.2f}s, {:.2f}s of it blocking training, {}, async)", path,
              double(bytes) / 1e6, secs, blocked_s, why);
  } else {
    log::info("checkpoint {} ({:.1f} MB, {:.2f}s, {})", path, double(bytes) / 1e6, secs, why);
  }
  run_->event("checkpoint", ev);
}

void Checkpointer::finish_async(bool wait) {
  if (!ac_.pending()) return;
  const int64_t step = ac_.step();
  try {
    if (auto c = ac_.poll(wait)) done(c->path, c->bytes, c->seconds, "periodic", c->blocked_s);
  } catch (const Error& e) {
    failed(step, e);
    throw;
  }
}

void Checkpointer::save(const TrainState& st, const std::string& why) {
  finish_async(true);
  const auto t0 = Clock::now();
  const int keep_last = int(s_.cfg.checkpoint.keep_last);
  const bool async = why == "periodic" && s_.cfg.checkpoint.async;
  uint64_t bytes = 0;
  std::string path;
  try {
    if (!d_ && async) {
      const std::string tmp = cm_.begin(st.step);
      bytes = write_checkpoint_files(s_, st, tmp);
      ac_.start(cm_, st.step, tmp, keep_last, bytes, t0, seconds_since(t0));
      return;  // reported by finish_async once committed
    }
    if (d_ && d_->pp_comm) {
      // pipeline: every stage's parts gathered into the one-process layout on rank 0, which
      // writes the one model file and the one optimizer file (collective over every rank)
      const PipelineCheckpoint pc = pipeline_gather_checkpoint(s_, s_.opt.get(), *d_->dp, d_->tp_comm.get());
      std::function<void(const std::string&, uint64_t)> later;
      if (async)
        later = [&](const std::string& tmp, uint64_t b) {
          ac_.start(cm_, st.step, tmp, keep_last, b, t0, seconds_since(t0));
        };
      DistSaveResult res = save_checkpoint_collective(
          *d_, cm_, st.step, keep_last, "", nullptr,
          [&](const std::string& dir) {
            CheckpointParts parts;
            parts.world_size = s_.world;
            parts.pp = &pc;
            return write_checkpoint_files(s_, st, dir, parts);
          },
          later);
      if (async) return;
      path = res.path;
      bytes = res.bytes;
    } else if (d_) {
      // ZeRO-3: each rank of the (first) shard group writes its pieces of the parameters beside
      // its optimizer shard; nobody gathers the model (checkpoint/flat_shards.h).
      // Tensor parallel: the ranks' parts and optimizer state (ZeRO: the data ranks' pieces
      // put together first) into the universal layout (collective over each tp and the dp
      // group; rank 0 writes them, as one process would).
      const bool tp = d_->tp != nullptr;
      const bool sharded = s_.opt && d_->zero_stage > 0 && !tp;
      // (shard groups of 1 hold the whole model: rank 0 writes it as model.safetensors; so does
      // LoRA, whose small adapters are gathered for PEFT's adapter_model.safetensors anyway)
      const bool lora = s_.cfg.lora.enabled;
      const bool model_shards = s_.params.sharded() && !tp && s_.params.shard_world() > 1 && !lora;
      std::vector<float> full;
      if (tp)
        full = s_.params.sharded() ? parallel::tp_gather_universal(*d_->tp_comm, s_.params, d_->dp->gather_full_params())
                                   : parallel::tp_gather_params(*d_->tp_comm, s_.params);
      else if (s_.params.sharded() && !model_shards)  // one rank's pieces are every unit whole, in order
        full = s_.params.shard_world() > 1 ? d_->dp->gather_full_params() : s_.params.shard_values();
      std::vector<ParamStore::Exported> optim_universal;
      if (tp && s_.opt)
        optim_universal = parallel::tp_gather_state(*d_->tp_comm, s_.params,
                                                    local_optimizer_state(*s_.opt, s_.params, d_->dp->state_comm()));
      // ZeRO-3 shards over the shard group (hybrid sharding: its S ranks; the replicas hold the
      // same shards, so only the first group, global ranks 0..S-1, writes them); ZeRO-1/2 over all
      const int shards = !sharded ? 1 : s_.params.sharded() ? s_.params.shard_world() : s_.world;
      const int rank = d_->env.rank;
      const bool writes = shards > 1 && rank < shards;  // one file: rank 0's write_checkpoint_files
      const bool writes_model = model_shards && rank < s_.params.shard_world();
      // PowerSGD: each rank's own error feedback and Q, a file per data-parallel rank
      const bool psgd = d_->compression.kind == parallel::GradCompression::PowerSGD;
      const int dr = d_->comm->rank(), dw = d_->comm->size();
      std::vector<std::string> names;
      if (writes_model) names.push_back(flat_shard_name(FlatKind::Model, rank, s_.params.shard_world()));
      if (writes) names.push_back(flat_shard_name(FlatKind::Optimizer, rank, shards));
      if (psgd) names.push_back(powersgd_state_name(dr, dw));
      std::string my_files;
      for (const std::string& n : names) my_files += (my_files.empty() ? "" : " and ") + n;
      std::function<uint64_t(const std::string&)> mine;
      if (!names.empty())
        mine = [&](const std::string& dir) {
          uint64_t b = writes_model ? write_model_shard(s_.params, st.step, dir, rank, s_.params.shard_world()) : 0;
          if (writes) b += write_optim_shard(*s_.opt, s_.params, st.step, dir, rank, shards);
          if (psgd) b += write_powersgd_state(d_->dp->compression_state(), st.step, dir, dr, dw);
          return b;
        };
      std::function<void(const std::string&, uint64_t)> later;
      if (async)  // every rank's files are written; rank 0 commits them on its background thread
        later = [&](const std::string& tmp, uint64_t b) {
          ac_.start(cm_, st.step, tmp, keep_last, b, t0, seconds_since(t0));
        };
      DistSaveResult res = save_checkpoint_collective(
          *d_, cm_, st.step, keep_last, my_files, mine,
          [&](const std::string& dir) {
            CheckpointParts parts;
            parts.world_size = s_.world;
            parts.optim_shards = shards;
            parts.model_shards = model_shards ? s_.params.shard_world() : 0;
            parts.full_params = tp || (s_.params.sharded() && !model_shards) ? &full : nullptr;
            parts.optim_universal = tp && s_.opt ? &optim_universal : nullptr;
            return write_checkpoint_files(s_, st, dir, parts);
          },
          later);
      if (async) return;  // reported by finish_async once committed (rank 0)
      path = res.path;
      bytes = res.bytes;
    } else {
      path = cm_.save(st.step, [&](const std::string& dir) { bytes = write_checkpoint_files(s_, st, dir); }, keep_last);
    }
  } catch (const Error& e) {
    failed(st.step, e);
    throw;
  }
  done(path, bytes, seconds_since(t0), why);
}

}  // namespace dtrain

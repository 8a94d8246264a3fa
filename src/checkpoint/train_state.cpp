#include "checkpoint/train_state.h"

#include <algorithm>
#include <cstring>
#include <map>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <set>

#include "core/fsutil.h"
#include "data/tokenizer.h"
#include "models/gpt.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/flat_shards.h"
#include "checkpoint/hf_config.h"
#include "checkpoint/init_from.h"
#include "checkpoint/lora_files.h"
#include "checkpoint/model_tensors.h"
#include "session/pipeline.h"
#include "checkpoint/pipeline_ckpt.h"
#include "checkpoint/safetensors.h"
#include "session/task.h"

namespace dtrain {

namespace {

const char* kModelFile = "model.safetensors";

// Hugging Face's GPT2Config for a GPT checkpoint, so that
// transformers.GPT2LMHeadModel.from_pretrained(<checkpoint dir>) loads model.safetensors as it
// is: GPT-2's tanh GELU ("gelu_new"), LayerNorm eps 1e-5, the LM head tied to wte, no dropout
// (dtrain trains without it). <|endoftext|> is named only for GPT-2's own vocabulary.
// The tokenizer files of the token shards (dtrain data tokenize copies them beside them) or of
// an imported model (Session::vocab_dir), as Hugging Face names them: GPT-2's vocab.json +
// merges.txt, tokenizer.json, tokenizer_config.json, so AutoTokenizer.from_pretrained(<dir>) and
// `dtrain sample` find them. Returns the bytes copied (0 when there is none).
uint64_t copy_gpt2_vocab(const Session& s, const std::string& dir) {
  if (s.vocab_dir.empty() && s.cfg.data.kind != "tokens" && s.cfg.data.kind != "sft") return 0;
  uint64_t bytes = 0;
  for (const TokenizerFile& f : tokenizer_files(s.vocab_dir.empty() ? s.cfg.data.path : s.vocab_dir)) {
    const std::string data = fs::read_file(f.src);
    fs::write_file(dir + "/" + f.name, data);
    bytes += data.size();
  }
  return bytes;
}

std::string hf_gpt2_config(const GptSpec& g) {
  nlohmann::ordered_json j = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", g.vocab_size},
      {"n_positions", g.block_size},
      {"n_ctx", g.block_size},
      {"n_embd", g.n_embd},
      {"n_layer", g.n_layer},
      {"n_head", g.n_head},
      {"n_inner", nullptr},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5},
      {"resid_pdrop", 0.0},
      {"embd_pdrop", 0.0},
      {"attn_pdrop", 0.0},
      {"initializer_range", 0.02},
      {"scale_attn_weights", true},
      {"tie_word_embeddings", true},
      {"torch_dtype", "float32"},
  };
  if (g.vocab_size == 50257) {
    j["bos_token_id"] = 50256;
    j["eos_token_id"] = 50256;
  }
  return j.dump(2) + "\n";
}

void load_into_params(Session& s, const std::string& dir) {
  ModelTensors mt(dir);
  const std::string& origin = mt.origin();
  // Names the model does not have mean the checkpoint is of another model (a pipeline stage:
  // names the full model does not have).
  std::set<std::string> expected;
  for (const auto& e : (s.pipe ? s.pipe->full_layout() : s.params).state_entries()) expected.insert(e.name);
  for (const auto& n : mt.names())
    if (!expected.count(n))
      user_error("{}: tensor '{}' does not exist in this model (checkpoint of a different model?)", origin, n);
  // ZeRO-3 from ZeRO-3 shards of the same layout: this rank reads its own pieces and no more
  if (mt.sharded() && s.params.sharded() && s.params.tp_size() == 1 && !s.pipe &&
      mt.shards()->layout() == s.params.layout_hash()) {
    const FlatShards& fs = *mt.shards();
    s.params.import_shard([&](int64_t b, int64_t e, float* dst) { fs.read_into("params", b, e, dst); }, mt.lookup(),
                          origin);
    return;
  }
  s.params.import_state(mt.lookup(), origin);
}

// The optimizer's range [begin, end) of the flat state, assembled from the shard files that
// overlap it (a checkpoint of N ranks loads on M, with or without ZeRO).
void load_optimizer(Session& s, const std::string& dir, int expected_shards) {
  FlatShards shards(dir, FlatKind::Optimizer, expected_shards);  // validates every file first
  if (shards.count() == 0)
    user_error("{}: no optimizer state (expected {} or a set of optim-<i>-of-<N>.safetensors shards)", dir,
               flat_shard_name(FlatKind::Optimizer, 0, 1));
  const std::string origin = shards.origin();
  if (shards.kind() != s.opt->kind())
    user_error("{}: optimizer state of '{}' but the recipe uses optim.name = \"{}\"", origin, shards.kind(),
               s.opt->kind());
  const ParamStore& layout = s.pipe ? s.pipe->full_layout() : s.params;  // the universal one
  if (shards.num_params() != layout.universal_num_params())
    user_error("{}: state for {} parameters but this model has {} (checkpoint of a different model?)", origin,
               shards.num_params(), layout.universal_num_params());
  if (!shards.layout().empty() && shards.layout() != layout.layout_hash())
    user_error("{}: parameter layout {} differs from this model's {} (checkpoint of a different model?)", origin,
               shards.layout().substr(0, 12), layout.layout_hash().substr(0, 12));
  std::map<std::string, std::vector<uint8_t>> loaded;  // alive until import_state returns
  int64_t step = shards.step();
  TensorLookup lookup = [&](const std::string& name) -> std::optional<ImportTensor> {
    if (name == "step") return ImportTensor{"I64", {}, reinterpret_cast<const uint8_t*>(&step), 8};
    const auto& names = shards.state_names();
    if (std::find(names.begin(), names.end(), name) == names.end()) return std::nullopt;
    auto [it, fresh] = loaded.try_emplace(name);
    if (fresh && (s.pipe || s.params.tp_size() > 1)) {
      // model parallel: the stage's part (pipeline), this rank's tensor-parallel part, then
      // the optimizer's range of that local layout (ZeRO-1/2)
      const std::vector<uint8_t> all = shards.read(name, 0, shards.num_params());
      std::vector<float> local(all.size() / 4);
      std::memcpy(local.data(), all.data(), local.size() * 4);
      if (s.pipe) local = s.pipe->stage_slice(local);
      if (s.params.tp_size() > 1) local = s.params.tp_slice(local);
      for (const FlatPiece& p : s.opt->pieces()) {
        const auto* b = reinterpret_cast<const uint8_t*>(local.data() + p.global);
        it->second.insert(it->second.end(), b, b + p.count * 4);
      }
    } else if (fresh)  // the optimizer's pieces (one range, or one per ZeRO-3 unit), back to back
      for (const FlatPiece& p : s.opt->pieces()) {
        std::vector<uint8_t> part = shards.read(name, p.global, p.global + p.count);
        it->second.insert(it->second.end(), part.begin(), part.end());
      }
    return ImportTensor{"F32", {s.opt->owned()}, it->second.data(), it->second.size()};
  };
  s.opt->import_state(lookup, origin);
}

}  // namespace

std::vector<int> job_cpu_threads(const Session& s) {
  const std::vector<int>& v = s.rank_cpu_threads;
  if (v.empty()) return s.cpu_threads > 0 ? std::vector<int>{s.cpu_threads} : std::vector<int>{};
  if (std::all_of(v.begin(), v.end(), [&](int t) { return t == v.front(); }))
    return v.front() > 0 ? std::vector<int>{v.front()} : std::vector<int>{};  // 0: CUDA ranks
  return v;
}

std::string describe_cpu_threads(const std::vector<int>& t) {
  if (t.size() == 1) return fmt::format("{} CPU thread{} per rank", t[0], t[0] == 1 ? "" : "s");
  return fmt::format("per rank {} CPU threads", fmt::join(t, ", "));
}

uint64_t write_checkpoint_files(Session& s, const TrainState& st, const std::string& dir, const CheckpointParts& parts) {
  uint64_t bytes = 0;
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"producer", "dtrain " DTRAIN_VERSION},
                                             {"step", std::to_string(st.step)}};
  const PipelineCheckpoint* pp = parts.pp;
  if (parts.model_shards == 0) {
    const std::vector<ParamStore::Exported> model = pp ? pp->model : s.params.export_state(parts.full_params);
    bytes += write_exported(dir + "/" + kModelFile, model, meta);
    // LoRA: the trainable store is the adapters; PEFT's files beside (checkpoint/lora_files.h)
    if (s.cfg.lora.enabled) bytes += write_lora_adapter(s.cfg, model, dir);
  }
  if (s.opt && pp)
    bytes += write_optim_universal(s.opt->kind(), pp->optim, *pp->layout, st.step, dir);
  else if (s.opt && parts.optim_universal)
    bytes += write_optim_universal(s.opt->kind(), *parts.optim_universal, s.params, st.step, dir);
  else if (s.opt && parts.optim_shards == 1)
    bytes += write_optim_shard(*s.opt, s.params, st.step, dir, 0, 1);
  nlohmann::json data = {{"epoch", st.loader.epoch}, {"batch_in_epoch", st.loader.batch_in_epoch},
                         {"batch_size", s.cfg.train.batch_size},
                         {"grad_accum", s.cfg.train.grad_accum},
                         {"global_batch", s.cfg.train.batch_size * s.cfg.train.grad_accum * s.world}};
  if (s.task && s.task->token_stream()) data["position"] = st.position;
  nlohmann::json j = {
      {"step", st.step},
      {"epoch", double(st.step) / double(std::max<int64_t>(1, s.steps_per_epoch))},
      {"data", data},
      {"rng", {{"seed", s.cfg.run.seed}, {"kind", "philox4x32-10"}}},
      {"schedule", {{"kind", s.cfg.schedule.kind}, {"total_steps", s.total_steps},
                    {"lr", s.schedule ? s.schedule->lr(st.step) : 0.0}}},
      {"loss_scale", s.scaler.enabled() ? nlohmann::json{{"scale", s.scaler.state().scale},
                                                          {"good_steps", s.scaler.state().good_steps},
                                                          {"skipped_steps", s.scaler.state().skipped_steps}}
                                        : nlohmann::json(nullptr)},
      {"world_size", parts.world_size},
      {"optimizer", s.opt ? nlohmann::json{{"kind", s.opt->kind()}, {"shards", parts.optim_shards}}
                          : nlohmann::json(nullptr)},
      {"wall_time_s", st.wall_time_s},
      {"config_hash", s.cfg.hash()},
      {"model", {{"kind", s.cfg.model.kind},
                 {"num_params", pp ? pp->layout->universal_num_params() : s.params.universal_num_params()}}},
      {"dtrain_version", DTRAIN_VERSION},
  };
  if (parts.model_shards > 0) j["model"]["shards"] = parts.model_shards;
  // the numerics depend on it (reductions split by thread): a resume compares
  const std::vector<int> threads = job_cpu_threads(s);
  j["cpu_threads"] = threads.empty() ? nlohmann::json(nullptr) : nlohmann::json(threads[0]);
  if (threads.size() > 1) j["cpu_threads_per_rank"] = threads;
  std::string state = j.dump(2) + "\n";
  fs::write_file(dir + "/state.json", state);
  std::string recipe = s.cfg.to_toml();
  fs::write_file(dir + "/config.toml", recipe);
  bytes += state.size() + recipe.size();
  if (s.cfg.model.kind == "gpt") {
    if (!s.cfg.lora.enabled) {  // a LoRA checkpoint is an adapter, not a model: no config.json
      const GptSpec spec = gpt_spec_from(s.cfg);
      const std::string hf = spec.family == "llama" ? hf_llama_config(spec) : hf_gpt2_config(spec);
      fs::write_file(dir + "/config.json", hf);
      bytes += hf.size();
    }
    bytes += copy_gpt2_vocab(s, dir);
  }
  return bytes;
}

void load_model_weights(Session& s, const std::string& dir) {
  // LoRA: the checkpoint holds the adapters; the frozen model is its recipe's model.init_from
  if (s.base) init_model_from(s, s.cfg.model.init_from, s.cfg.model.init_strict);
  load_into_params(s, dir);
}

TrainState load_checkpoint(Session& s, const std::string& dir) {
  TrainState st;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(fs::read_file(dir + "/state.json"));
    st.step = j.at("step").get<int64_t>();
    st.loader.epoch = j.at("data").at("epoch").get<int64_t>();
    st.loader.batch_in_epoch = j.at("data").at("batch_in_epoch").get<int64_t>();
    st.wall_time_s = j.value("wall_time_s", 0.0);
    st.position = j.at("data").value("position", uint64_t(0));
    if (j.contains("cpu_threads_per_rank"))
      st.written_cpu_threads = j["cpu_threads_per_rank"].get<std::vector<int>>();
    else if (j.contains("cpu_threads") && !j["cpu_threads"].is_null())
      st.written_cpu_threads = {j["cpu_threads"].get<int>()};
  } catch (const nlohmann::json::exception& e) {
    user_error("{}/state.json: {}", dir, e.what());
  }
  int64_t saved_world = 1, saved_batch = s.cfg.train.batch_size;
  int expected_shards = -1;
  try {
    saved_world = j.value("world_size", int64_t(1));
    saved_batch = j.at("data").value("batch_size", saved_batch);
    if (j.contains("optimizer") && j["optimizer"].is_object()) expected_shards = j["optimizer"].at("shards").get<int>();
  } catch (const nlohmann::json::exception& e) {
    user_error("{}/state.json: {}", dir, e.what());
  }
  if (saved_world < 1 || saved_batch < 1)
    user_error("{}/state.json: world_size {} / data.batch_size {}: expected positive integers", dir, saved_world,
               saved_batch);
  load_into_params(s, dir);  // (LoRA: the trainer read the frozen model from model.init_from)
  if (s.opt) load_optimizer(s, dir, expected_shards);
  const int64_t batch = s.cfg.train.batch_size;
  if (saved_world != s.world || saved_batch != batch) {
    // same global sample position in the epoch's permutation, in the new batch geometry
    const int64_t pos = st.loader.batch_in_epoch * saved_batch * saved_world;
    const int64_t global_batch = batch * s.world;
    st.loader.batch_in_epoch = pos / global_batch;
    const int64_t bpe = s.task ? s.task->batches_per_epoch() : 0;
    if (bpe > 0 && !s.task->token_stream() && st.loader.batch_in_epoch >= bpe) {
      st.loader.epoch++;
      st.loader.batch_in_epoch = 0;
    }
  }
  // fp16 loss scale: continue with the saved one (a checkpoint without one, e.g. from an fp32
  // or bf16 run, keeps the recipe's initial scale)
  if (s.scaler.enabled() && j.contains("loss_scale") && j["loss_scale"].is_object()) {
    LossScalerState ls;
    try {
      ls.scale = j["loss_scale"].at("scale").get<double>();
      ls.good_steps = j["loss_scale"].at("good_steps").get<int64_t>();
      ls.skipped_steps = j["loss_scale"].at("skipped_steps").get<int64_t>();
    } catch (const nlohmann::json::exception& e) {
      user_error("{}/state.json: loss_scale: {}", dir, e.what());
    }
    try {
      s.scaler.restore(ls);
    } catch (const UserError& e) {
      user_error("{}/state.json: {}", dir, e.what());
    }
  }
  if (s.task) s.task->restore_data(st.loader, st.position);
  return st;
}

CheckpointBatch checkpoint_batch(const std::string& dir, int64_t grad_accum) {
  if (dir.empty()) return {};
  CheckpointBatch b;
  try {
    const nlohmann::json j = nlohmann::json::parse(fs::read_file(dir + "/state.json"));
    b.data_ranks = int(j.value("world_size", int64_t(1)));
    const nlohmann::json& data = j.at("data");
    b.global_batch = data.contains("global_batch")
                         ? data.at("global_batch").get<int64_t>()
                         : data.at("batch_size").get<int64_t>() * grad_accum * int64_t(b.data_ranks);
  } catch (const nlohmann::json::exception& e) {
    user_error("{}/state.json: {}", dir, e.what());
  }
  if (b.global_batch < 1 || b.data_ranks < 1)
    user_error("{}/state.json: global_batch {} / world_size {}: expected positive integers", dir, b.global_batch,
               b.data_ranks);
  return b;
}

}  // namespace dtrain

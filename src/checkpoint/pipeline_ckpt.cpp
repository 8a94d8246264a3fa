// Pipeline parallelism's checkpoints: every stage's parameters and optimizer state, gathered
// into the one-process model's universal layout on global rank 0 (checkpoint/pipeline_ckpt.h), and
// each stage's part of such a checkpoint at load (Pipeline::stage_slice).
#include "checkpoint/pipeline_ckpt.h"

#include <algorithm>
#include <cstring>

#include "parallel/tensor_parallel.h"
#include "session/pipeline.h"

namespace dtrain {

GptSpec Pipeline::full_spec() const {
  GptSpec s = chunks_.at(0)->spec();
  s.pp_first = 0;
  s.pp_layers = -1;
  s.pp_embed = s.pp_head = true;
  s.tp_size = 1;
  s.sequence_parallel = false;
  return s;
}

const ParamStore& Pipeline::full_layout() {
  if (!full_) {
    full_ = std::make_unique<ParamStore>();
    build_gpt(full_spec(), *full_);
  }
  return *full_;
}

std::vector<FlatPiece> Pipeline::stage_pieces(int rank) {
  const ParamStore& full = full_layout();
  ParamStore stage;  // the stage's chunks as one process declares them (no tensor parallelism)
  std::vector<std::unique_ptr<GptModel>> keep;
  for (int c = 0; c < l_.virtual_stages; ++c) keep.push_back(build_gpt(pipeline_chunk_spec(full_spec(), l_, rank, c), stage));
  std::vector<FlatPiece> out;
  for (const ParamDesc& d : stage.params()) {
    const int id = full.find_param(d.name);
    DTRAIN_CHECK(id >= 0, "pipeline: stage parameter '{}' is not in the full model", d.name);
    const ParamDesc& f = full.params()[size_t(id)];
    DTRAIN_CHECK(f.shape == d.shape, "pipeline: '{}' is {} on the stage, {} in the full model", d.name, d.shape.str(),
                 f.shape.str());
    out.push_back(FlatPiece{f.offset, d.offset, d.shape.numel()});
  }
  return out;
}

std::vector<float> Pipeline::stage_slice(const std::vector<float>& full) {
  const std::vector<FlatPiece> pieces = stage_pieces(rank_);
  int64_t n = 0;
  for (const FlatPiece& p : pieces) n = std::max(n, p.local + p.count);
  std::vector<float> out(static_cast<size_t>(n));
  for (const FlatPiece& p : pieces) {
    DTRAIN_CHECK(p.global + p.count <= int64_t(full.size()), "pipeline: stage slice beyond {} values", full.size());
    std::copy_n(full.begin() + p.global, p.count, out.begin() + p.local);
  }
  return out;
}

namespace {

std::vector<float> to_floats(const ParamStore::Exported& x) {
  std::vector<float> v(x.bytes.size() / 4);
  std::memcpy(v.data(), x.bytes.data(), v.size() * 4);
  return v;
}

ParamStore::Exported from_floats(std::string name, const std::vector<float>& v) {
  ParamStore::Exported x{std::move(name), "F32", {int64_t(v.size())}, std::vector<uint8_t>(v.size() * 4)};
  std::memcpy(x.bytes.data(), v.data(), x.bytes.size());
  return x;
}

}  // namespace

std::vector<ParamStore::Exported> local_optimizer_state(Optimizer& opt, const ParamStore& ps, comm::Communicator& dp) {
  Backend& be = ps.backend();
  const int64_t n = ps.num_params();
  std::vector<ParamStore::Exported> out = opt.export_state();
  for (ParamStore::Exported& x : out) {
    if (x.dtype != "F32") continue;
    std::vector<float> v = to_floats(x);
    if (int64_t(v.size()) == n) continue;
    // ZeRO: this rank's pieces (a range; ZeRO-3: its unit shards); the others' added (zeros elsewhere)
    DTRAIN_CHECK(int64_t(v.size()) == opt.owned(), "optimizer state '{}' of {} values, {} owned", x.name, v.size(),
                 opt.owned());
    std::vector<float> whole(size_t(n), 0.f);
    for (const FlatPiece& p : opt.pieces()) {
      DTRAIN_CHECK(p.global + p.count <= n, "optimizer piece at {} of {} beyond {}", p.global, p.count, n);
      std::copy_n(v.begin() + p.local, p.count, whole.begin() + p.global);
    }
    Buffer b(be, size_t(std::max<int64_t>(n, 1)) * 4);
    if (n) be.copy_from_host(b.data(), whole.data(), size_t(n) * 4);
    Tensor t = b.tensor(DType::F32, Shape{n});
    dp.allreduce(t, comm::ReduceOp::Sum);
    if (n) be.copy_to_host(whole.data(), b.data(), size_t(n) * 4);
    x = from_floats(x.name, whole);
  }
  return out;
}

PipelineCheckpoint pipeline_gather_checkpoint(Runtime& s, Optimizer* opt, parallel::DataParallel& data,
                                              comm::Communicator* tp) {
  comm::Communicator& dp = data.comm();
  Pipeline& pipe = *s.pipe;
  comm::Communicator& pp = *pipe.comm();
  ParamStore& ps = s.params;
  Backend& be = *s.be;
  const int64_t n = ps.num_params();
  // this stage's vectors in its local layout: the parameters, then each f32 optimizer state
  std::vector<std::vector<float>> vecs(1, std::vector<float>(size_t(n)));
  if (ps.sharded()) vecs[0] = data.gather_full_params();  // ZeRO-3 (collective over the data group)
  else if (n) be.copy_to_host(vecs[0].data(), ps.flat_params().data, size_t(n) * 4);
  std::vector<std::string> names;
  std::vector<ParamStore::Exported> others;  // "step"
  if (opt)
    for (ParamStore::Exported& x : local_optimizer_state(*opt, ps, data.state_comm())) {
      if (x.dtype != "F32") {
        others.push_back(std::move(x));
        continue;
      }
      names.push_back(x.name);
      vecs.push_back(to_floats(x));
    }
  // tensor parallel: the stage's universal layout (collective over the tp group)
  if (tp)
    for (auto& v : vecs) v = parallel::tp_gather_universal(*tp, ps, v);
  PipelineCheckpoint out;
  if (dp.rank() != 0 || (tp && tp->rank() != 0)) return out;  // one pipeline chain sends to global rank 0
  const int64_t nu = int64_t(vecs[0].size());
  const size_t k = vecs.size();
  if (pp.rank() != 0) {
    Buffer b(be, size_t(std::max<int64_t>(nu * int64_t(k), 1)) * 4);
    for (size_t i = 0; i < k; ++i)
      if (nu) be.copy_from_host(static_cast<float*>(b.data()) + i * size_t(nu), vecs[i].data(), size_t(nu) * 4);
    pp.send_async(b.tensor(DType::F32, Shape{nu * int64_t(k)}), 0,
                  fmt::format("checkpoint state of pipeline stage {}", pp.rank()))
        ->wait();
    return out;
  }
  const ParamStore& full = pipe.full_layout();
  const int64_t N = full.num_params();
  std::vector<std::vector<float>> all(k, std::vector<float>(size_t(N)));
  // the tied embedding (GPT-2's wte) as the first stage has it (under ZeRO-2 the last stage's optimizer state of
  // it may differ in the last bits: its copy of the weights is overwritten each step)
  const std::string& tied = pipe.layout().tied;  // "" for an untied head: nothing shared
  const int wte = tied.empty() ? -1 : full.find_param(tied);
  const int64_t wte_at = wte >= 0 ? full.params()[size_t(wte)].offset : -1;
  auto place = [&](int rank, const std::vector<std::vector<float>>& part) {
    for (const FlatPiece& p : pipe.stage_pieces(rank))
      if (rank == 0 || p.global != wte_at)
      for (size_t i = 0; i < k; ++i) std::copy_n(part[i].begin() + p.local, p.count, all[i].begin() + p.global);
  };
  place(0, vecs);
  for (int r = 1; r < pipe.stages(); ++r) {
    int64_t nr = 0;
    for (const FlatPiece& p : pipe.stage_pieces(r)) nr = std::max(nr, p.local + p.count);
    Buffer b(be, size_t(std::max<int64_t>(nr * int64_t(k), 1)) * 4);
    pp.recv_async(b.tensor(DType::F32, Shape{nr * int64_t(k)}), r, fmt::format("checkpoint state of pipeline stage {}", r))
        ->wait();
    std::vector<float> host(size_t(nr) * k);
    if (!host.empty()) be.copy_to_host(host.data(), b.data(), host.size() * 4);
    std::vector<std::vector<float>> part(k);
    for (size_t i = 0; i < k; ++i) part[i].assign(host.begin() + int64_t(i) * nr, host.begin() + int64_t(i + 1) * nr);
    place(r, part);
  }
  // the model file: every parameter under its PyTorch name and shape
  for (const ParamDesc& d : full.params()) out.model.push_back(full.export_param(d, all[0].data() + d.offset));
  for (size_t i = 1; i < k; ++i) out.optim.push_back(from_floats(names[i - 1], all[i]));
  for (auto& x : others) out.optim.push_back(std::move(x));
  out.layout = &full;
  return out;
}

}  // namespace dtrain

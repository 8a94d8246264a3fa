// Mixture of experts (nn/moe.h) on one process:
//  * against transformers 4.46.3 (needs DTRAIN_SOURCE_DIR/.venv/bin/python; SKIPPED otherwise):
//    dtrain's Mixtral and Qwen2-MoE models (a shared expert without renormalised gates; dense and
//    sparse layers alternating with a tied head and top-1) export their tensors and the
//    config.json a checkpoint holds; scripts/moe_reference.py loads them strictly into
//    MixtralForCausalLM / Qwen2MoeForCausalLM (float64, eager) and computes transformers' loss
//    with the load-balancing term; logits, loss and every gradient must match;
//  * a finite-difference gradient check of the MoE layer with the load-balancing loss, the z-loss,
//    a capacity that drops slots and a shared expert;
//  * bit-identical results on 1 and 2 threads, the capacity factor's drop count, GPT-2 experts,
//    parameter counts (Mixtral 8x7B's 46,702,792,704) and names.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>

#include "checkpoint/hf_config.h"
#include "checkpoint/safetensors.h"
#include "gradcheck.h"
#include "llama_fixture.h"
#include "nn/llama_layers.h"
#include "nn/moe.h"
#include "op_harness.h"
#include "plan/layout_planner.h"
#include "skip.h"

using namespace dtrain;
using testing::HostVec;
namespace fs = std::filesystem;

namespace {

const std::string kPython = DTRAIN_SOURCE_DIR "/.venv/bin/python";

LlamaConfig small(const char* type) {
  LlamaConfig c;
  c.model_type = type;
  c.vocab_size = 100, c.hidden_size = 32, c.intermediate_size = 48, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 16;
  if (c.model_type == "qwen2") c.rope_theta = 1e6;
  return c;
}

GptSpec moe_spec(const LlamaConfig& c, const MoeConfig& m) {
  GptSpec s = llama_spec(c);
  s.moe = m;
  return s;
}

MoeConfig experts(int e, int k, double aux) {
  MoeConfig m;
  m.num_experts = e, m.top_k = k, m.aux_loss_coef = aux;
  return m;
}

struct Step {
  HostVec logits;  // [B*T, vocab_size]
  double loss = 0;  // cross-entropy mean + the auxiliary terms
};

// One training step as the LM task takes it: forward, the mean cross-entropy, the routers'
// auxiliary losses (MoeStats::finish_micro), backward.
Step moe_step(Backend& be, Arena& arena, GptModel& model, const std::vector<int32_t>& ids,
              const std::vector<int32_t>& tgt, int64_t B, int64_t T) {
  Ctx ctx{be, arena, true, {}, {}};
  Tensor tid = arena.alloc(DType::I32, Shape{B, T}), ttg = arena.alloc(DType::I32, Shape{B * T});
  be.copy_from_host(tid.data, ids.data(), ids.size() * 4);
  be.copy_from_host(ttg.data, tgt.data(), tgt.size() * 4);
  Tensor logits = model.forward(ctx, tid);
  GptLoss loss;
  Tensor losses = loss.forward(ctx, logits, ttg, model.spec().vocab_size);
  Step out;
  out.loss = mean_loss(be, losses);
  if (MoeStats* m = model.moe_stats()) out.loss += m->finish_micro(1.f);
  model.backward(ctx, loss.backward());
  std::vector<float> lg;
  copy_to_host_f32(be, arena, logits, lg);
  const int64_t Vp = logits.dim(1), V = model.spec().vocab_size;
  for (int64_t i = 0; i < B * T; ++i) out.logits.insert(out.logits.end(), lg.begin() + i * Vp, lg.begin() + i * Vp + V);
  return out;
}

HostVec grads_of(Backend& be, const ParamStore& ps) {
  HostVec g(size_t(ps.num_params()));
  be.copy_to_host(g.data(), ps.flat_grads().data, g.size() * 4);
  return g;
}

// max |a - b| / max |b|
double max_rel(const HostVec& a, const HostVec& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(double(a[i]) - b[i])), m = std::max(m, std::fabs(double(b[i])));
  return d / std::max(m, 1e-30);
}

// the tests' batch: 2 sequences of 11 tokens
struct Batch : testing::RandomBatch {
  explicit Batch(int vocab, uint64_t seed = 9) : RandomBatch(vocab, 11, seed) {}
};

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("moe torch: Mixtral and Qwen2-MoE logits / loss with the load-balancing loss / every gradient match transformers in float64") {
  if (!fs::exists(kPython)) {
    SKIP_TEST("no " << kPython);
  }
  struct Case {
    const char* name;
    GptSpec spec;
  };
  std::vector<Case> cases;
  cases.push_back({"mixtral 4 experts top 2", moe_spec(small("llama"), experts(4, 2, 0.02))});
  {
    MoeConfig m = experts(4, 2, 0.01);
    m.norm_topk = false, m.expert_intermediate = 24, m.shared_intermediate = 40;
    cases.push_back({"qwen2_moe shared expert no renormalisation", moe_spec(small("qwen2"), m)});
  }
  {
    LlamaConfig c = small("qwen2");
    c.tie_word_embeddings = true, c.num_hidden_layers = 4;
    MoeConfig m = experts(3, 1, 0.05);
    m.every = 2, m.expert_intermediate = 20, m.shared_intermediate = 16;
    cases.push_back({"qwen2_moe every 2nd layer top 1 tied", moe_spec(c, m)});
  }
  struct Live {
    fs::path dir;
    std::unique_ptr<Backend> be;
    std::unique_ptr<ParamStore> ps;
    std::unique_ptr<GptModel> model;
  };
  const Batch batch(100);
  std::vector<Live> live;
  std::string cmd = kPython + " " DTRAIN_SOURCE_DIR "/scripts/moe_reference.py";
  for (const Case& cs : cases) {
    Live l{fs::path(DTRAIN_BUILD_DIR) / "test_moe_torch" / std::to_string(live.size()), make_backend("cpu"),
           std::make_unique<ParamStore>(), nullptr};
    fs::remove_all(l.dir);
    fs::create_directories(l.dir);
    l.model = build_gpt(cs.spec, *l.ps);
    l.ps->finalize(*l.be);
    l.ps->initialize(21 + uint64_t(live.size()));
    auto ex = l.ps->export_state();
    std::vector<StTensor> ts;
    for (auto& e : ex) ts.push_back({e.name, e.dtype, e.shape, e.bytes.data(), e.bytes.size()});
    write_safetensors((l.dir / "weights.safetensors").string(), ts, {});
    std::vector<StTensor> in = {
        {"ids", "I32", {batch.B, batch.T}, batch.ids.data(), batch.ids.size() * 4},
        {"targets", "I32", {batch.B, batch.T}, batch.tgt.data(), batch.tgt.size() * 4}};
    write_safetensors((l.dir / "inputs.safetensors").string(), in, {});
    std::ofstream(l.dir / "config.json") << hf_llama_config(l.model->spec());  // what a checkpoint holds
    cmd += " " + l.dir.string();
    live.push_back(std::move(l));
  }
  cmd += " 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  double worst_logits = 0, worst_loss = 0, worst_grad = 0;
  std::string worst_name;
  for (size_t i = 0; i < live.size(); ++i) {
    const std::string case_name = cases[i].name;
    CAPTURE(case_name);
    Live& l = live[i];
    SafetensorsReader ref((l.dir / "reference.safetensors").string());
    Arena arena(*l.be);
    const Step got = moe_step(*l.be, arena, *l.model, batch.ids, batch.tgt, batch.B, batch.T);
    const HostVec want_logits = read_f32(ref, "logits");
    const double want_loss = read_f32(ref, "loss")[0];
    CHECK(testing::nerr(got.logits, want_logits) < 1e-5);
    CHECK(got.loss == doctest::Approx(want_loss).epsilon(1e-5));
    CHECK(read_f32(ref, "aux")[0] > 0.f);
    worst_logits = std::max(worst_logits, max_rel(got.logits, want_logits));
    worst_loss = std::max(worst_loss, std::fabs(got.loss - want_loss) / std::fabs(want_loss));
    const HostVec g = grads_of(*l.be, *l.ps);
    int compared = 0;
    for (const auto& d : l.ps->params()) {
      CAPTURE(d.name);
      REQUIRE(ref.has("grad." + d.name));
      const HostVec w = read_f32(ref, "grad." + d.name);
      REQUIRE(int64_t(w.size()) <= d.shape.numel());
      const HostVec gd(g.begin() + d.offset, g.begin() + d.offset + int64_t(w.size()));
      CHECK(testing::nerr(gd, w) < 1e-4);
      CHECK(!testing::all_zero(gd));
      if (max_rel(gd, w) > worst_grad) worst_grad = max_rel(gd, w), worst_name = d.name;
      ++compared;
    }
    int grads = 0;
    for (const auto& n : ref.names()) grads += n.rfind("grad.", 0) == 0;
    CHECK(grads == compared);
  }
  MESSAGE("transformers vs dtrain (MoE) over " << live.size() << " configs: logits max rel " << worst_logits
                                                << ", loss rel " << worst_loss << ", gradients max rel " << worst_grad
                                                << " (" << worst_name << ")");
}

TEST_CASE("moe: the layer's gradients (experts / router / shared expert / load-balancing loss / z-loss / dropped slots) match finite differences") {
  for (const double capacity : {0.0, 0.6}) {
    CAPTURE(capacity);
    auto be = make_backend("cpu");
    ParamStore ps;
    LlamaLayerSpec s;
    s.hidden = 6, s.intermediate = 5, s.init_std = 0.5f;
    MoeConfig c = experts(4, 2, 0.3);
    c.z_loss_coef = 0.2, c.capacity_factor = capacity, c.shared_intermediate = 3;
    MoeStats stats(c, 1);
    auto expert = [&](ParamStore& p, const std::string& n) -> std::unique_ptr<Module> {
      return std::make_unique<SwiGluMlp>(p, n, s);
    };
    auto shared = [&](ParamStore& p, const std::string& n) -> std::unique_ptr<Module> {
      return std::make_unique<SwiGluMlp>(p, n, s, SwiGluNames{}, 3);
    };
    MoeMlp moe(ps, "mlp", 6, c, 0.5f, &stats, expert, shared);
    ps.finalize(*be);
    ps.initialize(3);
    const int64_t N = 9, C = 6;
    Buffer xb(*be, size_t(N * C) * 4);
    Tensor x = xb.tensor(DType::F32, Shape{N, C});
    std::vector<float> xh(size_t(N * C)), r(size_t(N * C));
    Rng g(4);
    for (auto& v : xh) v = g.normal();
    for (auto& v : r) v = g.normal();
    Arena arena(*be);
    Ctx ctx{*be, arena, true, {}, {}};
    // L = sum(r * y) + the auxiliary terms
    auto loss = [&]() {
      arena.reset();
      be->copy_from_host(x.data, xh.data(), xh.size() * 4);
      stats.begin_micro();
      Tensor y = moe.forward(ctx, x);
      const double aux = stats.finish_micro(1.f);
      std::vector<float> yh(size_t(y.numel()));
      be->copy_to_host(yh.data(), y.data, yh.size() * 4);
      double l = aux;
      for (size_t i = 0; i < yh.size(); ++i) l += double(yh[i]) * r[i];
      return l;
    };
    loss();
    ps.zero_grads();
    Tensor dy = arena.alloc(DType::F32, Shape{N, C});
    be->copy_from_host(dy.data, r.data(), r.size() * 4);
    Tensor dx = moe.backward(ctx, dy);
    std::vector<float> dxh(size_t(N * C));
    be->copy_to_host(dxh.data(), dx.data, dxh.size() * 4);
    std::vector<float> gh(size_t(ps.num_params())), ph(size_t(ps.num_params()));
    be->copy_to_host(gh.data(), ps.flat_grads().data, gh.size() * 4);
    be->copy_to_host(ph.data(), ps.flat_params().data, ph.size() * 4);
    testing::GradCheckOptions o;
    o.eps = 2e-3, o.threshold = 2e-2;
    auto rx = testing::check_gradient<float>(loss, xh, dxh, o);
    CHECK_MESSAGE(rx.ok, "dx " << rx.summary());
    CHECK(rx.skipped <= rx.checked / 5);
    std::vector<float> saved = ph;
    auto param_loss = [&]() {
      be->copy_from_host(ps.flat_params().data, ph.data(), ph.size() * 4);
      return loss();
    };
    o.max_checks = 300;
    auto rp = testing::check_gradient<float>(param_loss, ph, gh, o);
    CHECK_MESSAGE(rp.ok, "parameters " << rp.summary());
    CHECK(rp.skipped <= rp.checked / 5);
    be->copy_from_host(ps.flat_params().data, saved.data(), saved.size() * 4);
    // every parameter group got a gradient: the router, each expert, the shared expert and its gate
    for (const char* n : {"mlp.gate.weight", "mlp.shared_expert_gate.weight", "mlp.shared_expert.down_proj.weight",
                          "mlp.experts.0.gate_proj.weight", "mlp.experts.3.down_proj.weight"}) {
      CAPTURE(n);
      const auto& d = ps.params()[size_t(ps.find_param(n))];
      CHECK(!testing::all_zero(HostVec(gh.begin() + d.offset, gh.begin() + d.offset + d.shape.numel())));
    }
    const MoeStats::Step st = stats.take_step();
    CHECK(st.aux_loss > 0);
    CHECK(st.z_loss > 0);
    int64_t routed = 0;
    for (int64_t t : st.tokens_per_expert) routed += t;
    CHECK(routed == st.micro_batches * N * 2);
    if (capacity > 0) CHECK(st.dropped > 0);  // ceil(0.6 * 18 / 4) = 3 slots an expert
    else CHECK(st.dropped == 0);
  }
}

TEST_CASE("moe: a Mixtral step is bit-identical on 1 and 2 threads and run to run") {
  const GptSpec spec = moe_spec(small("llama"), experts(4, 2, 0.01));
  const Batch batch(100);
  auto run = [&](int threads) {
    auto be = make_backend("cpu", 0, threads);
    ParamStore ps;
    auto model = build_gpt(spec, ps);
    ps.finalize(*be);
    ps.initialize(5);
    Arena arena(*be);
    const Step s = moe_step(*be, arena, *model, batch.ids, batch.tgt, batch.B, batch.T);
    HostVec all = grads_of(*be, ps);
    all.insert(all.end(), s.logits.begin(), s.logits.end());
    all.push_back(float(s.loss));
    return all;
  };
  const HostVec a = run(1), b = run(2), c = run(2);
  CHECK(a == b);
  CHECK(b == c);
}

TEST_CASE("moe: a capacity factor drops the slots beyond an expert's capacity and counts them") {
  const Batch batch(100);
  auto run = [&](double factor, MoeStats::Step& st) {
    MoeConfig m = experts(4, 2, 0.01);
    m.capacity_factor = factor;
    auto be = make_backend("cpu");
    ParamStore ps;
    auto model = build_gpt(moe_spec(small("llama"), m), ps);
    ps.finalize(*be);
    ps.initialize(5);
    Arena arena(*be);
    const Step s = moe_step(*be, arena, *model, batch.ids, batch.tgt, batch.B, batch.T);
    st = model->moe_stats()->take_step();
    return s;
  };
  MoeStats::Step dropless, ample, tight;
  const Step a = run(0, dropless), b = run(4.0, ample), c = run(0.5, tight);
  CHECK(dropless.dropped == 0);
  CHECK(ample.dropped == 0);
  CHECK(a.logits == b.logits);  // a capacity nothing reaches changes nothing
  // 22 tokens x 2 slots over 4 experts at 0.5: 6 slots an expert, 2 layers; at least 44 - 24 a layer
  CHECK(tight.dropped >= 2 * (44 - 24));
  CHECK(tight.dropped < 2 * 44);
  CHECK(a.logits != c.logits);
  MESSAGE("capacity factor 0.5: " << tight.dropped << " of " << 2 * 22 * 2 << " slots dropped");
}

TEST_CASE("moe: GPT-2 with expert MLPs every 2nd block trains its router and experts") {
  GptSpec s = gpt_preset("tiny");
  s.n_layer = 2, s.vocab_size = 100, s.padded_vocab = 0;
  s.moe = experts(4, 2, 0.01);
  s.moe.every = 2;
  auto be = make_backend("cpu");
  ParamStore ps;
  auto model = build_gpt(s, ps);
  ps.finalize(*be);
  ps.initialize(7);
  CHECK(ps.find_param("transformer.h.0.mlp.c_fc.weight") >= 0);  // dense
  CHECK(ps.find_param("transformer.h.1.mlp.gate.weight") >= 0);
  CHECK(ps.find_param("transformer.h.1.mlp.experts.3.c_proj.bias") >= 0);
  CHECK(ps.find_param("transformer.h.1.mlp.c_fc.weight") < 0);
  GptSpec v = s;
  gpt_validate(v);
  CHECK(ps.num_params() == gpt_param_count(v, true));
  const Batch batch(100);
  Arena arena(*be);
  const Step st = moe_step(*be, arena, *model, batch.ids, batch.tgt, batch.B, batch.T);
  CHECK(std::isfinite(st.loss));
  const HostVec g = grads_of(*be, ps);
  const auto& d = ps.params()[size_t(ps.find_param("transformer.h.1.mlp.gate.weight"))];
  CHECK(!testing::all_zero(HostVec(g.begin() + d.offset, g.begin() + d.offset + d.shape.numel())));
}

TEST_CASE("moe: parameter names and counts (Mixtral 8x7B: 46702792704)") {
  LlamaConfig c;
  c.vocab_size = 32000, c.hidden_size = 4096, c.intermediate_size = 14336, c.num_hidden_layers = 32;
  c.num_attention_heads = 32, c.num_key_value_heads = 8, c.max_position_embeddings = 32768;
  c.rope_theta = 1e6, c.rms_norm_eps = 1e-5;
  GptSpec mixtral = moe_spec(c, experts(8, 2, 0.02));
  gpt_validate(mixtral);
  CHECK(gpt_param_count(mixtral, false) == 46702792704LL);
  // dtrain plan's shape of it: every expert in memory (the vocabulary needs no padding)
  CHECK(parallel::model_shape("mixtral-8x7b", mixtral).params() == 46702792704LL);
  // a small one: its flat buffer is the count, its names Hugging Face's
  for (const char* type : {"llama", "qwen2"}) {
    CAPTURE(type);
    MoeConfig m = experts(3, 2, 0.01);
    if (std::string(type) == "qwen2") m.shared_intermediate = 8, m.expert_intermediate = 12, m.every = 2;
    GptSpec s = moe_spec(small(type), m);
    gpt_validate(s);
    ParamStore ps;
    auto model = build_gpt(s, ps);
    CHECK(ps.num_params() == gpt_param_count(s, true));
    if (std::string(type) == "llama") {
      for (const char* n : {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.2.w1.weight",
                            "model.layers.1.block_sparse_moe.experts.2.w2.weight", "model.layers.0.block_sparse_moe.experts.0.w3.weight"})
        CHECK(ps.find_param(n) >= 0);
      CHECK(ps.params()[size_t(ps.find_param("model.layers.1.block_sparse_moe.experts.2.w1.weight"))].shape == Shape{48, 32});
    } else {
      CHECK(ps.find_param("model.layers.0.mlp.gate_proj.weight") >= 0);  // layer 0 dense
      for (const char* n : {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.2.up_proj.weight",
                            "model.layers.1.mlp.shared_expert.down_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight"})
        CHECK(ps.find_param(n) >= 0);
      CHECK(ps.params()[size_t(ps.find_param("model.layers.1.mlp.experts.2.up_proj.weight"))].shape == Shape{12, 32});
    }
  }
}

TEST_CASE("moe: refusals of the spec (top-k / tensor and pipeline parallelism / GPT-2 expert widths)") {
  auto refused = [](GptSpec s, const char* what) {
    CAPTURE(what);
    try {
      gpt_validate(s);
      FAIL("accepted");
    } catch (const UserError& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  GptSpec s = moe_spec(small("llama"), experts(4, 5, 0.01));
  refused(s, "num_experts_per_tok");
  s.moe.top_k = 2;
  s.tp_size = 2;
  refused(s, "tensor parallelism of mixture-of-experts");
  s.tp_size = 1;
  s.pp_layers = 1;
  refused(s, "pipeline stages");
  GptSpec g = gpt_preset("tiny");
  g.moe = experts(2, 1, 0.01);
  g.moe.shared_intermediate = 4;
  refused(g, "GPT-2's experts");
}

}  // TEST_SUITE("unit")

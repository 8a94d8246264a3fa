// The Llama family against Hugging Face transformers 4.46.3 (LlamaForCausalLM and
// Qwen2ForCausalLM, float64, eager attention):
//  * live (needs DTRAIN_SOURCE_DIR/.venv/bin/python with torch and transformers; SKIPPED
//    otherwise): dtrain builds and initialises a model, exports its tensors under Hugging
//    Face's names, scripts/llama_reference.py loads them strictly into transformers' model
//    and runs a batch (one Python process for every config); dtrain's logits, loss and every
//    parameter gradient must match, and its rotary inv_freq and cos/sin tables equal
//    transformers'. Configs: grouped-query with an untied head, multi-query with a tied head,
//    Llama 3.1 rope scaling and positions restarting per document, Qwen2's q/k/v biases (GQA
//    untied, MQA tied), Llama's attention and MLP biases with head_dim != hidden / heads.
//  * stored (tests/fixtures/llama.*.safetensors, scripts/make_llama_fixtures.py; no Python):
//    transformers' weights imported through ParamStore::import_state, the same comparison.
// Tolerances (f32 against float64): logits and every gradient 1e-5 / 1e-4 relative L2 (as the
// GPT-2 comparison), the loss 1e-5 relative; measured differences are printed.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>

#include "llama_fixture.h"
#include "models/rope.h"
#include "op_harness.h"
#include "skip.h"
#include "checkpoint/safetensors.h"

using namespace dtrain;
using testing::HostVec;
namespace fs = std::filesystem;

namespace {

const std::string kPython = DTRAIN_SOURCE_DIR "/.venv/bin/python";

struct Worst {
  double logits = 0, loss = 0, grad = 0;
  std::string grad_name;
};

// max |a - b| / max |b| over a tensor: the printed measure (the checks use nerr)
double max_rel(const HostVec& a, const HostVec& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(double(a[i]) - b[i])), m = std::max(m, std::fabs(double(b[i])));
  return d / std::max(m, 1e-30);
}

// dtrain's gradients (flat, internal layout: the first torch rows of a padded vocabulary) against
// `want(name)`; every parameter must be compared and none all zero.
template <class Want>
void check_grads(Backend& be, const ParamStore& ps, const Want& want, Worst& worst) {
  HostVec g(size_t(ps.num_params()));
  be.copy_to_host(g.data(), ps.flat_grads().data, g.size() * 4);
  for (const auto& d : ps.params()) {
    const HostVec w = want(d.name);
    REQUIRE(int64_t(w.size()) <= d.shape.numel());
    const HostVec got(g.begin() + d.offset, g.begin() + d.offset + int64_t(w.size()));
    CAPTURE(d.name);
    const double e = testing::nerr(got, w);
    CHECK(e < 1e-4);
    CHECK(!testing::all_zero(got));
    if (max_rel(got, w) > worst.grad) worst.grad = max_rel(got, w), worst.grad_name = d.name;
    if (d.layout == Layout::PadRows)  // padding rows get no gradient
      CHECK(std::all_of(g.begin() + d.offset + int64_t(w.size()), g.begin() + d.offset + d.shape.numel(),
                        [](float v) { return v == 0.f; }));
  }
}

void check_outputs(const testing::LlamaStep& got, const HostVec& logits, float loss, Worst& worst) {
  CHECK(testing::nerr(got.logits, logits) < 1e-5);
  CHECK(got.loss == doctest::Approx(loss).epsilon(1e-5));
  worst.logits = std::max(worst.logits, max_rel(got.logits, logits));
  worst.loss = std::max(worst.loss, std::fabs(got.loss - loss) / std::fabs(double(loss)));
}

struct Case {
  const char* name;
  LlamaConfig c;
  bool positions = false;
};

std::vector<Case> live_cases() {
  LlamaConfig base;
  base.vocab_size = 100, base.hidden_size = 32, base.intermediate_size = 56, base.num_hidden_layers = 2;
  base.num_attention_heads = 4, base.num_key_value_heads = 2, base.max_position_embeddings = 16;
  std::vector<Case> v;
  LlamaConfig gqa = base;
  gqa.rms_norm_eps = 1e-5;  // Llama's (the others 1e-6, Qwen2's)
  v.push_back({"llama gqa untied eps 1e-5", gqa});
  LlamaConfig mqa = base;
  mqa.num_key_value_heads = 1, mqa.tie_word_embeddings = true, mqa.rope_theta = 500000;
  mqa.rope_scaling = {"llama3", 4.0, 1.0, 4.0, 8};
  v.push_back({"llama mqa tied llama3 positions", mqa, true});
  LlamaConfig qwen = base;
  qwen.model_type = "qwen2";
  qwen.rope_theta = 1e6;  // Qwen2's
  v.push_back({"qwen2 gqa q/k/v bias", qwen});
  LlamaConfig qwen_tied = qwen;
  qwen_tied.num_key_value_heads = 1, qwen_tied.tie_word_embeddings = true;
  v.push_back({"qwen2 mqa tied", qwen_tied});
  LlamaConfig bias = base;
  bias.num_attention_heads = 4, bias.num_key_value_heads = 4, bias.head_dim = 6;
  bias.attention_bias = bias.mlp_bias = true;
  v.push_back({"llama mha biases head_dim 6", bias});
  return v;
}

// Perturbs the 1-D parameters (norm weights 1, biases 0 at init) so that none is trivial.
void perturb_vectors(Backend& be, ParamStore& ps) {
  Tensor flat = ps.flat_params();
  HostVec h(size_t(flat.numel()));
  be.copy_to_host(h.data(), flat.data, h.size() * 4);
  Rng r(5);
  for (const auto& d : ps.params())
    if (d.shape.ndim() == 1)
      for (int64_t i = 0; i < d.shape.numel(); ++i) h[size_t(d.offset + i)] += 0.1f * r.normal();
  be.copy_from_host(flat.data, h.data(), h.size() * 4);
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("llama torch: logits / loss / every gradient and the rotary tables match transformers' Llama and Qwen2 in float64") {
  if (!fs::exists(kPython)) {
    SKIP_TEST("no " << kPython);
  }
  // dtrain's models and inputs, exported; then one Python process computes every reference
  struct Live {
    Case cs;
    fs::path dir;
    std::unique_ptr<Backend> be;
    std::unique_ptr<ParamStore> ps;
    std::unique_ptr<GptModel> model;
    std::vector<int32_t> ids, tgt, pos;
  };
  const int64_t B = 2, T = 11;
  std::vector<Live> live;
  std::string cmd = kPython + " " DTRAIN_SOURCE_DIR "/scripts/llama_reference.py";
  for (const Case& cs : live_cases()) {
    Live l{cs, fs::path(DTRAIN_BUILD_DIR) / "test_llama_torch" / std::to_string(live.size()), make_backend("cpu"),
           std::make_unique<ParamStore>(), nullptr, {}, {}, {}};
    fs::remove_all(l.dir);
    fs::create_directories(l.dir);
    l.model = build_gpt(llama_spec(cs.c), *l.ps);
    l.ps->finalize(*l.be);
    l.ps->initialize(11 + uint64_t(live.size()));
    perturb_vectors(*l.be, *l.ps);
    Rng r(9);
    l.ids.resize(size_t(B * T));
    l.tgt.resize(size_t(B * T));
    for (auto& v : l.ids) v = int32_t(r.below(uint64_t(cs.c.vocab_size)));
    for (auto& v : l.tgt) v = int32_t(r.below(uint64_t(cs.c.vocab_size)));
    if (cs.positions)  // documents of 4, 4 and 3 tokens
      for (int64_t i = 0; i < B * T; ++i) l.pos.push_back(int32_t((i % T) % 4));
    auto ex = l.ps->export_state();
    std::vector<StTensor> ts;
    for (auto& e : ex) ts.push_back({e.name, e.dtype, e.shape, e.bytes.data(), e.bytes.size()});
    write_safetensors((l.dir / "weights.safetensors").string(), ts, {});
    std::vector<StTensor> in = {{"ids", "I32", {B, T}, l.ids.data(), l.ids.size() * 4},
                                {"targets", "I32", {B, T}, l.tgt.data(), l.tgt.size() * 4}};
    if (!l.pos.empty()) in.push_back({"positions", "I32", {B, T}, l.pos.data(), l.pos.size() * 4});
    write_safetensors((l.dir / "inputs.safetensors").string(), in, {});
    std::ofstream(l.dir / "config.json") << testing::llama_config_json(l.model->spec().llama).dump(2);
    cmd += " " + l.dir.string();
    live.push_back(std::move(l));
  }
  cmd += " 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);

  Worst worst;
  double table_diff = 0;
  int cases = 0;
  for (Live& l : live) {
    const std::string case_name = l.cs.name;
    CAPTURE(case_name);
    SafetensorsReader ref((l.dir / "reference.safetensors").string());
    Backend& be = *l.be;
    const ParamStore& ps = *l.ps;
    Arena arena(be);
    const testing::LlamaStep got = testing::llama_step(be, arena, *l.model, l.ids, l.tgt, B, T, l.pos);
    check_outputs(got, read_f32(ref, "logits"), read_f32(ref, "loss")[0], worst);
    check_grads(be, ps, [&](const std::string& n) { return read_f32(ref, "grad." + n); }, worst);
    // no gradient in the reference that dtrain lacks
    int grads = 0;
    for (const auto& n : ref.names()) grads += n.rfind("grad.", 0) == 0;
    CHECK(grads == int(ps.params().size()));

    // the rotary frequencies bit for bit; the tables within an ulp of transformers' f32 cos/sin
    const LlamaConfig& c = l.model->spec().llama;
    const std::vector<float> inv = rope_inv_freq(c.rope_theta, c.rope_scaling, c.head_size());
    CHECK(inv == read_f32(ref, "inv_freq"));
    std::vector<float> cos, sin;
    rope_tables(inv, c.max_position_embeddings, cos, sin);
    const HostVec rc = read_f32(ref, "cos"), rs = read_f32(ref, "sin");
    REQUIRE(rc.size() == cos.size());
    for (size_t i = 0; i < cos.size(); ++i)
      table_diff = std::max({table_diff, double(std::fabs(cos[i] - rc[i])), double(std::fabs(sin[i] - rs[i]))});
    ++cases;
  }
  CHECK(cases == 5);
  CHECK(table_diff <= 2.4e-7);  // 2 ulp of 1
  MESSAGE("transformers vs dtrain over " << cases << " configs: logits max rel " << worst.logits << ", loss rel "
                                         << worst.loss << ", gradients max rel " << worst.grad << " ("
                                         << worst.grad_name << "), rotary tables max abs " << table_diff);
}

TEST_CASE("llama torch: the stored transformers fixtures (gqa mqa qwen2 bias) give their logits / loss / gradients") {
  Worst worst;
  int cases = 0;
  for (const char* name : {"gqa", "mqa", "qwen2", "bias"}) {
    CAPTURE(name);
    const std::string path = std::string(DTRAIN_SOURCE_DIR) + "/tests/fixtures/llama." + name + ".safetensors";
    SafetensorsReader fx(path);
    const LlamaConfig c = testing::llama_config_from_json(nlohmann::json::parse(fx.metadata().at("config")));
    auto be = make_backend("cpu");
    ParamStore ps;
    auto model = build_gpt(llama_spec(c), ps);
    ps.finalize(*be);
    std::map<std::string, std::vector<uint8_t>> hold;
    ps.import_state(
        [&](const std::string& n) -> std::optional<ImportTensor> {
          const std::string k = "w." + n;
          if (!fx.has(k)) return std::nullopt;
          std::vector<uint8_t>& v = hold[n];
          v.resize(fx.nbytes(k));
          fx.read(k, v.data(), v.size());
          return ImportTensor{fx.dtype(k), fx.shape(k), v.data(), v.size()};
        },
        path);
    int weights = 0;
    for (const auto& n : fx.names()) weights += n.rfind("w.", 0) == 0;
    CHECK(weights == int(ps.state_entries().size()));  // every stored weight is used

    auto ints = [&](const char* n) {
      std::vector<int32_t> v(fx.nbytes(n) / 4);
      fx.read(n, v.data(), v.size() * 4);
      return v;
    };
    const std::vector<int32_t> ids = ints("ids"), tgt = ints("targets");
    const std::vector<int32_t> pos = fx.has("positions") ? ints("positions") : std::vector<int32_t>{};
    const int64_t B = fx.shape("ids")[0], T = fx.shape("ids")[1];
    Arena arena(*be);
    const testing::LlamaStep got = testing::llama_step(*be, arena, *model, ids, tgt, B, T, pos);
    check_outputs(got, read_f32(fx, "logits"), read_f32(fx, "loss")[0], worst);
    check_grads(*be, ps, [&](const std::string& n) { return read_f32(fx, "grad." + n); }, worst);
    CHECK(rope_inv_freq(c.rope_theta, c.rope_scaling, model->spec().llama.head_size()) == read_f32(fx, "inv_freq"));
    ++cases;
  }
  CHECK(cases == 4);
  MESSAGE("stored transformers fixtures vs dtrain: logits max rel " << worst.logits << ", loss rel " << worst.loss
                                                                      << ", gradients max rel " << worst.grad << " ("
                                                                      << worst.grad_name << ")");
}

}  // TEST_SUITE("unit")

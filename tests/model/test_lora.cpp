// LoRA adapters (nn/lora.h) without Python: a model built into a frozen store with adapters in a
// second, trainable one computes the logits of the same model with W + (alpha/r) B A merged into
// its weights, and its adapter gradients are the merged model's weight gradients mapped through
// the factors (dB = s dW A^T, dA = s B^T dW; transposed for GPT-2's Conv1D [in, out] weights);
// the Llama family with every target (q/k/v and gate/up as parts of stacked GEMMs, o/down) and
// GPT-2 (c_attn, both c_proj, c_fc: the MLP's fused GELU paths). The base store has no gradient
// buffer and is bit-identical after AdamW steps; recomputation is bit-identical to none.
// The comparison with PEFT itself is tests/interop/test_lora_peft.cpp.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "llama_fixture.h"
#include "nn/lora.h"
#include "op_harness.h"
#include "optim/optimizer.h"

using namespace dtrain;
using testing::HostVec;

namespace {

LlamaConfig small_llama() {
  LlamaConfig c;
  c.vocab_size = 100, c.hidden_size = 32, c.intermediate_size = 48, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 16;
  c.attention_bias = true;
  return c;
}

GptSpec small_gpt2() {
  GptSpec s;
  s.n_layer = 2, s.n_head = 2, s.n_embd = 32, s.block_size = 16, s.vocab_size = 100;
  gpt_validate(s);
  return s;
}

HostVec host_of(Backend& be, const Tensor& t) {
  HostVec v(size_t(t.numel()));
  be.copy_to_host(v.data(), t.data, v.size() * 4);
  return v;
}

// A model in a frozen store with rank-4 adapters (alpha 8) on `targets`; lora_B random (PEFT
// starts it at zero, which would hide half of the gradients).
struct LoraModel {
  ParamStore base, adapters;
  LoraOptions lo;
  std::unique_ptr<GptModel> model;
  LoraModel(Backend& be, const GptSpec& spec, std::vector<std::string> targets, Recompute = Recompute::None) {
    base.set_frozen(true);
    lo.adapters = &adapters;
    lo.rank = 4;
    lo.alpha = 8.f;
    lo.targets = std::move(targets);
    base.set_lora(&lo);
    model = build_gpt(spec, base);
    base.set_lora(nullptr);
    base.finalize(be);
    base.initialize(5);
    adapters.finalize(be);
    adapters.initialize(7);
    HostVec v = host_of(be, adapters.flat_params());
    Rng r(3);
    for (const ParamDesc& d : adapters.params())
      if (d.name.find("lora_B") != std::string::npos)
        for (int64_t k = 0; k < d.shape.numel(); ++k) v[size_t(d.offset + k)] = 0.2f * r.normal();
    be.copy_from_host(adapters.flat_params().data, v.data(), v.size() * 4);
  }
};

struct Batch {
  int64_t B = 2, T = 12;
  std::vector<int32_t> ids, tgt;
  explicit Batch(int vocab) {
    Rng r(9);
    for (int64_t i = 0; i < B * T; ++i) ids.push_back(int32_t(r.below(uint64_t(vocab))));
    for (int64_t i = 0; i < B * T; ++i) tgt.push_back(int32_t(r.below(uint64_t(vocab))));
  }
};

double rel_l2(const HostVec& a, const HostVec& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), n += double(b[i]) * b[i];
  return std::sqrt(d / std::max(n, 1e-30));
}

// The LoRA model against the same model with the adapters merged into its weights: logits, loss
// and every adapter gradient from the merged model's weight gradient.
void check_against_merged(GptSpec spec, const std::vector<std::string>& targets, size_t expect_adapters) {
  gpt_validate(spec);  // (the Llama's shape fields from its config)
  auto be = make_backend("cpu");
  LoraModel L(*be, spec, targets);
  CHECK(L.adapters.params().size() == 2 * expect_adapters);
  CHECK(L.base.frozen());
  CHECK_THROWS(L.base.grad(0));
  ParamStore plain;
  auto merged = build_gpt(spec, plain);
  plain.finalize(*be);
  plain.initialize(5);  // the base's values: the same declarations draw the same streams
  REQUIRE(plain.num_params() == L.base.num_params());
  HostVec w = host_of(*be, plain.flat_params());
  CHECK(testing::bit_equal(w, host_of(*be, L.base.flat_params())));
  const HostVec ad = host_of(*be, L.adapters.flat_params());
  const float s = L.lo.scaling();
  struct Pair {
    const ParamDesc *a, *b, *w;
  };
  std::vector<Pair> pairs;
  for (size_t i = 0; i + 1 < L.adapters.params().size(); i += 2) {
    const ParamDesc& a = L.adapters.params()[i];
    const ParamDesc& b = L.adapters.params()[i + 1];
    const std::string module = a.name.substr(std::string(kLoraPrefix).size(), a.name.size() - std::string(kLoraPrefix).size() - 14);
    REQUIRE(b.name == lora_param_name(module, true));
    const int id = plain.find_param(module + ".weight");
    REQUIRE_MESSAGE(id >= 0, module);
    pairs.push_back({&a, &b, &plain.params()[size_t(id)]});
  }
  for (const Pair& p : pairs) {  // W += s B A (Conv1D: its transpose)
    const int64_t r = p.a->shape[0], in = p.a->shape[1], out = p.b->shape[0];
    const bool in_out = spec.family == "gpt2";  // GPT-2's Conv1D weights are [in, out]
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k) acc += double(ad[size_t(p.b->offset + o * r + k)]) * ad[size_t(p.a->offset + k * in + i)];
        w[size_t(p.w->offset + (in_out ? i * out + o : o * in + i))] += float(s * acc);
      }
  }
  be->copy_from_host(plain.flat_params().data, w.data(), w.size() * 4);
  Batch batch(spec.vocab_size);
  Arena a1(*be), a2(*be);
  const auto lora = testing::llama_step(*be, a1, *L.model, batch.ids, batch.tgt, batch.B, batch.T);
  const auto ref = testing::llama_step(*be, a2, *merged, batch.ids, batch.tgt, batch.B, batch.T);
  MESSAGE("logits relative L2 " << rel_l2(lora.logits, ref.logits) << ", loss " << lora.loss << " vs " << ref.loss);
  CHECK(rel_l2(lora.logits, ref.logits) < 1e-5);
  CHECK(std::abs(lora.loss - ref.loss) <= 1e-5 * ref.loss);
  const HostVec g = host_of(*be, L.adapters.flat_grads()), gw = host_of(*be, plain.flat_grads());
  double worst = 0;
  for (const Pair& p : pairs) {
    const int64_t r = p.a->shape[0], in = p.a->shape[1], out = p.b->shape[0];
    const bool in_out = spec.family == "gpt2";
    auto dW = [&](int64_t o, int64_t i) { return double(gw[size_t(p.w->offset + (in_out ? i * out + o : o * in + i))]); };
    HostVec ea(size_t(r * in)), eb(size_t(out * r)), ga(size_t(r * in)), gb(size_t(out * r));
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < r; ++k) {
        double acc = 0;  // dB = s dW A^T
        for (int64_t i = 0; i < in; ++i) acc += dW(o, i) * ad[size_t(p.a->offset + k * in + i)];
        eb[size_t(o * r + k)] = float(s * acc);
        gb[size_t(o * r + k)] = g[size_t(p.b->offset + o * r + k)];
      }
    for (int64_t k = 0; k < r; ++k)
      for (int64_t i = 0; i < in; ++i) {
        double acc = 0;  // dA = s B^T dW
        for (int64_t o = 0; o < out; ++o) acc += double(ad[size_t(p.b->offset + o * r + k)]) * dW(o, i);
        ea[size_t(k * in + i)] = float(s * acc);
        ga[size_t(k * in + i)] = g[size_t(p.a->offset + k * in + i)];
      }
    CAPTURE(p.a->name);
    CHECK(!testing::all_zero(ga));
    CHECK(!testing::all_zero(gb));
    CHECK(rel_l2(ga, ea) < 1e-4);
    CHECK(rel_l2(gb, eb) < 1e-4);
    worst = std::max({worst, rel_l2(ga, ea), rel_l2(gb, eb)});
  }
  MESSAGE(pairs.size() << " adapters: largest gradient relative L2 against the merged model's " << worst);
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("lora: a Llama with adapters on every projection computes the merged model's logits and gradients") {
  check_against_merged(llama_spec(small_llama()),
                       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, 14);
}

TEST_CASE("lora: a Llama with adapters on q_proj and v_proj only (parts of the stacked GEMM) computes the merged model's") {
  check_against_merged(llama_spec(small_llama()), {"q_proj", "v_proj"}, 4);
}

TEST_CASE("lora: GPT-2 with adapters on c_attn - c_proj and c_fc (Conv1D layouts) computes the merged model's") {
  check_against_merged(small_gpt2(), {"c_attn", "c_proj", "c_fc"}, 8);
  check_against_merged(small_gpt2(), {"c_attn"}, 2);
}

TEST_CASE("lora: the base store stays bit-identical through AdamW steps - only the adapters move") {
  auto be = make_backend("cpu");
  LoraModel L(*be, llama_spec(small_llama()), {"q_proj", "v_proj", "down_proj"});
  const HostVec base0 = host_of(*be, L.base.flat_params()), ad0 = host_of(*be, L.adapters.flat_params());
  AdamWConfig c;
  c.weight_decay = 0.1f;  // decays every parameter it owns: the frozen ones must not be among them
  AdamW opt(L.adapters, c);
  Batch batch(100);
  for (int step = 0; step < 3; ++step) {
    L.adapters.zero_grads();
    Arena arena(*be);
    testing::llama_step(*be, arena, *L.model, batch.ids, batch.tgt, batch.B, batch.T);
    opt.step(1e-2f, 1.f);
  }
  CHECK(testing::bit_equal(host_of(*be, L.base.flat_params()), base0));
  const HostVec ad1 = host_of(*be, L.adapters.flat_params());
  size_t moved = 0;
  for (size_t i = 0; i < ad1.size(); ++i) moved += ad1[i] != ad0[i];
  CHECK(moved == ad1.size());  // every adapter element moved
  // per layer r (in + out): q_proj 4 (32 + 32), v_proj 4 (32 + 16), down_proj 4 (48 + 32)
  CHECK(L.adapters.num_params() == 2 * (256 + 192 + 320));
  CHECK(L.base.num_params() > 10 * L.adapters.num_params());
}

TEST_CASE("lora: block and selective recomputation are bit-identical to none with adapters") {
  auto be = make_backend("cpu");
  HostVec ref_logits[2], ref_grads[2];
  for (Recompute mode : {Recompute::None, Recompute::Block, Recompute::Selective}) {
    CAPTURE(int(mode));
    for (bool gpt2 : {false, true}) {
      LoraModel L(*be, gpt2 ? small_gpt2() : llama_spec(small_llama()),
                  gpt2 ? std::vector<std::string>{"c_attn", "c_proj", "c_fc"}
                       : std::vector<std::string>{"q_proj", "v_proj", "o_proj", "up_proj", "down_proj"});
      Arena arena(*be), scratch(*be);
      Ctx ctx{*be, arena, true, {}, {}};
      ctx.recompute = mode;
      ctx.scratch = &scratch;
      Batch batch(100);
      Tensor tid = arena.alloc(DType::I32, Shape{batch.B, batch.T}), ttg = arena.alloc(DType::I32, Shape{batch.B * batch.T});
      be->copy_from_host(tid.data, batch.ids.data(), batch.ids.size() * 4);
      be->copy_from_host(ttg.data, batch.tgt.data(), batch.tgt.size() * 4);
      Tensor logits = L.model->forward(ctx, tid);
      GptLoss loss;
      loss.forward(ctx, logits, ttg, 100);
      L.model->backward(ctx, loss.backward());
      HostVec lg;
      copy_to_host_f32(*be, arena, logits, lg);
      const HostVec g = host_of(*be, L.adapters.flat_grads());
      if (mode == Recompute::None) {
        ref_logits[gpt2] = lg, ref_grads[gpt2] = g;
      } else {
        CHECK(testing::bit_equal(lg, ref_logits[gpt2]));
        CHECK(testing::bit_equal(g, ref_grads[gpt2]));
      }
      CHECK(!testing::all_zero(g));
    }
  }
}
}

// The Llama-family model without Python: the spec's switches and their validation, Hugging
// Face's parameter names and shapes and the parameter counts, transformers' initialisation,
// incremental decoding against the full forward (grouped-query K/V cache) and sampling with the
// cache against sampling without it, activation recomputation bit-identical to none, mixed
// precision close to f32, and tensor parallelism (key/value heads split over TP = 2, or
// replicated: multi-query on 2 ranks, 2 key/value heads on 4; with and without sequence
// parallelism; Gloo ranks in threads) against one process. The comparison with transformers
// itself is tests/model/test_llama_torch.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "gloo_ranks.h"
#include "llama_fixture.h"
#include "op_harness.h"
#include "parallel/tensor_parallel.h"

using namespace dtrain;
using testing::HostVec;

namespace {

LlamaConfig small(const char* type = "llama") {
  LlamaConfig c;
  c.model_type = type;
  c.vocab_size = 100, c.hidden_size = 32, c.intermediate_size = 48, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 16;
  return c;
}

std::map<std::string, std::vector<int64_t>> shapes_of(const ParamStore& ps) {
  std::map<std::string, std::vector<int64_t>> m;
  for (const auto& e : ps.state_entries()) m[e.name] = e.shape;
  return m;
}

HostVec grads_of(Backend& be, const ParamStore& ps) {
  HostVec g(size_t(ps.num_params()));
  be.copy_to_host(g.data(), ps.flat_grads().data, g.size() * 4);
  return g;
}

// the tests' batch: 2 sequences of 12 tokens
struct Batch : testing::RandomBatch {
  explicit Batch(int vocab, uint64_t seed = 9) : RandomBatch(vocab, 12, seed) {}
};

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("llama: spec switches - validation naming the keys - Hugging Face names and shapes - parameter counts") {
  // Llama 3.1 8B's shape: 8030261248 parameters (Meta's count), vocabulary 128256
  LlamaConfig l8;
  l8.vocab_size = 128256, l8.hidden_size = 4096, l8.intermediate_size = 14336, l8.num_hidden_layers = 32;
  l8.num_attention_heads = 32, l8.num_key_value_heads = 8, l8.max_position_embeddings = 8192;
  l8.rope_theta = 500000, l8.rope_scaling = {"llama3", 8.0, 1.0, 4.0, 8192};
  GptSpec s8 = llama_spec(l8);
  gpt_validate(s8);
  CHECK(s8.n_layer == 32);
  CHECK(s8.n_embd == 4096);
  CHECK(s8.block_size == 8192);
  CHECK(gpt_param_count(s8, false) == 8030261248);
  // Qwen2-0.5B: 494032768 parameters, tied head, q/k/v biases
  LlamaConfig q05 = small("qwen2");
  q05.vocab_size = 151936, q05.hidden_size = 896, q05.intermediate_size = 4864, q05.num_hidden_layers = 24;
  q05.num_attention_heads = 14, q05.num_key_value_heads = 2, q05.tie_word_embeddings = true;
  GptSpec sq = llama_spec(q05);
  gpt_validate(sq);
  CHECK(gpt_param_count(sq, false) == 494032768);

  for (bool tied : {false, true})
    for (const char* type : {"llama", "qwen2"}) {
      CAPTURE(tied);
      const std::string type_name = type;
      CAPTURE(type_name);
      LlamaConfig c = small(type);
      c.tie_word_embeddings = tied;
      ParamStore ps;
      auto m = build_gpt(llama_spec(c), ps);
      CHECK(ps.num_params() == gpt_param_count(m->spec(), true));
      auto sh = shapes_of(ps);
      int64_t total = 0;
      for (auto& [n, s] : sh) total += s[0] * (s.size() > 1 ? s[1] : 1);
      CHECK(total == gpt_param_count(m->spec(), false));
      const bool qwen = std::string(type) == "qwen2";
      CHECK(sh.size() == size_t(1 + 2 * (9 + (qwen ? 3 : 0)) + 1 + (tied ? 0 : 1)));
      CHECK(sh["model.embed_tokens.weight"] == std::vector<int64_t>{100, 32});
      CHECK(sh["model.layers.0.self_attn.q_proj.weight"] == std::vector<int64_t>{32, 32});
      CHECK(sh["model.layers.0.self_attn.k_proj.weight"] == std::vector<int64_t>{16, 32});
      CHECK(sh["model.layers.1.self_attn.v_proj.weight"] == std::vector<int64_t>{16, 32});
      CHECK(sh["model.layers.1.self_attn.o_proj.weight"] == std::vector<int64_t>{32, 32});
      CHECK(sh["model.layers.0.mlp.gate_proj.weight"] == std::vector<int64_t>{48, 32});
      CHECK(sh["model.layers.0.mlp.up_proj.weight"] == std::vector<int64_t>{48, 32});
      CHECK(sh["model.layers.0.mlp.down_proj.weight"] == std::vector<int64_t>{32, 48});
      CHECK(sh["model.layers.1.input_layernorm.weight"] == std::vector<int64_t>{32});
      CHECK(sh["model.layers.1.post_attention_layernorm.weight"] == std::vector<int64_t>{32});
      CHECK(sh["model.norm.weight"] == std::vector<int64_t>{32});
      CHECK(sh.count("lm_head.weight") == (tied ? 0u : 1u));
      CHECK(sh.count("model.layers.0.self_attn.k_proj.bias") == (qwen ? 1u : 0u));
      CHECK(sh.count("model.layers.0.self_attn.o_proj.bias") == 0);
      CHECK(ps.units().size() == 4);  // embed (root), 2 layers, norm + head (root)
    }

  auto bad = [](auto edit, const char* key) {
    LlamaConfig c = small();
    edit(c);
    GptSpec s = llama_spec(c);
    CHECK_THROWS_WITH_AS(gpt_validate(s), doctest::Contains(key), UserError);
  };
  bad([](LlamaConfig& c) { c.num_key_value_heads = 3; }, "model.num_key_value_heads");
  bad([](LlamaConfig& c) { c.hidden_size = 30; }, "model.hidden_size");
  bad([](LlamaConfig& c) { c.head_dim = 5; }, "model.head_dim");
  bad([](LlamaConfig& c) { c.rope_scaling.rope_type = "yarn"; }, "model.rope_scaling.rope_type");
  bad([](LlamaConfig& c) { c.rope_scaling = {"llama3", 8, 4, 1, 8192}; }, "model.rope_scaling");
  bad([](LlamaConfig& c) { c.model_type = "qwen2", c.attention_bias = true; }, "model.attention_bias");
  bad([](LlamaConfig& c) { c.model_type = "mistral"; }, "model.model_type");
  bad([](LlamaConfig& c) { c.rms_norm_eps = 0; }, "model.rms_norm_eps");
  {
    // tensor parallel: key/value heads split (T divides 2) or replicated (2 T divides the query heads)
    auto tp = [](int heads, int kv, int T) {
      LlamaConfig c = small();
      c.num_attention_heads = heads, c.num_key_value_heads = kv;
      GptSpec s = llama_spec(c);
      s.tp_size = T;
      gpt_validate(s);
    };
    CHECK_NOTHROW(tp(4, 2, 2));  // split
    CHECK_NOTHROW(tp(8, 2, 4));  // replicated: each rank 1 of each group's 4 query heads
    CHECK_NOTHROW(tp(4, 1, 4));  // multi-query replicated
    // 2 key/value heads over 4 ranks with 2 query heads per group: half a head per rank
    CHECK_THROWS_WITH_AS(tp(4, 2, 4), doctest::Contains("model.num_key_value_heads"), UserError);
    CHECK_THROWS_WITH_AS(tp(4, 2, 3), doctest::Contains("model.num_attention_heads"), UserError);
  }
  GptSpec fam;
  fam.family = "mamba";
  CHECK_THROWS_WITH_AS(gpt_validate(fam), doctest::Contains("model.family"), UserError);
}

TEST_CASE("llama: init as transformers (Normal initializer_range for every Linear and the embedding - norms 1 - biases 0 - padding rows 0)") {
  auto be = make_backend("cpu");
  LlamaConfig c = small("qwen2");
  c.hidden_size = 64, c.intermediate_size = 128, c.initializer_range = 0.05;
  ParamStore ps;
  auto m = build_gpt(llama_spec(c), ps);
  ps.finalize(*be);
  ps.initialize(3);
  auto values = [&](const std::string& name) {
    const int id = ps.find_param(name);
    REQUIRE(id >= 0);
    HostVec v(size_t(ps.params()[size_t(id)].shape.numel()));
    be->copy_to_host(v.data(), ps.param(id).data, v.size() * 4);
    return v;
  };
  auto rms = [](const HostVec& v, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += double(v[i]) * v[i];
    return std::sqrt(s / double(n));
  };
  for (const char* n : {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                        "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight", "lm_head.weight"}) {
    CAPTURE(n);
    const HostVec v = values(n);
    CHECK(rms(v, std::string(n) == "lm_head.weight" ? 100 * 64 : v.size()) == doctest::Approx(0.05).epsilon(0.06));
  }
  const HostVec emb = values("model.embed_tokens.weight");
  CHECK(rms(emb, 100 * 64) == doctest::Approx(0.05).epsilon(0.06));
  CHECK(std::all_of(emb.begin() + 100 * 64, emb.end(), [](float f) { return f == 0.f; }));  // padding rows
  for (const char* n : {"model.layers.0.input_layernorm.weight", "model.norm.weight"}) {
    const HostVec v = values(n);
    CHECK(std::all_of(v.begin(), v.end(), [](float f) { return f == 1.f; }));
  }
  const HostVec b = values("model.layers.0.self_attn.k_proj.bias");
  CHECK(std::all_of(b.begin(), b.end(), [](float f) { return f == 0.f; }));
}

TEST_CASE("llama: incremental decoding with the grouped-query K/V cache gives the full forward's logits") {
  auto be = make_backend("cpu");
  for (int kv : {2, 1}) {
    CAPTURE(kv);
    LlamaConfig c = small();
    c.num_key_value_heads = kv;
    c.rope_scaling = {"llama3", 4.0, 1.0, 4.0, 8};
    ParamStore ps;
    auto m = build_gpt(llama_spec(c), ps);
    ps.finalize(*be);
    ps.initialize(7);
    const int64_t T = 10, V = c.vocab_size, Vp = m->spec().padded_vocab;
    Batch batch{int(V)};
    std::vector<int32_t> ids(batch.ids.begin(), batch.ids.begin() + T);
    Arena arena(*be);
    Ctx ctx{*be, arena, false, {}, {}};
    Tensor tid = arena.alloc(DType::I32, Shape{1, T});
    be->copy_from_host(tid.data, ids.data(), ids.size() * 4);
    HostVec full;
    copy_to_host_f32(*be, arena, m->forward(ctx, tid), full);
    m->decode_begin(*be, 1);
    double worst = 0;
    for (int64_t p = 0; p < T; ++p) {
      Tensor one = arena.alloc(DType::I32, Shape{1});
      be->copy_from_host(one.data, &ids[size_t(p)], 4);
      HostVec step;
      copy_to_host_f32(*be, arena, m->decode_step(ctx, one, p), step);
      const HostVec want(full.begin() + p * Vp, full.begin() + p * Vp + V), got(step.begin(), step.begin() + V);
      CHECK(testing::nerr(got, want) < 1e-5);
      worst = std::max(worst, testing::nerr(got, want));
    }
    MESSAGE("n_kv_head " << kv << ": decode vs forward logits, largest relative L2 error " << worst);
  }
}

TEST_CASE("llama: gpt_generate with the K/V cache gives the tokens of full forwards (greedy and sampled)") {
  auto be = make_backend("cpu");
  LlamaConfig c = small();
  c.num_key_value_heads = 1;  // multi-query: one cached key/value head
  c.initializer_range = 0.2;  // peaked logits: the tokens depend on the context
  ParamStore ps;
  auto m = build_gpt(llama_spec(c), ps);
  ps.finalize(*be);
  ps.initialize(21);
  Arena arena(*be);
  SampleOptions o;
  o.max_new_tokens = 20;  // passes max_position_embeddings 16: the window slides (full forwards)
  for (float temperature : {0.f, 1.f}) {
    CAPTURE(temperature);
    o.temperature = temperature;
    o.top_k = temperature > 0 ? 10 : 0;
    Rng r1(4), r2(4);
    o.kv_cache = false;
    const auto ref = gpt_generate(*m, *be, arena, {5, 17, 2}, o, r1);
    o.kv_cache = true;
    const auto got = gpt_generate(*m, *be, arena, {5, 17, 2}, o, r2);
    REQUIRE(ref.size() == 23);
    CHECK(got == ref);
    CHECK(std::count(ref.begin() + 3, ref.end(), ref[3]) < 20);  // not one token repeated
  }
}

TEST_CASE("llama: block and selective recomputation are bit-identical to none (logits - loss - every gradient)") {
  auto be = make_backend("cpu");
  LlamaConfig c = small("qwen2");
  Batch batch(c.vocab_size);
  std::vector<int32_t> pos;
  for (int64_t i = 0; i < batch.B * batch.T; ++i) pos.push_back(int32_t((i % batch.T) % 5));
  HostVec ref_logits, ref_grads;
  double ref_loss = 0;
  for (Recompute mode : {Recompute::None, Recompute::Block, Recompute::Selective}) {
    CAPTURE(int(mode));
    ParamStore ps;
    auto m = build_gpt(llama_spec(c), ps);
    ps.finalize(*be);
    ps.initialize(5);
    Arena arena(*be), scratch(*be);
    Ctx ctx{*be, arena, true, {}, {}};
    ctx.recompute = mode;
    ctx.scratch = &scratch;
    Tensor tid = arena.alloc(DType::I32, Shape{batch.B, batch.T}), ttg = arena.alloc(DType::I32, Shape{batch.B * batch.T});
    Tensor tpos = arena.alloc(DType::I32, Shape{batch.B, batch.T});
    be->copy_from_host(tid.data, batch.ids.data(), batch.ids.size() * 4);
    be->copy_from_host(ttg.data, batch.tgt.data(), batch.tgt.size() * 4);
    be->copy_from_host(tpos.data, pos.data(), pos.size() * 4);
    dynamic_cast<LlamaModel&>(*m).set_positions(tpos);
    Tensor logits = m->forward(ctx, tid);
    GptLoss loss;
    const double l = mean_loss(*be, loss.forward(ctx, logits, ttg, c.vocab_size));
    m->backward(ctx, loss.backward());
    HostVec lg;
    copy_to_host_f32(*be, arena, logits, lg);
    const HostVec g = grads_of(*be, ps);
    CHECK(!testing::all_zero(g));
    if (mode == Recompute::None) {
      ref_logits = lg, ref_grads = g, ref_loss = l;
      continue;
    }
    CHECK(testing::bit_equal(lg, ref_logits));
    CHECK(testing::bit_equal(g, ref_grads));
    CHECK(l == ref_loss);
  }
}

TEST_CASE("llama: bf16 and fp16 (emulated on the cpu) follow f32 within their precision") {
  auto be = make_backend("cpu");
  LlamaConfig c = small();
  c.num_key_value_heads = 1, c.tie_word_embeddings = true;
  Batch batch(c.vocab_size);
  testing::LlamaStep ref;
  HostVec ref_grads;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(dt));
    ParamStore ps;
    auto m = build_gpt(llama_spec(c), ps);
    ps.set_compute_dtype(dt);
    ps.finalize(*be);
    ps.initialize(21);
    ps.refresh_compute();
    Arena arena(*be);
    const testing::LlamaStep got = testing::llama_step(*be, arena, *m, batch.ids, batch.tgt, batch.B, batch.T);
    const HostVec g = grads_of(*be, ps);
    if (dt == DType::F32) {
      ref = got, ref_grads = g;
      continue;
    }
    const double tol = dt == DType::BF16 ? 2e-2 : 4e-3;
    CHECK(got.loss == doctest::Approx(ref.loss).epsilon(tol));
    CHECK(testing::nerr(got.logits, ref.logits) < 4 * tol);
    CHECK(testing::nerr(g, ref_grads) < 20 * tol);
    MESSAGE(dtype_name(dt) << ": loss " << got.loss << " (f32 " << ref.loss << "), logits rel L2 "
                           << testing::nerr(got.logits, ref.logits) << ", gradients rel L2 " << testing::nerr(g, ref_grads));
  }
}

TEST_CASE("llama: tensor parallel (key/value heads split or replicated - with and without sequence parallelism) gives one process's logits - loss - gradients") {
  struct TpCase {
    const char* type;
    int heads, kv_heads, W;
    bool sequence;
  };
  // split: T divides the key/value heads; replicated: multi-query on 2 ranks, 2 key/value heads
  // of 4 query heads each on 4 ranks
  for (const TpCase& tc : {TpCase{"llama", 4, 2, 2, false}, {"qwen2", 4, 2, 2, false}, {"llama", 4, 2, 2, true},
                           {"qwen2", 4, 2, 2, true}, {"llama", 4, 1, 2, false}, {"qwen2", 8, 2, 4, true}}) {
    const std::string what = fmt::format("{} heads {} kv {} TP={}{}", tc.type, tc.heads, tc.kv_heads, tc.W,
                                         tc.sequence ? "+SP" : "");
    CAPTURE(what);
    LlamaConfig c = small(tc.type);
    c.num_attention_heads = tc.heads, c.num_key_value_heads = tc.kv_heads;
    c.tie_word_embeddings = std::string(tc.type) == "qwen2";
    c.attention_bias = c.mlp_bias = std::string(tc.type) == "llama";  // row-parallel biases too
    const bool replicated = tc.kv_heads % tc.W != 0;
    Batch batch(c.vocab_size);
    // one process
    auto be1 = make_backend("cpu");
    ParamStore one;
    auto m1 = build_gpt(llama_spec(c), one);
    one.finalize(*be1);
    one.initialize(13);
    Arena a1(*be1);
    const testing::LlamaStep ref = testing::llama_step(*be1, a1, *m1, batch.ids, batch.tgt, batch.B, batch.T);
    const HostVec ref_grads = grads_of(*be1, one);
    // W ranks
    const int W = tc.W;
    const size_t nw = static_cast<size_t>(W);
    std::vector<HostVec> logits(nw), grads(nw);
    std::vector<double> loss(nw);
    std::vector<std::vector<FlatPiece>> pieces(nw);
    std::vector<std::vector<ParamDesc>> descs(nw);
    run_gloo_ranks(W, [&](int r, comm::GlooCommunicator& comm) {
      auto be = make_backend("cpu", 0, 1);
      parallel::CommTensorParallel tp(comm);
      GptSpec s = llama_spec(c);
      s.tp_size = W;
      s.sequence_parallel = tc.sequence;
      ParamStore ps;
      ps.set_tensor_parallel(r, W);
      auto m = build_gpt(s, ps);
      ps.finalize(*be);
      ps.initialize(13);
      Arena arena(*be);
      Ctx ctx{*be, arena, true, {}, {}};
      ctx.tp = &tp;
      Tensor tid = arena.alloc(DType::I32, Shape{batch.B, batch.T}), ttg = arena.alloc(DType::I32, Shape{batch.B * batch.T});
      be->copy_from_host(tid.data, batch.ids.data(), batch.ids.size() * 4);
      be->copy_from_host(ttg.data, batch.tgt.data(), batch.tgt.size() * 4);
      Tensor lg = m->forward(ctx, tid);
      GptLoss l;
      loss[size_t(r)] = mean_loss(*be, l.forward(ctx, lg, ttg, c.vocab_size));
      m->backward(ctx, l.backward());
      // the partial gradients (norms under sequence parallelism, replicated k_proj / v_proj)
      parallel::tp_sum_partial_grads(tp, ps, arena);
      copy_to_host_f32(*be, arena, lg, logits[size_t(r)]);
      grads[size_t(r)] = grads_of(*be, ps);
      pieces[size_t(r)] = ps.tp_pieces(r);
      descs[size_t(r)] = ps.params();
    });
    // logits: rank r holds vocabulary columns [r*Vl, (r+1)*Vl)
    const int64_t N = batch.B * batch.T, Vl = int64_t(logits[0].size()) / N;
    HostVec lg;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t v = 0; v < c.vocab_size; ++v) lg.push_back(logits[size_t(v / Vl)][size_t(i * Vl + v % Vl)]);
    CHECK(testing::nerr(lg, ref.logits) < 1e-5);
    for (int r = 0; r < W; ++r) CHECK(loss[size_t(r)] == doctest::Approx(ref.loss).epsilon(1e-5));
    // every rank's gradients against one process's, through the universal layout
    HostVec assembled(ref_grads.size(), 0.f);
    double worst = 0;
    for (int r = 0; r < W; ++r)
      for (const FlatPiece& p : pieces[size_t(r)])
        for (int64_t k = 0; k < p.count; ++k) {
          const float v = grads[size_t(r)][size_t(p.local + k)], want = ref_grads[size_t(p.global + k)];
          worst = std::max(worst, double(std::fabs(v - want)));
          assembled[size_t(p.global + k)] = v;
        }
    CHECK(testing::nerr(assembled, ref_grads) < 1e-5);
    CHECK(worst < 1e-5);
    // cut per layer: q (+k, v when split), o_proj, gate, up, down, and the column-parallel biases
    size_t cut = 0, partial = 0;
    for (const ParamDesc& d : descs[0]) cut += d.tp_dim >= 0, partial += d.tp_partial;
    const size_t qkv_cut = replicated ? 1 : 3, bias_cut = (replicated ? 1 : 3) + (c.mlp_bias ? 2 : 0);
    CHECK(cut == 2 * (qkv_cut + 4 + bias_cut) + (c.tie_word_embeddings ? 1 : 2));
    CHECK(partial == (tc.sequence ? 2 * 2 + 1 : 0) + (replicated ? 2 * (2 + 2) : 0));
    MESSAGE(what << " vs one process: logits rel L2 " << testing::nerr(lg, ref.logits) << ", gradients max abs "
                 << worst);
  }
}

}  // TEST_SUITE("unit")

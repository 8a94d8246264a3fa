// GPT incremental decoding (K/V cache): decode_step logits equal the full forward's at
// every position, and greedy sampling with the cache equals sampling without it, also
// once the context slides past block_size.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"
#include "core/error.h"
#include "models/gpt.h"

using namespace dtrain;

namespace {

struct TinyGpt {
  std::unique_ptr<Backend> be = make_backend("cpu");
  GptSpec s;
  ParamStore ps;
  std::unique_ptr<GptModel> model;
  explicit TinyGpt(int block, DType compute = DType::F32) {
    s = gpt_preset("tiny");
    s.vocab_size = 61;
    s.n_head = 4;
    s.block_size = block;
    model = build_gpt(s, ps);
    ps.set_compute_dtype(compute);
    ps.finalize(*be);
    ps.initialize(7);
    // Larger weights than the GPT-2 init so attention is far from uniform.
    Tensor flat = ps.flat_params();
    std::vector<float> host(size_t(flat.numel()));
    be->copy_to_host(host.data(), flat.data, host.size() * 4);
    for (float& v : host) v *= 6.f;
    be->copy_from_host(flat.data, host.data(), host.size() * 4);
    ps.refresh_compute();
  }
};

std::vector<float> to_host(Backend& be, const Tensor& t) {
  Arena scratch(be);
  std::vector<float> v;
  copy_to_host_f32(be, scratch, t, v);  // 16-bit logits (mixed precision) widened first
  return v;
}

// Worst |decode_step logit - full forward logit| over the largest logit, for T positions.
double decode_vs_forward(TinyGpt& g, int T) {
  Arena arena(*g.be);
  std::vector<int32_t> toks(static_cast<size_t>(T));
  for (int i = 0; i < T; ++i) toks[size_t(i)] = (i * 17 + 5) % g.s.vocab_size;
  Ctx ctx{*g.be, arena, /*training=*/false, {}};
  Tensor ids = arena.alloc(DType::I32, Shape{1, T});
  g.be->copy_from_host(ids.data, toks.data(), toks.size() * 4);
  const std::vector<float> full = to_host(*g.be, g.model->forward(ctx, ids));
  const int64_t Vp = g.s.padded_vocab;
  g.model->decode_begin(*g.be, 1);
  double worst = 0, scale = 0;
  for (int t = 0; t < T; ++t) {
    Tensor id = arena.alloc(DType::I32, Shape{1});
    g.be->copy_from_host(id.data, &toks[size_t(t)], 4);
    const std::vector<float> row = to_host(*g.be, g.model->decode_step(ctx, id, t));
    REQUIRE(int64_t(row.size()) == Vp);
    for (int64_t v = 0; v < g.s.vocab_size; ++v) {
      worst = std::max(worst, double(std::fabs(row[size_t(v)] - full[size_t(t * Vp + v)])));
      scale = std::max(scale, double(std::fabs(full[size_t(t * Vp + v)])));
    }
  }
  INFO("largest logit " << scale << ", worst difference " << worst);
  REQUIRE(scale > 0.1);  // the logits are not trivially small
  return worst / scale;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("gpt decode: cached logits equal the full forward at every position") {
  TinyGpt g(16);
  // f32: the same math, but GEMMs of one row instead of T rows sum in another order.
  CHECK(decode_vs_forward(g, 13) < 1e-5);
  Arena arena(*g.be);
  Ctx ctx{*g.be, arena, /*training=*/false, {}};
  Tensor id = arena.alloc(DType::I32, Shape{1});
  CHECK_THROWS_AS(g.model->decode_step(ctx, id, 16), UserError);
}

TEST_CASE("gpt decode: with bf16 or fp16 weights and a 16-bit K/V cache the logits follow the full forward") {
  // Both paths round every op's output to 16 bits, but a one-row GEMM may round a value to
  // the neighbouring 16-bit number where the T-row one did not: agreement to a few ulps of
  // bf16 (2^-8) / fp16 (2^-11) relative to the largest logit, not bit for bit.
  TinyGpt b(16, DType::BF16);
  CHECK(decode_vs_forward(b, 13) < 3e-2);
  TinyGpt h(16, DType::F16);
  CHECK(decode_vs_forward(h, 13) < 5e-3);
}

TEST_CASE("gpt decode: greedy tokens with the K/V cache equal those without it") {
  TinyGpt g(8);
  Arena arena(*g.be);
  SampleOptions o;
  o.max_new_tokens = 14;  // passes block_size 8: the window slides (full-forward steps)
  o.temperature = 0.f;
  Rng r1(1), r2(1);
  o.kv_cache = false;
  const auto ref = gpt_generate(*g.model, *g.be, arena, {3, 1, 4}, o, r1);
  o.kv_cache = true;
  const auto got = gpt_generate(*g.model, *g.be, arena, {3, 1, 4}, o, r2);
  REQUIRE(ref.size() == 17);
  CHECK(got == ref);
  // Not a constant sequence (the check above would be weak then).
  CHECK(std::count(ref.begin() + 3, ref.end(), ref[3]) < 14);
}

TEST_CASE("attention_decode: bad cache shapes or positions are faults") {
  auto be = make_backend("cpu");
  Arena arena(*be);
  Tensor qkv = arena.alloc(DType::F32, Shape{1, 12});
  Tensor k = arena.alloc(DType::F32, Shape{1, 2, 4, 2});
  Tensor v = arena.alloc(DType::F32, Shape{1, 2, 4, 2});
  Tensor out = arena.alloc(DType::F32, Shape{1, 4});
  be->fill(qkv, 0.5f);
  CHECK_NOTHROW(be->attention_decode(qkv, k, v, 0, out, 2));
  CHECK(to_host(*be, out)[0] == doctest::Approx(0.5f));
  CHECK_THROWS(be->attention_decode(qkv, k, v, 4, out, 2));
  CHECK_THROWS(be->attention_decode(qkv, k, v, 0, out, 3));
}

}  // TEST_SUITE

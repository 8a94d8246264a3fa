// Packed documents (data.packing): several documents in one row, each attending within itself
// with its positions restarting (GptModel::set_positions with documents), give the loss and every
// gradient of the same documents run one per row with padding (data.packing = false), within
// fp32 tolerance, for GPT-2 (learned positions, gathered) and the Llama family (rotary), plain and
// under block recompute; and the attention op with document positions equals attention over each
// document alone (forward and backward).
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "op_harness.h"
#include "backend/backend.h"
#include "core/rng.h"
#include "core/targets.h"
#include "models/gpt.h"
#include "nn/loss.h"
#include "nn/params.h"

using namespace dtrain;
using testing::HostVec;

namespace {

// Three documents of 5, 7 and 3 tokens; a target is the next token of the same document from
// its third token on (a prompt of two tokens), kIgnoreTarget elsewhere.
struct Docs {
  std::vector<std::vector<int32_t>> docs;
  explicit Docs(int vocab) {
    Rng r(21);
    for (int len : {5, 7, 3}) {
      std::vector<int32_t> d;
      for (int i = 0; i < len; ++i) d.push_back(int32_t(r.below(uint64_t(vocab))));
      docs.push_back(d);
    }
  }
  static int32_t target(const std::vector<int32_t>& d, size_t i) { return i >= 1 && i + 1 < d.size() ? d[i + 1] : kIgnoreTarget; }
};

struct Rows {
  int64_t B = 0, T = 0;
  std::vector<int32_t> ids, tgt, pos;
};

// packed: every document in one row of T (then padding); else one document per row.
Rows make_rows(const Docs& d, int64_t T, bool packed) {
  Rows r;
  r.T = T;
  r.B = packed ? 1 : int64_t(d.docs.size());
  r.ids.assign(size_t(r.B * T), 0);
  r.tgt.assign(size_t(r.B * T), kIgnoreTarget);
  r.pos.assign(size_t(r.B * T), 0);
  int64_t row = 0, t = 0;
  for (const auto& doc : d.docs) {
    for (size_t i = 0; i < doc.size(); ++i, ++t) {
      r.ids[size_t(row * T + t)] = doc[i];
      r.tgt[size_t(row * T + t)] = Docs::target(doc, i);
      r.pos[size_t(row * T + t)] = int32_t(i);
    }
    if (!packed) {
      for (int64_t p = 0; t < T; ++t, ++p) r.pos[size_t(row * T + t)] = int32_t(p);  // padding restarts
      ++row, t = 0;
    }
  }
  for (int64_t p = 0; packed && t < T; ++t, ++p) r.pos[size_t(t)] = int32_t(p);
  return r;
}

struct Result {
  double loss_sum = 0;
  HostVec grads;
};

Result run(Backend& be, const GptSpec& spec, const Rows& r, bool documents, Recompute rc) {
  ParamStore ps;
  auto m = build_gpt(spec, ps);
  ps.finalize(be);
  ps.initialize(3);
  Arena arena(be), scratch(be);
  Ctx ctx{be, arena, true, {}, {}};
  ctx.recompute = rc;
  ctx.scratch = &scratch;
  Tensor ids = arena.alloc(DType::I32, Shape{r.B, r.T}), tg = arena.alloc(DType::I32, Shape{r.B * r.T});
  be.copy_from_host(ids.data, r.ids.data(), r.ids.size() * 4);
  be.copy_from_host(tg.data, r.tgt.data(), r.tgt.size() * 4);
  if (documents) {
    Tensor pos = arena.alloc(DType::I32, Shape{r.B, r.T});
    be.copy_from_host(pos.data, r.pos.data(), r.pos.size() * 4);
    m->set_positions(pos, true);
  }
  Tensor logits = m->forward(ctx, ids);
  GptLoss loss;
  Result out;
  out.loss_sum = be.sum(loss.forward(ctx, logits, tg, spec.vocab_size, 1.f, 1));
  m->backward(ctx, loss.backward());
  out.grads.resize(size_t(ps.num_params()));
  be.copy_to_host(out.grads.data(), ps.flat_grads().data, out.grads.size() * 4);
  return out;
}

GptSpec tiny(const char* family) {
  GptSpec s;
  s.n_layer = 2, s.n_head = 4, s.n_embd = 32, s.block_size = 16, s.vocab_size = 97;
  if (std::string(family) == "llama") {
    s.family = "llama";
    LlamaConfig& l = s.llama;
    l.model_type = "llama";
    l.vocab_size = 97, l.hidden_size = 32, l.num_hidden_layers = 2, l.num_attention_heads = 4;
    l.num_key_value_heads = 2, l.intermediate_size = 48, l.max_position_embeddings = 16;
  }
  gpt_validate(s);
  return s;
}

}  // namespace

TEST_CASE("packing: packed documents give the loss and every gradient of one document per row (GPT-2 - Llama)") {
  auto be = make_backend("cpu");
  for (const char* family : {"gpt2", "llama"})
    for (Recompute rc : {Recompute::None, Recompute::Block}) {
      const std::string fam = family;
      CAPTURE(fam);
      CAPTURE(int(rc));
      const GptSpec spec = tiny(family);
      const Docs d(spec.vocab_size);
      const Result packed = run(*be, spec, make_rows(d, 16, true), true, rc);
      const Result single = run(*be, spec, make_rows(d, 16, false), false, rc);
      CHECK(packed.loss_sum > 0);
      CHECK(std::abs(packed.loss_sum - single.loss_sum) <= 1e-5 * single.loss_sum);
      REQUIRE(packed.grads.size() == single.grads.size());
      CHECK(!testing::all_zero(single.grads));
      double worst = 0, scale = 0;
      for (size_t i = 0; i < single.grads.size(); ++i) {
        worst = std::max(worst, double(std::abs(packed.grads[i] - single.grads[i])));
        scale = std::max(scale, double(std::abs(single.grads[i])));
      }
      MESSAGE(fam << " recompute " << int(rc) << ": loss sums " << packed.loss_sum << " / " << single.loss_sum
                     << ", largest gradient difference " << worst << " (largest gradient " << scale << ")");
      CHECK(worst <= 1e-5 * scale);
      // without the document mask the packed row's later documents see the earlier ones: a
      // different loss (the mask is what makes them equal)
      if (rc == Recompute::None) {
        const Result leaky = run(*be, spec, make_rows(d, 16, true), false, rc);
        CHECK(std::abs(leaky.loss_sum - single.loss_sum) > 1e-4 * single.loss_sum);
      }
    }
}

TEST_CASE("packing: attention with document positions equals attention over each document alone") {
  auto be = make_backend("cpu");
  const int64_t H = 4, Hkv = 2, hs = 8, W = (H + 2 * Hkv) * hs, C = H * hs;
  const std::vector<int64_t> lens = {4, 1, 6, 3};  // one row of 14 tokens
  int64_t T = 0;
  for (int64_t l : lens) T += l;
  Rng r(5);
  HostVec qkv(size_t(T * W)), dout(size_t(T * C));
  for (auto& v : qkv) v = float(r.uniform() * 2 - 1);
  for (auto& v : dout) v = float(r.uniform() * 2 - 1);
  std::vector<int32_t> pos;
  for (int64_t l : lens)
    for (int64_t i = 0; i < l; ++i) pos.push_back(int32_t(i));
  Arena arena(*be);
  auto up = [&](const void* p, DType dt, Shape s) {
    Tensor t = arena.alloc(dt, s);
    be->copy_from_host(t.data, p, t.nbytes());
    return t;
  };
  auto attention = [&](const float* q, const float* g, int64_t len, const int32_t* docpos, HostVec& o, HostVec& dq) {
    Tensor tq = up(q, DType::F32, Shape{1, len, W}), tg = up(g, DType::F32, Shape{1, len, C});
    Tensor dp = docpos ? up(docpos, DType::I32, Shape{1, len}) : Tensor();
    Tensor out = arena.alloc(DType::F32, Shape{1, len, C}), dqkv = arena.alloc(DType::F32, Shape{1, len, W});
    const AttentionSaved sv = be->attention_saved(1, H, len, hs, DType::F32);
    Tensor saved = arena.alloc(sv.dtype, sv.shape);
    be->attention_fwd(tq, out, saved, int(H), int(Hkv), dp);
    be->attention_bwd(tg, tq, out, saved, dqkv, int(H), int(Hkv), dp);
    o.resize(size_t(len * C));
    dq.resize(size_t(len * W));
    be->copy_to_host(o.data(), out.data, o.size() * 4);
    be->copy_to_host(dq.data(), dqkv.data, dq.size() * 4);
  };
  HostVec out, dqkv;
  attention(qkv.data(), dout.data(), T, pos.data(), out, dqkv);
  int64_t start = 0;
  double worst = 0;
  for (int64_t l : lens) {
    HostVec o1, d1;
    attention(qkv.data() + start * W, dout.data() + start * C, l, nullptr, o1, d1);
    for (int64_t i = 0; i < l * C; ++i) worst = std::max(worst, double(std::abs(o1[size_t(i)] - out[size_t(start * C + i)])));
    for (int64_t i = 0; i < l * W; ++i) worst = std::max(worst, double(std::abs(d1[size_t(i)] - dqkv[size_t(start * W + i)])));
    start += l;
  }
  CHECK(worst <= 1e-6);
  // a position past its token's index (a document starting before the row) is refused
  std::vector<int32_t> bad = pos;
  bad[2] = 5;
  HostVec o, dq;
  CHECK_THROWS(attention(qkv.data(), dout.data(), T, bad.data(), o, dq));
}
